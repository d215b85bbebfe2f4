"""Statistics over groups of samples and over the batch, for the advantage estimators
(advantages.py) and the reward metrics: rewards [N] with a group id and a validity flag each
(NaN rewards are invalid and left out of every statistic). Stds are unbiased (Bessel, /(n-1)).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor


class Groups:
    """Per-group statistics over valid samples, computed once with scatter ops.

    inv: Long[N] dense group index in [0, K); valid: Bool[N].
    """

    def __init__(self, inv: Tensor, k: int, valid: Tensor) -> None:
        self.inv, self.k, self.valid = inv, k, valid

    @classmethod
    def from_ids(cls, group_ids: Tensor, valid: Tensor) -> Groups:
        """Arbitrary integer ids (any order, gaps allowed) -> dense ids via torch.unique."""
        uniq, inv = torch.unique(group_ids, return_inverse=True)  # [K], [N]
        return cls(inv, uniq.numel(), valid)

    def with_valid(self, valid: Tensor) -> Groups:
        """The same grouping with another validity mask (e.g. one reward's non-NaN entries)."""
        return Groups(self.inv, self.k, valid)

    def sum(self, x: Tensor) -> Tensor:
        """Sum of x over the valid members of each group, gathered back per sample -> [N]."""
        x = torch.where(self.valid, x, torch.zeros_like(x))  # [N] NaN-free
        out = torch.zeros(self.k, dtype=x.dtype, device=x.device).index_add_(0, self.inv, x)  # [K]
        return out[self.inv]  # [N]

    def count(self, dtype: torch.dtype) -> Tensor:
        return self.sum(torch.ones_like(self.valid, dtype=dtype))  # [N]

    def mean(self, x: Tensor) -> Tensor:
        return self.sum(x) / self.count(x.dtype).clamp(min=1)  # [N]

    def std(self, x: Tensor) -> Tensor:
        """Unbiased std of the valid members of each group (0 for groups with < 2 valid) -> [N]."""
        dev = torch.where(self.valid, x - self.mean(x), torch.zeros_like(x))  # [N]
        var = self.sum(dev * dev) / (self.count(x.dtype) - 1).clamp(min=1)  # [N]
        return var.sqrt()  # [N]

    def reduce(self, x: Tensor, op: Literal["amax", "amin"], fill: float) -> Tensor:
        """Max / min of x over the valid members of each group (`fill` for empty groups) -> [N]."""
        x = torch.where(self.valid, x, torch.full_like(x, fill))  # [N]
        out = torch.full((self.k,), fill, dtype=x.dtype, device=x.device)  # [K]
        return out.scatter_reduce(0, self.inv, x, reduce=op, include_self=True)[self.inv]  # [N]

    def degenerate(self, x: Tensor) -> Tensor:
        """Bool[N]: the sample's group has < 2 valid members or all its valid values are equal."""
        hi = self.reduce(x, "amax", float("-inf"))  # [N]
        lo = self.reduce(x, "amin", float("inf"))  # [N]
        return (self.count(x.dtype) < 2) | (hi == lo)  # [N]

    def centered(self, x: Tensor) -> Tensor:
        """x - group mean, exactly 0 for degenerate groups and invalid samples -> [N]."""
        keep = self.valid & ~self.degenerate(x)  # [N]
        return torch.where(keep, x - self.mean(x), torch.zeros_like(x))  # [N]


def batch_std(x: Tensor, valid: Tensor) -> Tensor:
    """Unbiased std of x over valid samples (0 when fewer than 2) -> scalar."""
    v = x[valid]  # [n_valid]
    return v.std() if v.numel() > 1 else x.new_zeros(())


def whiten(x: Tensor, valid: Tensor, eps: float) -> Tensor:
    """(x - mean) / (std + eps) over valid samples of the batch; invalid samples -> 0. [N]."""
    v = x[valid]  # [n_valid]
    if v.numel() == 0:
        return torch.zeros_like(x)
    out = (x - v.mean()) / (batch_std(x, valid) + eps)  # [N]
    return torch.where(valid, out, torch.zeros_like(x))  # [N]
