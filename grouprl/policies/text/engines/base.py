"""What every text engine takes and returns: SamplingParams -> GenerationOutput, and the protocol.

Group size is not a sampling parameter here: callers repeat each prompt G times, so an engine only
ever sees a flat list of prompts and returns one completion per prompt.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from grouprl.policies.text.stop_ids import stop_ids


@dataclass
class SamplingParams:
    """How to sample one completion per prompt.

    temperature:    logits are divided by it before sampling (> 0; use greedy=True for argmax)
    top_p:          nucleus sampling mass in (0, 1]; 1 = off
    top_k:          keep the k most likely tokens; 0 = off
    max_new_tokens: completion budget; a completion that uses it all without stopping is "truncated"
    stop:           stop strings; the completion keeps the tokens up to and including the stop string
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(
                f"SamplingParams.temperature must be > 0, got {self.temperature} "
                "(for argmax decoding pass greedy=True to generate)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(
                f"SamplingParams.stop must be a list of non-empty strings, got {self.stop!r}"
            )


@dataclass
class GenerationOutput:
    """One completion per prompt, unpadded.

    completion_ids: token ids of each completion (EOS kept when it ended the completion)
    logprobs:       log-prob of each sampled token under the distribution it was sampled from
                    (after temperature / top-k / top-p); same lengths as completion_ids
    truncated:      True where max_new_tokens was reached without EOS or a stop string
    versions:       the weight version that produced each completion (one int per completion;
                    None when the engine does not track versions)
    token_versions: the weight version that sampled each token (same lengths as completion_ids),
                    from engines whose weights can change within one call (partial rollouts,
                    engines/partial.py); None: not tracked
    """

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    truncated: list[bool]
    versions: list[int] | None = None
    token_versions: list[list[int]] | None = None

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.logprobs) != n or len(self.truncated) != n:
            raise ValueError(
                f"GenerationOutput: {n} completions but {len(self.logprobs)} logprob rows and "
                f"{len(self.truncated)} truncated flags"
            )
        if self.versions is not None and len(self.versions) != n:
            raise ValueError(f"GenerationOutput: {n} completions but {len(self.versions)} versions")
        for i, (ids, lps) in enumerate(zip(self.completion_ids, self.logprobs)):
            if len(ids) != len(lps):
                raise ValueError(
                    f"GenerationOutput row {i}: {len(ids)} ids but {len(lps)} logprobs"
                )
        if self.token_versions is not None and [len(v) for v in self.token_versions] != [
            len(ids) for ids in self.completion_ids
        ]:
            raise ValueError("GenerationOutput: token_versions must have one int per token")


@runtime_checkable
class TextEngine(Protocol):
    """A text generation backend."""

    def generate(
        self, prompt_token_ids: list[list[int]], params: SamplingParams, *, greedy: bool = False
    ) -> GenerationOutput:
        """One completion per prompt (repeat prompts for groups)."""
        ...

    def load_weights(self, weights: Any) -> None:
        """Bring the engine's weights up to date with the trainer's (a state dict or a model)."""
        ...


def check_generate_args(
    engine: str, prompt_token_ids: list[list[int]], seeds: list[int] | None
) -> None:
    """What every engine's generate checks first: one seed per prompt (when given), no empty prompt."""
    if seeds is not None and len(seeds) != len(prompt_token_ids):
        raise ValueError(
            f"{engine}.generate: {len(seeds)} seeds for {len(prompt_token_ids)} prompts"
        )
    for i, p in enumerate(prompt_token_ids):
        if len(p) == 0:
            raise ValueError(f"{engine}.generate: prompt {i} is empty (needs at least one token)")


def unwrap_peft(model: Any) -> Any:
    """The transformers model under a peft wrapper (peft injects its adapters into that model's
    modules, so calling it runs them; it also owns `generation_config`), or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """Stop ids of the model: its generation config's EOS ids, then the tokenizer's EOS when the
    generation config does not list it (policies/text/stop_ids.py, one rule for every engine)."""
    return stop_ids(getattr(model, "generation_config", None), tokenizer)


class InProcessEngine(ABC):
    """Base of the engines that generate with the trainer's own (possibly peft-wrapped) model
    object (hf.py, fast.py): nothing to copy after an update, so `load_weights` is a no-op.

    batch_size: prompts per decode batch (None = all at once).
    """

    def __init__(self, model: Any, tokenizer: Any, batch_size: int | None = None) -> None:
        if batch_size is not None and batch_size < 1:
            raise ValueError(
                f"{type(self).__name__}: batch_size must be >= 1 or None, got {batch_size}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self._hf_model = unwrap_peft(model)
        self.eos_ids = eos_ids(self._hf_model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]

    def load_weights(self, weights: Any) -> None:  # noqa: B027  (a deliberate no-op, not abstract)
        """No-op: this engine runs the trainer's model object itself (always current weights)."""

    @abstractmethod
    def _generate_chunk(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        greedy: bool,
        seeds: list[int] | None,
    ) -> GenerationOutput:
        """One completion per prompt of one decode batch (called in eval mode, without grad)."""

    def _generate_in_chunks(
        self,
        prompt_token_ids: list[list[int]],
        params: SamplingParams,
        greedy: bool,
        seeds: list[int] | None,
    ) -> GenerationOutput:
        """`_generate_chunk` on `batch_size` prompts at a time, in eval mode without autograd;
        the model's train / eval state is restored afterwards, also on error."""
        out = GenerationOutput([], [], [])
        step = self.batch_size or len(prompt_token_ids)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for start in range(0, len(prompt_token_ids), step):
                    chunk = self._generate_chunk(
                        prompt_token_ids[start : start + step],
                        params,
                        greedy,
                        None if seeds is None else seeds[start : start + step],
                    )
                    out.completion_ids += chunk.completion_ids
                    out.logprobs += chunk.logprobs
                    out.truncated += chunk.truncated
        finally:
            self.model.train(was_training)
        return out
