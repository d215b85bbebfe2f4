"""The input record, input checks and metric helpers of `policy_loss` (objectives/losses.py).

- `_Batch`: everything a ratio level or surrogate reads; tensors [n, T], advantages broadcast,
  padding zeroed by policy_loss before it is built.
- `_check_shapes`, `_check_option_values`: fail loudly on malformed inputs and on option values or
  combinations the objectives cannot honour (unknown option names fail in losses.py, where the
  registries live, with hints).
- `_masked_mean`, `_clip_flags`, `_ratio_metrics`: the logged metrics, defined in the docstring of
  losses.py. Clip conditions are PPO's (arXiv 1707.06347) and dual-clip PPO's (arXiv 1912.09729),
  strict inequalities; no deviation of its own (each method's paper is named in losses.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grouprl.objectives.group_losses import check_group_options


@dataclass(frozen=True)
class _Batch:
    """Everything a ratio level / surrogate needs; tensors are [n, T] (advantages broadcast)."""

    logp: Tensor
    old_logp: Tensor
    adv: Tensor
    mask: Tensor
    token_weights: Tensor | None
    surrogate: Any  # the surrogate's config: `type` and its family's knobs (config/surrogates.py)
    aggregation: str
    counts: dict
    generator: torch.Generator | None
    group_ids: Tensor | None = None
    num_groups: int | float | Tensor | None = None
    seq_weights: Tensor | None = None

    @property
    def kind(self) -> str:
        """The surrogate family's name (a key of losses.SURROGATES)."""
        return self.surrogate.type

    @property
    def clip_range(self) -> tuple[float, float] | None:
        """(eps_low, eps_high) of a surrogate with a clip range; None for one without."""
        s = self.surrogate
        return (s.eps_low, s.eps_high) if hasattr(s, "eps_low") else None

    @property
    def dual_clip_c(self) -> float | None:
        return getattr(self.surrogate, "dual_clip_c", None)  # only the PPO-clip families have it


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return x.masked_fill(~mask, 0.0).sum() / mask.sum().clamp(min=1)  # scalar


def _clip_flags(ratio: Tensor, b: _Batch) -> tuple[Tensor, Tensor, Tensor]:
    """Slots where the lower clip, upper clip and dual clip are active (strict inequalities);
    none for a surrogate without a clip range (sapo, reinforce, kl_cov, pmd, tpo)."""
    if b.clip_range is None:
        none = torch.zeros_like(b.mask)  # [n, T]
        return none, none, none
    eps_low, eps_high = b.clip_range
    low = b.mask & (b.adv < 0) & (ratio < 1 - eps_low)  # [n, T]
    high = b.mask & (b.adv > 0) & (ratio > 1 + eps_high)  # [n, T]
    c = b.dual_clip_c
    dual = (
        b.mask & (b.adv < 0) & (ratio > c) if c is not None else torch.zeros_like(b.mask)
    )  # [n, T]
    return low, high, dual


def _ratio_metrics(ratio: Tensor, valid: Tensor) -> dict:
    vals = ratio.detach()[valid]  # [K]
    if vals.numel() == 0:
        return {"ratio_mean": 0.0, "ratio_min": 0.0, "ratio_max": 0.0}
    return {"ratio_mean": vals.mean(), "ratio_min": vals.min(), "ratio_max": vals.max()}


def _check_shapes(logp, old_logp, advantages, mask, token_weights, seq_weights) -> None:
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(
            f"logp, old_logp and mask must all be [n, T]; got {tuple(logp.shape)}, "
            f"{tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {mask.dtype}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"advantages must be [n] or [n, T] = {tuple(logp.shape)}, got {tuple(advantages.shape)}"
        )
    if token_weights is not None and token_weights.shape != logp.shape:
        raise ValueError(
            f"token_weights must be [n, T] = {tuple(logp.shape)}, got {tuple(token_weights.shape)}"
        )
    if seq_weights is not None and seq_weights.shape != logp.shape[:1]:
        raise ValueError(
            f"seq_weights must be [n] = {tuple(logp.shape[:1])}, got {tuple(seq_weights.shape)}"
        )


def _check_option_values(b: _Batch, ratio_level: str) -> None:
    """Option values and combinations policy_loss cannot honour (option names: losses.py). The
    config models check the ranges too; these checks serve callers that build the spec in code."""
    s = b.surrogate
    if b.clip_range is not None and min(b.clip_range) < 0:
        raise ValueError(f"eps_low and eps_high must be >= 0, got {s.eps_low}, {s.eps_high}")
    if b.kind in ("clip_cov", "kl_cov") and not 0 < s.ratio <= 1:
        raise ValueError(
            f"{b.kind} ratio is a fraction of the valid tokens, in (0, 1]; got {s.ratio}"
        )
    check_group_options(b, ratio_level)
    if ratio_level == "geometric" and b.kind != "clip":
        raise ValueError(
            "ratio_level 'geometric' (GMPO) has its own log-space clip; use surrogate 'clip', "
            f"not {b.kind!r}"
        )
    if b.dual_clip_c is None:
        return
    if not b.dual_clip_c > 1:
        raise ValueError(
            f"dual_clip_c must be > 1 (it bounds -A*rho for A < 0), got {b.dual_clip_c}"
        )
    if ratio_level == "geometric":
        raise ValueError(
            "dual_clip_c applies to the PPO-clip surrogates at token or sequence level, not "
            "ratio_level 'geometric'"
        )
