"""The Policy protocol every modality implements (causal LMs, flow / DDPM denoisers, ...).

The loop, the runtime (optimizer, checkpoints, processes) and the objectives talk to a policy only
through these methods and attributes; how it samples is its workload's business
(grouprl/workloads/), so a new modality adds a policy and a workload, never a loss or a branch in
the loop.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from grouprl.types import PolicyOutput, Rollout

# state_dict prefix of a policy's old / EMA weights (DiffusionNFT, AWM): weights that train with
# the policy but are not its model, so checkpoints keep them apart from the saved model folder
OLD = "old::"


class ReferenceScorer(Protocol):
    def log_probs(self, batch: Any, temperature: float = 1.0) -> Tensor:  # [N, T], no grad
        ...


class Policy(Protocol):
    lora: Any  # the LoRA settings when only adapters train, else None (full fine-tuning)

    def sample(self, requests: list, group_size: int, params: Any, **kwargs: Any) -> Rollout:
        """group_size samples per request (consecutive rows); rewards are filled by rollouts/."""
        ...

    def log_probs(self, batch: Any, **kwargs: Any) -> PolicyOutput:
        """Differentiable logp [n, T] of the taken actions (+ entropy [n, T] when available)."""
        ...

    def reference(self) -> AbstractContextManager[ReferenceScorer]:
        """Scores under the frozen reference policy (KL); made lazily or with adapters off."""
        ...

    def trainable_parameters(self) -> list[torch.nn.Parameter]: ...

    def train(self, mode: bool = True) -> Policy: ...

    def eval(self) -> Policy: ...

    def to(self, device: torch.device | str) -> Policy: ...

    def state_dict(self) -> dict[str, Tensor]: ...

    def load_state_dict(self, state: dict[str, Tensor]) -> None: ...

    def save_pretrained(self, directory: str | Path) -> Path:
        """Weights in a layout the modality's ecosystem loads (transformers / diffusers)."""
        ...

    def load_saved_weights(self, directory: str | Path) -> None:
        """Inverse of save_pretrained for the trained weights (a resumed full fine-tune)."""
        ...
