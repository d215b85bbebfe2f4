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

import torch
from torch import Tensor

from grouprl.objectives.group_losses import PMD_TAU, TPO_ETA, check_group_options

_DUAL_CLIP_SURROGATES = ("clip", "clip_cov")  # the surrogates built on the PPO clip


@dataclass(frozen=True)
class _Batch:
    """Everything a ratio level / surrogate needs; tensors are [n, T] (advantages broadcast)."""

    logp: Tensor
    old_logp: Tensor
    adv: Tensor
    mask: Tensor
    token_weights: Tensor | None
    surrogate: str
    aggregation: str
    counts: dict
    eps_low: float
    eps_high: float
    dual_clip_c: float | None
    sapo_tau_pos: float
    sapo_tau_neg: float
    clip_cov_ratio: float
    clip_cov_lb: float
    clip_cov_ub: float
    kl_cov_ratio: float
    kl_cov_coef: float
    generator: torch.Generator | None
    pmd_tau: float = PMD_TAU
    tpo_eta: float = TPO_ETA
    group_ids: Tensor | None = None
    num_groups: int | float | Tensor | None = None
    seq_weights: Tensor | None = None


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return x.masked_fill(~mask, 0.0).sum() / mask.sum().clamp(min=1)  # scalar


def _clip_flags(ratio: Tensor, b: _Batch) -> tuple[Tensor, Tensor, Tensor]:
    """Slots where the lower clip, upper clip and dual clip are active (strict inequalities)."""
    low = b.mask & (b.adv < 0) & (ratio < 1 - b.eps_low)  # [n, T]
    high = b.mask & (b.adv > 0) & (ratio > 1 + b.eps_high)  # [n, T]
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
    """Option values and combinations policy_loss cannot honour (option names: losses.py)."""
    if b.eps_low < 0 or b.eps_high < 0:
        raise ValueError(f"eps_low and eps_high must be >= 0, got {b.eps_low}, {b.eps_high}")
    for name, value in (("clip_cov_ratio", b.clip_cov_ratio), ("kl_cov_ratio", b.kl_cov_ratio)):
        if not 0 < value <= 1:
            raise ValueError(f"{name} is a fraction of the valid tokens, in (0, 1]; got {value}")
    check_group_options(b, ratio_level)
    if ratio_level == "geometric" and b.surrogate != "clip":
        raise ValueError(
            "ratio_level 'geometric' (GMPO) has its own log-space clip; use surrogate 'clip', "
            f"not {b.surrogate!r}"
        )
    if b.dual_clip_c is None:
        return
    if not b.dual_clip_c > 1:
        raise ValueError(
            f"dual_clip_c must be > 1 (it bounds -A*rho for A < 0), got {b.dual_clip_c}"
        )
    if b.surrogate not in _DUAL_CLIP_SURROGATES or ratio_level == "geometric":
        raise ValueError(
            f"dual_clip_c applies to the PPO-clip surrogates {_DUAL_CLIP_SURROGATES} at token or "
            f"sequence level, not surrogate {b.surrogate!r} with ratio_level {ratio_level!r}"
        )
