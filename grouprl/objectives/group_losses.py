"""Sequence- and group-level policy losses: PMD-mean and TPO, as pure functions plus the adapters
that losses.py registers as the surrogates "pmd" and "tpo".

Notation as in losses.py: logp / old_logp / mask are [n, T], m = mask, A = advantage (one per row:
the masked mean over the row's slots when [n, T] advantages are given).

PMD-mean, policy mirror descent with the mean approximation of the log-partition (arXiv 2602.05933,
METHODS section 2; official code horizon-rl/OpenKimi, loss_mode "opmd" with advantage rloo).
  Delta_i = sum_t m (logp - old_logp) (the sequence log-ratio, no clamp: it is never exponentiated).
  Per-token loss l_{i,t} = (tau/2) (A_i/tau - Delta_i)^2 / |o_i| on each valid slot, so that the
  aggregation modes give exactly the paper's forms: seq_mean_token_mean -> mean_i[(tau/2)(A_i/tau -
  Delta_i)^2 / |o_i|] (the default) and seq_mean_token_sum_norm -> mean_i[(tau/2)(...)^2] / L_max.
  No ratio clip, no KL. tau = 0.01 (the 7B script). Token weights multiply l like any surrogate.
  Deviation: OpenKimi's optional partition_weights (prompt filters) are not implemented.

TPO, Target Policy Optimization (arXiv 2604.06159, METHODS section 9; official code JeanKaddour/tpo).
  u_i = population-std standardised scores (advantage estimator "tpo"); l_i = sum_t m logp (a SUM);
  within each group, log p^theta = log_softmax(l), log p^old = log_softmax(l^old) and the target
  q = softmax(log p^old + u / eta), detached. L = sum over groups of -sum_i q_i log p^theta_i, divided
  by num_groups, the GLOBAL number of groups of the optimizer step (default: the groups present here).
  So a batch split into micro-batches of WHOLE groups sums to the loss of the big batch; a group split
  across micro-batches would be renormalised over the wrong candidates (nothing here can detect it).
  The gradient with respect to l_i is (p^theta_i - q_i) / num_groups.
  - The aggregation mode and the ratio level are IGNORED (TPO defines its own reduction; no ratio).
  - Rows without a valid token are not candidates: they get q = 0 and carry no gradient; a group with
    none left contributes 0 and is not counted. A group of one has p = q = 1: loss 0, no gradient.
  - Token weights and sequence weights have no meaning here: losses.py refuses them for TPO.
  Metrics (means over the groups here): tpo_kl = KL(q || p^theta), tpo_target_entropy = H(q).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from grouprl.types import LossOutput

if TYPE_CHECKING:  # only for annotations; losses.py imports this module
    from grouprl.objectives.losses import SurrogateBatch

PMD_TAU = 0.01
TPO_ETA = 1.0
TOKEN_LEVEL_ONLY = ("pmd", "tpo")  # define their own sequence log-ratio / log-prob
# Losses over whole groups: policy_loss skips aggregate() for them, and a micro-batch split must
# keep every group whole (a split group would be renormalised over the wrong candidates).
GROUP_SURROGATES = ("tpo",)


def _row_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Masked mean of x [n, T] over each row's valid slots -> [n] (0 for empty rows)."""
    return x.masked_fill(~mask, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)  # [n]


def _as_matrix(advantages: Tensor, mask: Tensor) -> Tensor:
    """Advantages [n] or [n, T] -> [n, T] (detached, padding zeroed)."""
    adv = advantages.detach()  # [n] or [n, T]
    adv = adv[:, None].expand(mask.shape) if adv.dim() == 1 else adv  # [n, T]
    return adv.masked_fill(~mask, 0.0)  # [n, T]


# ----------------------------------------------------------------------------- PMD-mean


def pmd_token_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, tau: float = PMD_TAU
) -> Tensor:
    """PMD-mean per-token loss [n, T] (module docstring), 0 on masked slots."""
    if not tau > 0:
        raise ValueError(f"pmd_tau must be > 0, got {tau!r}")
    lengths = mask.sum(-1).clamp(min=1)  # [n]
    delta = (logp - old_logp.detach()).masked_fill(~mask, 0.0).sum(-1)  # [n] sequence log-ratio
    adv = _row_mean(_as_matrix(advantages, mask).to(logp.dtype), mask)  # [n] A_i
    per_seq = (tau / 2) * (adv / tau - delta) ** 2 / lengths  # [n]
    return per_seq[:, None].expand(mask.shape).masked_fill(~mask, 0.0)  # [n, T]


# ----------------------------------------------------------------------------- TPO


