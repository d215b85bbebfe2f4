"""A causal LM behind one forward that scores completions: the module DDP / FSDP2 / DeepSpeed wrap
(runtime/distributed/backends.py). Their hooks run on a module's forward, and the policy scores by
calling the decoder and the LM head itself (policies/text/logprobs.py), never the model's own
forward, so this wrapper's forward is that scoring call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grouprl.policies.text.engines.base import unwrap_peft
from grouprl.policies.text.logprobs import completion_logprobs
from grouprl.types import TokenBatch


class ScoringModule(torch.nn.Module):
    """The policy's model behind one forward (completion log-probs), which DDP / FSDP2 / DeepSpeed
    wrap: their hooks run on the wrapper's forward, which scores like CausalLMPolicy.log_probs
    (policies/logprobs.py, the policy's logprob_path) rather than calling the model's forward."""

    def __init__(self, model: torch.nn.Module, chunk_size: int | None, path: str) -> None:
        super().__init__()
        self.model, self.chunk_size, self.path = model, chunk_size, path  # path: fast | plain
        hf = unwrap_peft(model)
        self._no_split_modules = getattr(hf, "_no_split_modules", None)  # FSDP2 auto-wrap classes

    def forward(self, prompt_ids, prompt_mask, completion_ids, completion_mask, *,
                temperature: float, with_entropy: bool, entropy_grad: bool,
                chunk_size: int | None) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        batch = TokenBatch(prompt_ids, prompt_mask, completion_ids, completion_mask,
                           truncated=completion_mask[:, 0])  # fmt: skip  # truncated: unused
        return completion_logprobs(
            unwrap_peft(self.model), batch, temperature=temperature,
            chunk_size=chunk_size or self.chunk_size, with_entropy=with_entropy,
            entropy_grad=entropy_grad, path=self.path,
        )  # fmt: skip  # [N, T] each

    def get_input_embeddings(self) -> Any:
        return unwrap_peft(self.model).get_input_embeddings()

    def get_output_embeddings(self) -> Any:
        return unwrap_peft(self.model).get_output_embeddings()
