"""A flow policy trained by several processes (accelerate launch, DDP): the module DDP wraps and
the policy as the training loop sees it once wrapped.

- `FlowScoringModule`: an nn.Module holding the denoiser whose forward is one scoring call (every
  denoising step of a batch of stored chains: logp [n, K] and the step means, stds and KL
  variances), so DDP sees one forward per micro-batch and all-reduces the gradients of its
  backward.
- `WrappedFlowPolicy`: `log_probs` with grad goes through the wrapped module; no-grad scoring
  (prepare's old / reference scores, split over processes) and everything else (sample, encode,
  decode, reference, kl, save_pretrained ...) is the plain policy's, whose denoiser is the one DDP
  trains (DDP on the CPU or one device per process holds the same parameter objects).

Deviations: only DDP; sharded backends (FSDP2, ZeRO) are refused (they would need a plain copy of
the denoiser to sample with, written for text policies only). Forward-noising objectives
(DiffusionNFT, AWM) call the denoiser outside this forward, so the images workload refuses them
under several processes (their gradients would not be synchronised).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from grouprl.types import PolicyOutput

if TYPE_CHECKING:
    from grouprl.policies.flow.policy import FlowPolicy
    from grouprl.policies.flow.types import FlowBatch


class FlowScoringModule(torch.nn.Module):
    """The denoiser as a module whose forward scores stored chains (see the module docstring)."""

    def __init__(self, policy: FlowPolicy) -> None:
        super().__init__()
        self.model = policy.model  # registered: DDP synchronises its trainable parameters
        self._policy = [policy]  # a list: not a submodule, not in state_dict

    def forward(
        self, batch: FlowBatch, steps: list[int] | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        out = self._policy[0].score_with(self.model, batch, steps)
        ex = out.extras
        return out.logp, ex["mean"], ex["std"], ex["kl_var"]  # [n, K], [n, K, ...], [n, K] x2


class WrappedFlowPolicy:
    """The flow policy whose differentiable log_probs run through `module` (DDP around a
    FlowScoringModule); every other attribute is the policy's own."""

    def __init__(self, policy: FlowPolicy, module: Any) -> None:
        self.policy, self.module = policy, module

    def log_probs(
        self, batch: FlowBatch, *, steps: list[int] | None = None, **ignored: Any
    ) -> PolicyOutput:
        if not torch.is_grad_enabled():  # no gradient to synchronise: the plain policy
            return self.policy.log_probs(batch, steps=steps)
        logp, mean, std, kl_var = self.module(batch, steps)
        return PolicyOutput(logp=logp, extras={"mean": mean, "std": std, "kl_var": kl_var})

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return self.policy.trainable_parameters()  # the optimizer's (and DDP's) parameters

    def train(self, mode: bool = True) -> WrappedFlowPolicy:
        self.policy.train(mode)
        self.module.train(mode)
        return self

    def eval(self) -> WrappedFlowPolicy:
        return self.train(False)

    def __getattr__(self, name: str) -> Any:  # sample, encode, decode, reference, kl, ...
        if name in ("policy", "module"):
            raise AttributeError(name)
        return getattr(self.policy, name)