def _group_log_softmax(x: Tensor, valid: Tensor, inv: Tensor, k: int) -> Tensor:
    """log_softmax of x [n] over the valid rows of each group (dense ids inv [n], k groups) -> [n],
    0 on invalid rows. Finite values and gradients everywhere, also for groups with no valid row."""
    x = torch.where(valid, x, torch.zeros_like(x))  # [n]
    top = torch.full((k,), float("-inf"), dtype=x.dtype, device=x.device)  # [K]
    top = top.scatter_reduce(0, inv, x.detach().masked_fill(~valid, float("-inf")), "amax")  # [K]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # [K] empty group -> 0
    e = (x - top[inv]).exp() * valid  # [n] the shift is constant: log_softmax is shift-invariant
    total = torch.zeros(k, dtype=x.dtype, device=x.device).index_add(0, inv, e)  # [K]
    total = torch.where(total > 0, total, torch.ones_like(total))  # [K] empty group: log 1 = 0
    out = x - top[inv] - total.log()[inv]  # [n]
    return torch.where(valid, out, torch.zeros_like(out))  # [n]


def tpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    *,
    eta: float = TPO_ETA,
    num_groups: int | float | Tensor | None = None,
) -> LossOutput:
    """TPO loss (module docstring): logp [n, T] differentiable, old_logp [n, T], advantages = the
    standardised scores u, [n] or [n, T], mask Bool[n, T], group_ids [n]. Returns the scalar loss and
    the floats tpo_kl, tpo_target_entropy."""
    if not eta > 0:
        raise ValueError(f"tpo_eta must be > 0, got {eta!r}")
    if group_ids is None or group_ids.shape != mask.shape[:1]:
        shape = None if group_ids is None else tuple(group_ids.shape)
        raise ValueError(
            f"surrogate 'tpo' needs group_ids [n] = {tuple(mask.shape[:1])} (the softmax runs over "
            f"each group's candidates), got {shape}"
        )
    valid = mask.any(-1)  # [n] candidates
    uniq, inv = torch.unique(group_ids, return_inverse=True)  # [K], [n]
    k = uniq.numel()
    seq = logp.masked_fill(~mask, 0.0).sum(-1)  # [n] l^theta_i = log pi_theta(o_i | q)
    seq_old = old_logp.detach().masked_fill(~mask, 0.0).sum(-1)  # [n]
    u = _row_mean(_as_matrix(advantages, mask).to(seq.dtype), mask)  # [n]
    log_p = _group_log_softmax(seq, valid, inv, k)  # [n] differentiable
    with torch.no_grad():
        log_p_old = _group_log_softmax(seq_old, valid, inv, k)  # [n]
        log_q = _group_log_softmax(log_p_old + u / eta, valid, inv, k)  # [n] target
        q = log_q.exp() * valid  # [n]
        present = torch.zeros(k, dtype=torch.bool, device=mask.device).index_fill(
            0, inv[valid], True
        )  # [K] groups with at least one candidate
        n_here = int(present.sum())
    if num_groups is None:
        num_groups = n_here
    if isinstance(num_groups, Tensor):
        num_groups = num_groups.clamp(min=1)
    else:
        num_groups = max(num_groups, 1)
    loss = -(q * log_p).sum() / num_groups  # scalar
    with torch.no_grad():
        kl = (q * (log_q - log_p)).sum() / max(n_here, 1)  # mean over groups of KL(q || p_theta)
        entropy = -(q * log_q).sum() / max(n_here, 1)  # mean over groups of H(q)
    return LossOutput(
        loss=loss, metrics={"tpo_kl": float(kl), "tpo_target_entropy": float(entropy)}
    )


# ----------------------------------------------------------------------------- adapters
# Registered by losses.py: SURROGATES "pmd" -> pmd_surrogate (per-token, then aggregate());
# "tpo" -> tpo_surrogate (its own reduction; dispatched by policy_loss, see losses.py).


def pmd_surrogate(log_ratio: Tensor, b: SurrogateBatch) -> tuple[Tensor, dict]:
    return pmd_token_loss(b.logp, b.old_logp, b.adv, b.mask, b.surrogate.tau), {}  # [n, T]


def tpo_surrogate(log_ratio: Tensor, b: SurrogateBatch) -> tuple[Tensor, dict]:
    out = tpo_loss(
        b.logp, b.old_logp, b.adv, b.mask, b.group_ids, eta=b.surrogate.eta, num_groups=b.num_groups
    )
    return out.loss, out.metrics  # scalar


def check_group_options(b: SurrogateBatch, ratio_level: str) -> None:
    """The combinations PMD / TPO cannot honour fail here (called by policy_loss's option checks)."""
    if b.kind in TOKEN_LEVEL_ONLY and ratio_level != "token":
        raise ValueError(
            f"surrogate {b.kind!r} defines its own sequence-level quantity from the token "
            f"log-probs; use ratio_level 'token', not {ratio_level!r}"
        )
    if b.kind not in GROUP_SURROGATES:
        return
    if b.token_weights is not None and bool((b.token_weights[b.mask] != 1).any()):
        raise ValueError(
            f"surrogate {b.kind!r} scores whole sequences: token weights other than 1 "
            "(engine correction, top_entropy_quantile, token_scales) do not apply to it"
        )
    if b.seq_weights is not None:
        raise ValueError(f"surrogate {b.kind!r} does not take seq_weights (delta_l)")
