"""The text policy: a transformers causal LM (optionally with a peft LoRA adapter).

GRPO as in DeepSeekMath (arXiv:2402.03300): sample G completions per prompt, score per-token
log-probs of the completion tokens. Sampling goes through a text engine on this very model
(constructor default HFEngine; a config's rollout.engine defaults to "fast", FastEngine).
Scoring runs [left-padded prompt | right-padded completion] with position ids taken from the
attention mask (so left padding never shifts positions): by default each group's prompt once and
a fused LM head (fast_logprobs.py), or the plain chunked path (logprobs.py). LoRA follows
arXiv:2106.09685; the reference policy under LoRA is the same weights with the adapter disabled.
Loading and prompt encoding: loading.py.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from grouprl.policies.checkpoints import load_folder_weights, load_trained_state, trained_state
from grouprl.policies.lora_targets import resolve_targets, write_targets
from grouprl.policies.precision import as_dtype, compute, compute_dtype_of, master_weights
from grouprl.policies.text.engines.base import SamplingParams, TextEngine, unwrap_peft
from grouprl.policies.text.engines.fast import FastEngine
from grouprl.policies.text.engines.hf import HFEngine
from grouprl.policies.text.head import output_head
from grouprl.policies.text.loading import DType, Prompt, encode_prompts, load_causal_lm
from grouprl.policies.text.logprobs import (
    chunked_pair_head,
    completion_hidden,
    completion_logprobs,
)
from grouprl.policies.text.lora import LoRASettings, add_lora
from grouprl.policies.text.lora import lora_settings as _lora_settings
from grouprl.policies.text.lora import merged_state_dict as _merged_state_dict
from grouprl.policies.text.scoring_probe import choose_text_path
from grouprl.policies.text.stop_ids import model_stop_ids
from grouprl.rollouts.seeds import group_seeds, group_sizes
from grouprl.types import PolicyOutput, Rollout, TokenBatch

# engines that generate with the policy's own model object, by rollout.engine name
LOCAL_ENGINES: dict[str, Any] = {"hf": HFEngine, "fast": FastEngine}


class _Scorer:
    """What `reference()` yields: `.log_probs(batch, temperature)` without gradient."""

    def __init__(
        self,
        model: Any,
        chunk_size: int | None,
        path: str = "fast",
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        self._model, self._chunk_size, self._path = unwrap_peft(model), chunk_size, path
        self._dtype = compute_dtype

    @torch.no_grad()
    def log_probs(self, batch: TokenBatch, temperature: float = 1.0) -> Tensor:  # [N, T]
        with compute(self._dtype, batch.prompt_ids.device):
            return completion_logprobs(
                self._model,
                batch,
                temperature=temperature,
                chunk_size=self._chunk_size,
                with_entropy=False,
                path=self._path,
            )[0]


class CausalLMPolicy:
    """Samples groups of completions and scores completion log-probs for a causal LM.

    A tokenizer without a pad token gets its EOS as pad (pad positions are always masked).
    `need_reference=True` builds the frozen reference copy at once (without LoRA) so that an
    out-of-memory shows up at start; otherwise it is built on first `reference()` use, if ever.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        lora: LoRASettings | dict | None = None,
        gradient_checkpointing: bool = False,
        logprob_chunk_size: int | None = None,
        logprob_path: str = "fast",
        need_reference: bool = False,
        engine: TextEngine | str | None = None,
        compute_dtype: torch.dtype | str | None = None,
    ) -> None:
        if tokenizer.pad_token_id is None:
            if tokenizer.eos_token is None:
                raise ValueError("CausalLMPolicy: tokenizer has neither a pad nor an EOS token")
            tokenizer.pad_token = tokenizer.eos_token
        self.tokenizer = tokenizer
        self.lora = _lora_settings(lora)
        # mixed precision (policies/precision.py): compute in the dtype the model was loaded in,
        # train float32 master weights (full fine-tuning: the whole model; LoRA: the adapters)
        self.compute_dtype = (
            compute_dtype_of(model) if compute_dtype is None else as_dtype(compute_dtype)
        )
        # what gets an adapter, read from the module tree (None without LoRA); logged and saved
        self.lora_targets = None if self.lora is None else resolve_targets(model, self.lora)
        if self.lora is not None:
            model = add_lora(model, self.lora, self.lora_targets)
        master_weights(model)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.model = model
        # the ids that end a turn: the generation config's EOS ids, then the tokenizer's
        self.stop_ids: list[int] = model_stop_ids(model, tokenizer)
        self.logprob_chunk_size = logprob_chunk_size
        # logprobs.LOGPROB_PATHS: "fast" or "plain", or "forward" when the load-time probe finds
        # that they do not reproduce the model's own forward (scoring_probe.py; warned once)
        probe = choose_text_path(
            unwrap_peft(model), logprob_path, self.compute_dtype, self.device_of_model(),
            lambda: compute(self.compute_dtype, self.device_of_model()),
        )  # fmt: skip
        self.logprob_path, self.head_note = probe.path, probe.note
        if engine is None or isinstance(engine, str):  # a LOCAL_ENGINES name: on this model
            name = engine or "hf"
            if name not in LOCAL_ENGINES:
                raise ValueError(
                    f"unknown local engine {name!r}; choose from {list(LOCAL_ENGINES)}"
                )
            engine = LOCAL_ENGINES[name](model, tokenizer)
        self.engine: TextEngine = engine
        self._ref_model: Any = None
        if need_reference and self.lora is None:
            self._reference_model()

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        dtype: DType = "float32",
        trust_remote_code: bool = False,
        **kwargs: Any,
    ) -> CausalLMPolicy:
        """Load model + tokenizer from a hub id or a local directory; kwargs go to __init__."""
        model, tokenizer = load_causal_lm(name_or_path, dtype, trust_remote_code)
        return cls(model, tokenizer, compute_dtype=dtype, **kwargs)

    # ---- prompts and sampling ------------------------------------------------------------------

    def encode_prompts(self, prompts: list[Prompt]) -> list[list[int]]:
        """Token ids per prompt: chat messages via the chat template (+ generation prompt),
        plain strings as-is (plus BOS only if this tokenizer normally adds one)."""
        # prompt_token_limit: set by the prompt guard in truncate mode (rollouts/prompt_guard.py)
        return encode_prompts(self.tokenizer, prompts, getattr(self, "prompt_token_limit", None))

    def sample(
        self,
        prompts: list[Prompt],
        group_size: int | list[int],
        params: SamplingParams,
        *,
        engine: TextEngine | None = None,
        group_ids: list[int] | Tensor | None = None,
        greedy: bool = False,
        seed: int | None = None,
        response_prefixes: list[str | list[int]] | None = None,
    ) -> Rollout:
        """G = group_size completions per prompt (consecutive rows); rewards are left empty.
        group_size: one G for every prompt, or one per prompt (rollout.budget allocate).
        seed: sample j of group g draws from its own generator seeded by (seed, g, j)
        (engines/seeded.py), so a group's samples do not depend on the rest of the batch.
        response_prefixes: one text or token-id list per prompt ("" / [] for none) forced as the
        start of each of its completions (a hint, rollouts/hooks/hint.py; token ids: a tree
        rollout's shared segments exactly as sampled, rollouts/fork.py): the engine continues
        after it; the prefix tokens are part of the completion (the reward sees them, scoring
        conditions on them) but masked out of the loss, with engine log-prob 0."""
        if not prompts:
            raise ValueError(f"need >= 1 prompt, got {len(prompts)}")
        sizes = group_sizes(group_size, len(prompts))  # [B] ints, each >= 1
        if group_ids is None:
            group_ids = torch.arange(len(prompts))
        group_ids = torch.as_tensor(group_ids, dtype=torch.long)  # [B]
        if group_ids.shape != (len(prompts),):
            raise ValueError(f"group_ids must have one id per prompt ({len(prompts)})")
        prompt_ids = [p for p, n in zip(self.encode_prompts(prompts), sizes) for _ in range(n)]
        forced = [[] for _ in prompt_ids]  # per row: the forced completion start's token ids
        if response_prefixes is not None:
            if len(response_prefixes) != len(prompts):
                raise ValueError(
                    f"response_prefixes must have one text per prompt ({len(prompts)})"
                )
            ids = [list(t) if not isinstance(t, str)
                   else self.tokenizer.encode(t, add_special_tokens=False) if t else []
                   for t in response_prefixes]  # fmt: skip
            forced = [i for i, n in zip(ids, sizes) for _ in range(n)]
        seeded = {}  # engines that take no seeds never see the key
        if seed is not None:
            seeded["seeds"] = group_seeds(seed, group_ids.tolist(), group_size)
        engine = engine or self.engine
        # a local engine runs this model here: in the compute dtype; vLLM keeps its own dtype
        # (partial rollouts wrap an engine: engines/partial.py's ChunkedEngine.inner)
        local = isinstance(getattr(engine, "inner", engine), tuple(LOCAL_ENGINES.values()))
        ctx = compute(self.compute_dtype, self.device_of_model()) if local else nullcontext()
        with ctx:
            out = engine.generate(
                [p + f for p, f in zip(prompt_ids, forced)], params, greedy=greedy, **seeded
            )
        completions = [f + list(c) for f, c in zip(forced, out.completion_ids)]
        pad = self.tokenizer.pad_token_id
        p_ids = _pad([torch.tensor(p) for p in prompt_ids], pad, "left")  # [N, P]
        p_mask = _pad([torch.ones(len(p), dtype=torch.bool) for p in prompt_ids], 0, "left")
        c_ids = _pad([torch.tensor(c) for c in completions], pad, "right")  # [N, T]
        c_mask = _pad([torch.ones(len(c), dtype=torch.bool) for c in completions], 0, "right")
        # the loss mask [N, T]: the forced start is real text (attended, seen by the rewards) but
        # no action of the policy
        loss_mask = _pad(
            [torch.tensor([False] * len(f) + [True] * len(c), dtype=torch.bool)
             for f, c in zip(forced, out.completion_ids)], 0, "right",
        )  # fmt: skip
        engine_logp = _pad(
            [torch.tensor([0.0] * len(f) + list(lp), dtype=torch.float32)
             for f, lp in zip(forced, out.logprobs)], 0.0, "right",
        )  # fmt: skip  # [N, T]
        batch = TokenBatch(p_ids, p_mask, c_ids, c_mask, torch.tensor(out.truncated))
        token_version = None  # [N, T] int64: the weight version that sampled each token
        versions = out.token_versions  # partial rollouts: per token
        if versions is None and out.versions is not None:  # vllm_server: one per completion
            versions = [[v] * len(ids) for v, ids in zip(out.versions, out.completion_ids)]
        if versions is not None:
            token_version = _pad(
                [torch.tensor([-1] * len(f) + list(v), dtype=torch.long)
                 for f, v in zip(forced, versions)], -1, "right",
            )  # fmt: skip
        return Rollout(
            group_ids=group_ids.repeat_interleave(torch.tensor(sizes)),  # [N]
            rewards={},
            actions=batch,
            old_logp=engine_logp.clone(),  # [N, T]; train.py may recompute it with the trainer
            mask=loss_mask,  # [N, T]
            engine_logp=engine_logp,
            token_version=token_version,
            info={
                "prompt": [p for p, n in zip(prompts, sizes) for _ in range(n)],
                "completion": self.tokenizer.batch_decode(completions, skip_special_tokens=True),
                "completion_ids": completions,
            },
        )

    # ---- scoring -------------------------------------------------------------------------------

    def log_probs(
        self,
        batch: TokenBatch,
        *,
        temperature: float = 1.0,
        with_entropy: bool = True,
        chunk_size: int | None = None,
        entropy_grad: bool = False,
    ) -> PolicyOutput:
        """Differentiable logp [N, T] of the completion tokens under softmax(logits / temperature),
        entropy [N, T] (no grad unless entropy_grad); masked slots are 0."""
        with compute(self.compute_dtype, batch.prompt_ids.device):
            logp, entropy = completion_logprobs(
                unwrap_peft(self.model),
                batch,
                temperature=temperature,
                chunk_size=chunk_size or self.logprob_chunk_size,
                with_entropy=with_entropy,
                entropy_grad=entropy_grad,
                path=self.logprob_path,
            )  # [N, T] each
        return PolicyOutput(logp=logp, entropy=entropy)

    def distill_kl(
        self,
        batch: TokenBatch,
        teacher_model: Any,
        kl_fn: Any,
        *,
        temperature: float = 1.0,
        chunk_size: int | None = None,
    ) -> Tensor:
        """The exact per-position KL [N, T] between this policy and a frozen `teacher_model`
        (same tokenizer) on the completions of `batch`: kl_fn(student logits [c, V], teacher
        logits [c, V]) -> [c], both divided by temperature, over chunks of the real completion
        positions (logprobs.chunked_pair_head: [chunk, V] logits of each model at once).
        Differentiable in this policy; the teacher runs without gradient; masked slots 0.
        Both decoders run the plain scoring path (one [prompt | completion] pass each)."""
        student = unwrap_peft(self.model)
        with compute(self.compute_dtype, batch.prompt_ids.device):
            hidden, device = completion_hidden(student, batch)  # [N, T, H]
            with torch.no_grad():
                t_hidden, _ = completion_hidden(teacher_model, batch)  # [N, T, H']
            mask = batch.completion_mask.to(device)  # [N, T]
            kl = chunked_pair_head(
                hidden[mask], output_head(student),
                t_hidden[mask].to(device), output_head(unwrap_peft(teacher_model)), kl_fn,
                temperature=temperature, chunk_size=chunk_size,
                vocab_size=student.config.get_text_config().vocab_size,
            )  # fmt: skip  # [M]
        full = torch.zeros(mask.shape, dtype=kl.dtype, device=device)  # [N, T]
        return full.masked_scatter(mask, kl)  # [N, T]

    @contextlib.contextmanager
    def reference(self) -> Iterator[_Scorer]:
        """Scores under the frozen reference: the adapter disabled (LoRA) or a frozen copy."""
        if self.lora is not None:
            with self.model.disable_adapter():
                yield _Scorer(
                    self.model, self.logprob_chunk_size, self.logprob_path, self.compute_dtype
                )
        else:
            yield _Scorer(
                self._reference_model(), self.logprob_chunk_size, self.logprob_path,
                self.compute_dtype,
            )  # fmt: skip

    def device_of_model(self) -> torch.device:
        return next(iter(self.model.parameters())).device

    def _reference_model(self) -> Any:
        if self._ref_model is None:
            ref = copy.deepcopy(self.model).eval()
            for p in ref.parameters():
                p.requires_grad_(False)
            self._ref_model = ref
        return self._ref_model

    # ---- parameters and checkpoints ------------------------------------------------------------

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def train(self, mode: bool = True) -> CausalLMPolicy:
        self.model.train(mode)
        return self

    def eval(self) -> CausalLMPolicy:
        return self.train(False)

    def load_saved_weights(self, directory: str | Path) -> None:
        """Load full weights written by save_pretrained (resume without LoRA); a tied lm_head may
        be absent, any other missing or unexpected key is an error."""
        load_folder_weights(self.model, directory)

    def snapshot(self) -> CausalLMPolicy:
        """A CausalLMPolicy over copies of the model and tokenizer, with its own engine of this
        policy's kind (hf or fast) and its log-prob settings: what one-step-off rollouts sample
        with while this policy trains (runtime/async_rollout.py). A remote engine (vllm_server)
        is shared, not copied: its weights are the server's."""
        if getattr(self.engine, "remote", False):  # vllm_server: the weights live in the server
            # the trainer pushes them (sync.push_weights); the snapshot only samples through the
            # same client, so it shares the model (never run by it) and copies the tokenizer
            return CausalLMPolicy(
                self.model, copy.deepcopy(self.tokenizer), logprob_chunk_size=self.logprob_chunk_size,
                logprob_path=self.logprob_path, engine=self.engine,
            )  # fmt: skip
        if type(self.engine) not in LOCAL_ENGINES.values():
            raise ValueError(
                f"async rollouts need a local engine (hf, fast) or vllm_server, got {self.engine}"
            )
        model = copy.deepcopy(self.model).requires_grad_(False).eval()  # old_logp without dropout
        tokenizer = copy.deepcopy(self.tokenizer)  # fast tokenizers must not be shared by threads
        engine = type(self.engine)(model, tokenizer, self.engine.batch_size)
        return CausalLMPolicy(
            model, tokenizer, logprob_chunk_size=self.logprob_chunk_size,
            logprob_path=self.logprob_path, engine=engine,
        )  # fmt: skip

    def chunk_generation(self, chunk_tokens: int, refresh: Any) -> None:
        """Partial rollouts: this policy's engine generates in chunks of `chunk_tokens`, calling
        `refresh()` (-> the weight version) before each (engines/partial.py); on a snapshot."""
        from grouprl.policies.text.engines.partial import ChunkedEngine

        self.engine = ChunkedEngine(self.engine, chunk_tokens, refresh)

    def sampling_copy(self) -> torch.nn.Module:
        """Sharded training (FSDP2): the trained model moves into the sharded wrapper, and this
        policy (and its local engine) sample with a frozen full copy instead. Returns the copy,
        which the backend refreshes after every optimizer step."""
        trained = self.model
        self.model = copy.deepcopy(trained).requires_grad_(False)
        if type(self.engine) in LOCAL_ENGINES.values() and self.engine.model is trained:
            self.engine = type(self.engine)(self.model, self.tokenizer, self.engine.batch_size)
        return self.model

    def scoring_module(self, path: str | None = None) -> torch.nn.Module:
        """The model behind one forward that scores completions (what DDP / FSDP2 / DeepSpeed
        wrap: policies/text/scoring_module.py); path: the log-prob path, default this policy's."""
        from grouprl.policies.text.scoring_module import ScoringModule

        return ScoringModule(self.model, self.logprob_chunk_size, path or self.logprob_path)

    def to(self, device: torch.device | str) -> CausalLMPolicy:
        """Move the model (and the reference copy, if one was made) to `device`."""
        self.model.to(device)
        if self._ref_model is not None:
            self._ref_model.to(device)
        return self

    def state_dict(self) -> dict[str, Tensor]:
        """Full weights, or only the trainable (adapter) weights under LoRA."""
        return trained_state(self.model, self.lora)

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Inverse of state_dict(); checks the keys before touching any weight."""
        load_trained_state(self.model, self.lora, state)

    def save_pretrained(self, directory: str | Path) -> Path:
        """A plain transformers folder (safetensors + tokenizer). Under LoRA the adapter is merged
        into the saved weights (the live model is left untouched) and also saved to dir/adapter,
        with the resolved targets in dir/lora_targets.json."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.lora is None:
            self.model.save_pretrained(directory, safe_serialization=True)
        else:
            self.model.save_pretrained(directory / "adapter", safe_serialization=True)
            base = self.model.get_base_model()
            base.save_pretrained(directory, state_dict=_merged_state_dict(base))
            write_targets(self.lora_targets, directory)
        self.tokenizer.save_pretrained(directory)
        return directory


def _pad(rows: list[Tensor], value: float, side: Literal["left", "right"]) -> Tensor:
    return pad_sequence(rows, batch_first=True, padding_value=value, padding_side=side)
