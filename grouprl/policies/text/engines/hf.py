"""The default text engine: transformers `generate` on the trainer's own model (no weight copies).

Sampling is plain ancestral sampling from softmax(processed logits), where the processing is
exactly temperature -> top-k -> top-p (transformers' warper order). We pass those warpers ourselves,
followed by a recorder that keeps the log-prob of each sampled token under that processed
distribution, and we hide the model's own `generation_config` while generating so that hub
defaults (repetition_penalty, min_p, top_k=20 ...) cannot silently change the distribution the
trainer thinks was sampled. Only one [B, V] log-softmax is kept at a time (no per-step [B, V]
score history).

Where a completion ends: at the first EOS (kept) or at the token that completes a stop string
(kept, even if that token runs past the stop string), whichever comes first. Anything after,
including the padding transformers writes after finished rows, is dropped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import GenerationConfig
from transformers.generation import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grouprl.policies.text.engines.base import (
    GenerationOutput,
    InProcessEngine,
    SamplingParams,
    check_generate_args,
)
from grouprl.policies.text.engines.seeded import SeededChoice


class _LogprobRecorder(LogitsProcessor):
    """Runs last among the processors; records log p(token) of each sampled token.

    At step t the input ids already contain the token sampled at step t-1, so each call gathers the
    previous step's log-prob; the final step's is gathered by `finish` after generation.
    """

    def __init__(self) -> None:
        self.logps: list[Tensor] = []  # each [B]
        self.prev: Tensor | None = None  # [B, V] log-softmax of the last processed scores

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.prev is not None:
            self.logps.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))  # [B]
        self.prev = torch.log_softmax(scores.float(), dim=-1)  # [B, V]
        return scores

    def finish(self, generated: Tensor) -> Tensor:
        """generated: [B, T] sampled tokens -> [B, T] their log-probs."""
        T = generated.shape[1]
        if len(self.logps) < T and self.prev is not None:
            self.logps.append(self.prev.gather(-1, generated[:, T - 1 : T]).squeeze(-1))  # [B]
        if len(self.logps) < T:
            raise RuntimeError(f"HFEngine: recorded {len(self.logps)} log-probs for {T} tokens")
        return torch.stack(self.logps[:T], dim=1)  # [B, T]


def _stop_cut(ids: list[int], stops: list[str], tokenizer: Any) -> int | None:
    """Smallest k such that decode(ids[:k]) contains a stop string, or None (binary search)."""
    if not stops or not any(s in tokenizer.decode(ids) for s in stops):
        return None
    lo, hi = 1, len(ids)  # invariant: decode(ids[:hi]) contains a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in tokenizer.decode(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return hi


class HFEngine(InProcessEngine):
    """transformers `generate` over a (possibly peft-wrapped) causal LM that the trainer also updates.

    batch_size: prompts per `generate` call (None = all at once).
    """

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        params: SamplingParams,
        *,
        greedy: bool = False,
        seeds: list[int] | None = None,
    ) -> GenerationOutput:
        """One completion per prompt. Greedy takes the argmax; its log-probs are under
        softmax(logits / temperature) (top-k/top-p do not apply). seeds: one per prompt, each row
        then samples from its own generator (engines/seeded.py); None: torch's global RNG."""
        check_generate_args("HFEngine", prompt_token_ids, seeds)
        if not prompt_token_ids:
            return GenerationOutput([], [], [])
        saved_config = self._hf_model.generation_config
        # Hide hub sampling defaults; everything that shapes the distribution is passed explicitly.
        self._hf_model.generation_config = GenerationConfig()
        try:
            return self._generate_in_chunks(prompt_token_ids, params, greedy, seeds)
        finally:
            self._hf_model.generation_config = saved_config

    def _generate_chunk(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        greedy: bool,
        seeds: list[int] | None = None,
    ) -> GenerationOutput:
        device = next(self.model.parameters()).device
        B, P = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((B, P), self.pad_id, dtype=torch.long)  # [B, P] left padded
        attention_mask = torch.zeros((B, P), dtype=torch.long)  # [B, P]
        for i, p in enumerate(prompts):
            input_ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, P - len(p) :] = 1

        warpers: list[LogitsProcessor] = []
        if params.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(params.temperature))
        if not greedy and params.top_k > 0:
            warpers.append(TopKLogitsWarper(top_k=params.top_k))
        if not greedy and params.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=params.top_p))
        recorder = _LogprobRecorder()
        # seeded rows: SeededChoice draws the token, generate's argmax then returns it
        chooser = [SeededChoice(seeds)] if seeds is not None and not greedy else []
        sample = not greedy and not chooser
        # Neutral sampling settings (our warpers above do the work); greedy ignores them.
        neutral = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {}
        config = GenerationConfig(
            do_sample=sample,
            **neutral,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            stop_strings=list(params.stop) or None,
            return_dict_in_generate=True,
        )
        result = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=config,
            logits_processor=LogitsProcessorList([*warpers, recorder, *chooser]),
            tokenizer=self.tokenizer if params.stop else None,
        )
        generated = result.sequences[:, P:]  # [B, T]
        logps = recorder.finish(generated).cpu()  # [B, T]
        generated = generated.cpu()

        out = GenerationOutput([], [], [])
        eos = set(self.eos_ids)
        for i in range(B):
            ids = generated[i].tolist()
            end = next((t + 1 for t, tok in enumerate(ids) if tok in eos), None)
            cut = _stop_cut(ids[: end or len(ids)], params.stop, self.tokenizer)
            end = cut if cut is not None else end
            stopped = end is not None
            if not stopped and len(ids) < params.max_new_tokens:
                raise RuntimeError(
                    f"HFEngine: completion {i} ended after {len(ids)} < max_new_tokens tokens "
                    "with no EOS or stop string found; cannot tell where it ends"
                )
            end = end if stopped else len(ids)
            out.completion_ids.append(ids[:end])
            out.logprobs.append(logps[i, :end].tolist())
            out.truncated.append(not stopped)
        return out
