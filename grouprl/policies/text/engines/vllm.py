"""The vLLM text engine: an in-process `vllm.LLM` colocated with the trainer (arXiv:2309.06180).

Token ids in, token ids and log-probs out: prompts are given as token ids (vLLM never re-tokenises
them) and completions come back as the token ids vLLM sampled. Runs of identical consecutive prompts
(the G copies of one group prompt that the policy passes) become ONE vLLM request with `n` = G, so
the prompt is prefilled once; prefix caching (on by default) shares prompt blocks across requests
and multi-turn episodes.

The contract is HFEngine's (see hf.py / base.py), with these choices and deviations:
- Log-probs: the engine is built with `logprobs_mode="processed_logprobs"`, so the log-prob of each
  sampled token is taken under the distribution it was sampled from, after temperature -> top-k ->
  top-p (vLLM's order, the same as our HF engine's). Model `generation_config.json` sampling
  defaults are ignored (`generation_config="vllm"`), as in the HF engine.
- Greedy: vLLM's greedy path applies no temperature, so greedy log-probs are under softmax(logits)
  (temperature 1). The HF engine uses softmax(logits / temperature). Only evaluation decodes
  greedily and it never reads the log-probs; with temperature 1 the two agree.
- Where a completion ends: at the first EOS id (from the model's generation config, else the
  tokenizer; kept) or at the token that completes a stop string (kept, also when it runs past the
  string), as in the HF engine. vLLM detokenises only when stop strings are given.
- Seeds: every completion has its own seed, so it never depends on the rest of the batch: the
  caller's (`seeds=`, one per prompt, see engines/seeded.py), else base, base+1, ... with base
  drawn from a `random.Random(seed)` owned by the engine (reproducible from `run.seed` whatever
  else uses torch's global RNG). vLLM gives the n samples of a request seeds s, s+1, ..., so a run
  of identical prompts becomes one request only where the seeds count up by one. vLLM's random
  stream differs from the HF engine's: same seeds, different (equally distributed) samples.
- Weights: `load_weights(model_or_state_dict)` copies the trainer's full weights into vLLM's model
  in place (vLLM's `reload_weights`, through `collective_rpc`): each distinct tensor once, under
  the names vLLM's loader takes, with vLLM's MoE repack defect worked around (vllm_push.py); a
  peft model is merged into a copy first (the live adapter is untouched). The prefix cache is
  then reset: cached KV blocks were computed with the old weights. The first push of a model is
  checked (push_check.py): the engine's log-probs on a fixed probe must match the trainer's
  within a per-dtype bound, else PushMismatch names the gap and the likely parameters
  (`push_check="warn"` logs it instead, "off" skips it). A state dict push is not checked (there
  is no model to compare with); `check_push(model)` checks it.
- Sleep (GPU only, not testable on CPU): with `sleep_level` 1 or 2, `sleep()` (called by the
  trainer once a step's rollouts are done) frees vLLM's GPU memory for the update: level 1 offloads
  the weights to CPU memory, level 2 drops them, both drop the KV cache. A weight push wakes only
  the weight memory to receive the new weights; the next `generate` wakes the rest. Nothing else
  may use the engine while it sleeps (one-step-off async generation needs sleep "off").
- Scoring (`score`, the distillation teacher of algorithm.distill source `engine`): the log-probs
  of given completion tokens are vLLM's prompt log-probs of [prompt | completion] (one request
  per row, one throw-away generated token). vLLM computes prompt log-probs from the raw logits
  (no temperature, top-k or top-p), so they are under softmax(logits), temperature 1.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from typing import Any

from grouprl.policies.text.engines.base import GenerationOutput, SamplingParams, check_generate_args
from grouprl.policies.text.engines.push_check import check_push
from grouprl.policies.text.engines.vllm_push import (  # engine_state_dict: also imported from here
    engine_state_dict,
    load_into_vllm,
    unique_tensors,
)

SEED_RANGE = 2**30  # per-request seeds (+ n - 1 for the samples) stay in vLLM's int range


class _QuietRotaryReload(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" warning at each push: the rotary
    cos/sin cache is computed, not a checkpoint weight, and vLLM keeps it as it was. Any other
    layer that fails to load is still reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.args and record.args[0] == "RotaryEmbedding")


_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def prompt_runs(prompts: list[list[int]], seeds: list[int]) -> Iterator[tuple[int, int]]:
    """(start, count) for each run of identical consecutive prompts whose seeds count up by one
    (s, s+1, ...): vLLM gives the n samples of one request exactly those seeds."""
    start = 0
    while start < len(prompts):
        end = start + 1
        while (
            end < len(prompts)
            and prompts[end] == prompts[start]
            and seeds[end] == seeds[start] + (end - start)
        ):
            end += 1
        yield start, end - start
        start = end


class VLLMEngine:
    """Generates with an in-process `vllm.LLM` (build one with vllm_setup.shared_engine).

    llm:        the vllm.LLM (logprobs_mode must be "processed_logprobs")
    eos_ids:    token ids that end a completion (kept in the output)
    seed:       seeds the engine's own request-seed stream
    sleep_level: 0 = never sleep; 1 / 2 = vLLM sleep level between generate calls (GPU only)
    push_check: after the first push of a model: "error" (PushMismatch), "warn" or "off"
    """

    def __init__(
        self,
        llm: Any,
        eos_ids: list[int],
        *,
        seed: int = 0,
        sleep_level: int = 0,
        push_check: str = "error",
    ):
        mode = llm.llm_engine.model_config.logprobs_mode
        if mode != "processed_logprobs":
            raise ValueError(
                f"VLLMEngine needs an LLM built with logprobs_mode='processed_logprobs', got {mode!r}"
            )
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"VLLMEngine: sleep_level must be 0, 1 or 2, got {sleep_level}")
        if not eos_ids:
            raise ValueError("VLLMEngine: eos_ids is empty; a completion could never end early")
        if push_check not in ("error", "warn", "off"):
            raise ValueError(
                f"VLLMEngine: push_check must be error, warn or off, got {push_check!r}"
            )
        self.push_check = push_check
        self.checked = push_check == "off"  # the first model push is checked once
        self.last_push: dict[str, Any] = {}  # load_into_vllm's report and the push's aliases
        self.llm = llm
        reload_log = logging.getLogger(_RELOAD_LOGGER)
        if not any(isinstance(f, _QuietRotaryReload) for f in reload_log.filters):
            reload_log.addFilter(_QuietRotaryReload())
        self.eos_ids = list(eos_ids)
        self.sleep_level = sleep_level
        self._asleep: set[str] = set()  # memory tags vLLM holds released ("weights", "kv_cache")
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        """Restart the request-seed stream (a shared engine handed to a new run)."""
        self._rng = random.Random(seed)

    def request_seeds(self, n: int) -> list[int]:
        """Seeds for n completions without caller seeds: base, base + 1, ... from the engine's
        own stream (so a run of identical prompts is one request)."""
        base = self._rng.randrange(SEED_RANGE)
        return [base + i for i in range(n)]

    # ---- weights -------------------------------------------------------------------------------

    def load_weights(self, weights: Any) -> None:
        """Copy the trainer's weights into the engine (a model, peft model or state dict); the
        first push of a model is checked (see module docstring)."""
        items, aliases = unique_tensors(engine_state_dict(weights))
        if "weights" in self._asleep:  # level-2 sleep dropped them: make room to receive them
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        (report,) = self.llm.collective_rpc(load_into_vllm, args=(items, aliases))
        self.last_push = {**report, "aliases": aliases}
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("VLLMEngine: vLLM refused to reset its prefix cache after a push")
        if not self.checked and not isinstance(weights, dict):
            self.check_push(weights)

    def check_push(self, model: Any) -> float:
        """The probe check of push_check.py against `model` (the trainer's): the gap in nats;
        above the bound PushMismatch (push_check "error") or a warning ("warn")."""
        self.checked = True
        aliases = self.last_push.get("aliases")
        return check_push(self, model, self.last_push, aliases, self.push_check)

    # ---- sleep (GPU) ---------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up(tags=sorted(self._asleep))
            self._asleep.clear()

    def sleep(self) -> None:
        """Rollouts are done for this step: with a sleep level, free vLLM's GPU memory for
        training (the next push or generate wakes what it needs); without one, nothing."""
        if self.sleep_level and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = {"weights", "kv_cache"}

    # ---- generation ----------------------------------------------------------------------------

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        params: SamplingParams,
        *,
        greedy: bool = False,
        seeds: list[int] | None = None,
    ) -> GenerationOutput:
        """One completion per prompt. seeds: one per prompt (engines/seeded.py); None: drawn from
        the engine's own stream. Identical consecutive prompts with consecutive seeds share one
        request (n samples)."""
        check_generate_args("VLLMEngine", prompt_token_ids, seeds)
        if not prompt_token_ids:
            return GenerationOutput([], [], [])
        if seeds is None:
            seeds = self.request_seeds(len(prompt_token_ids))
        runs = list(prompt_runs(prompt_token_ids, seeds))
        prompts = [{"prompt_token_ids": list(prompt_token_ids[s])} for s, _ in runs]
        return self.generate_requests(prompts, runs, seeds, params, greedy)

    def generate_requests(
        self,
        prompts: list[dict],
        runs: list[tuple[int, int]],
        seeds: list[int],
        params: SamplingParams,
        greedy: bool,
        allowed_token_ids: list[int] | None = None,
    ) -> GenerationOutput:
        """vLLM prompts (one dict per run: token ids, and multimodal data for a VLM, see
        policies/vision/engines/vllm.py) -> one completion per row; runs: (first row, rows) of
        each prompt, seeds: one per row (a run's count up by one)."""
        if greedy:  # vLLM allows n = 1 only when greedy; prefix caching still shares the prompt
            prompts = [p for p, (_, count) in zip(prompts, runs) for _ in range(count)]
            runs = [(start + i, 1) for start, count in runs for i in range(count)]
        requests = [
            self._request_params(params, n, seeds[s], greedy, allowed_token_ids) for s, n in runs
        ]
        self._wake()
        results = self.llm.generate(prompts, requests, use_tqdm=False)
        out = GenerationOutput([], [], [])
        for (start, count), result in zip(runs, results):
            completions = sorted(result.outputs, key=lambda o: o.index)
            if len(completions) != count:
                raise RuntimeError(
                    f"VLLMEngine: asked for {count} samples of prompt {start}, got {len(completions)}"
                )
            for o in completions:
                ids = list(o.token_ids)
                if o.logprobs is None or len(o.logprobs) != len(ids):
                    raise RuntimeError(
                        f"VLLMEngine: prompt {start}: {len(ids)} tokens but "
                        f"{None if o.logprobs is None else len(o.logprobs)} log-prob entries"
                    )
                out.completion_ids.append(ids)
                out.logprobs.append([lp[t].logprob for lp, t in zip(o.logprobs, ids)])
                out.truncated.append(o.finish_reason == "length")
        return out

    # ---- scoring (a distillation teacher) -------------------------------------------------------

    def score(
        self, prompt_token_ids: list[list[int]], completion_token_ids: list[list[int]]
    ) -> list[list[float]]:
        """Log-prob of each completion token given its prompt and the completion tokens before
        it, under softmax(logits) (temperature 1): vLLM's prompt log-probs of prompt +
        completion. One list per row, as long as its completion."""
        from vllm import SamplingParams as VSamplingParams

        if len(prompt_token_ids) != len(completion_token_ids):
            raise ValueError(
                f"VLLMEngine.score: {len(prompt_token_ids)} prompts but "
                f"{len(completion_token_ids)} completions"
            )
        if any(not p for p in prompt_token_ids):
            raise ValueError("VLLMEngine.score: every prompt needs >= 1 token")
        if not prompt_token_ids:
            return []
        request = VSamplingParams(
            n=1, temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False,
            skip_special_tokens=False, seed=0,
        )  # fmt: skip
        prompts = [
            {"prompt_token_ids": list(p) + list(c)}
            for p, c in zip(prompt_token_ids, completion_token_ids)
        ]
        self._wake()
        results = self.llm.generate(prompts, request, use_tqdm=False)
        out = []
        for row, (p, c, result) in enumerate(zip(prompt_token_ids, completion_token_ids, results)):
            scored = result.prompt_logprobs  # one entry per prompt token; the first is None
            if scored is None or len(scored) != len(p) + len(c):
                raise RuntimeError(
                    f"VLLMEngine.score: row {row}: {len(p) + len(c)} tokens but "
                    f"{None if scored is None else len(scored)} prompt log-prob entries"
                )
            out.append([float(scored[len(p) + i][t].logprob) for i, t in enumerate(c)])
        return out

    def _request_params(
        self,
        params: SamplingParams,
        n: int,
        seed: int,
        greedy: bool,
        allowed: list[int] | None = None,
    ) -> Any:
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(
            n=n,
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy else params.top_k,  # 0 = off in both
            max_tokens=params.max_new_tokens,
            stop=list(params.stop) or None,
            stop_token_ids=self.eos_ids,
            include_stop_str_in_output=True,
            logprobs=0,  # only the sampled token's
            seed=seed,
            detokenize=bool(params.stop),  # stop strings are matched on text
            skip_special_tokens=False,
            allowed_token_ids=allowed,  # None: the whole vocabulary (a VLM leaves out placeholders)
        )
