"""The Policy protocol every modality implements (text now; flow models and agents next).

train.py talks to a policy only through these methods, so a new modality adds a policy (and a
sampler), never a loss or a branch in the loop.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from grouprl.types import PolicyOutput, Rollout


class ReferenceScorer(Protocol):
    def log_probs(self, batch: Any, temperature: float = 1.0) -> Tensor:  # [N, T], no grad
        ...


class Policy(Protocol):
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
