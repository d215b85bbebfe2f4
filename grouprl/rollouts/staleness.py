"""Staleness accounting of bounded asynchronous training (train.async_mode bounded).

A token sampled by weight version v and trained with version V is s = V - v versions stale. With a
bound k (train.max_staleness), as in AReaL's staleness-bounded asynchronous RL (arXiv 2505.24298):

  drop        a sample whose oldest loss token has s > k is removed from the batch (counted);
  downweight  every token keeps its place, its loss is multiplied by decay ** max(0, s - k)
              (tokens within the bound weigh 1).

Deviation from AReaL: AReaL only bounds staleness at the producer (it never starts a sample more
than k versions ahead), which the producer here does too by default (train.async_prefetch None);
dropping or down-weighting at the trainer is ours, for samples that exceed the bound when the
producer is allowed to run further ahead, and with partial rollouts the bound is checked per token.

Metrics over the tokens that are trained (after dropping), weighted by tokens:
  async/staleness_mean, async/staleness_max, async/staleness_hist/<s> (share of trained tokens
  sampled s versions behind), async/dropped_samples.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

StalePolicy = Literal["drop", "downweight"]


def token_staleness(token_version: Tensor, version: int) -> Tensor:
    """s = version - token_version, Long[N, T] (slots outside the loss mask mean nothing)."""
    return version - token_version  # [N, T]


def apply_bound(
    token_version: Tensor, mask: Tensor, version: int, k: int, policy: StalePolicy, decay: float
) -> tuple[Tensor, Tensor | None, dict[str, float]]:
    """(rows kept Bool[N], per-token loss weights Float[N, T] or None, metrics) for a batch
    trained with weight `version` (see module docstring). token_version Long[N, T], mask Bool[N, T]."""
    if token_version.shape != mask.shape:
        raise ValueError(
            f"token_version {tuple(token_version.shape)} and mask {tuple(mask.shape)} differ"
        )
    mask = mask.bool()  # [N, T]
    stale = token_staleness(token_version, version)  # [N, T]
    if bool((stale[mask] < 0).any()):
        raise ValueError(
            f"a token of version {int(token_version[mask].max())} is newer than the weights "
            f"trained ({version})"
        )
    oldest = torch.where(mask, stale, torch.zeros_like(stale)).amax(-1)  # [N]
    weights = None
    if policy == "drop":
        keep = oldest <= k  # [N]
    else:
        keep = torch.ones_like(oldest, dtype=torch.bool)  # [N]
        beyond = (stale - k).clamp(min=0).float()  # [N, T]
        weights = torch.where(mask, decay**beyond, torch.ones_like(beyond))  # [N, T]
    trained = stale[keep][mask[keep]]  # [M] staleness of every trained token
    metrics = {"async/dropped_samples": float((~keep).sum())}
    if trained.numel():
        metrics["async/staleness_mean"] = float(trained.float().mean())
        metrics["async/staleness_max"] = float(trained.max())
        values, counts = torch.unique(trained, return_counts=True)
        for v, c in zip(values.tolist(), counts.tolist()):
            metrics[f"async/staleness_hist/{v}"] = c / trained.numel()
    return keep, weights, metrics
