"""Per-token KL estimators between the policy and a frozen reference, from log-probs of sampled tokens.

With the log-ratio x = ref_logp - logp at a token sampled from the policy (Schulman, "Approximating
KL divergence", 2020; used in DeepSeekMath GRPO, arXiv 2402.03300, as k3):
  k1  = logp - ref_logp = -x             unbiased, high variance, can be negative
  k2  = 0.5 * (logp - ref_logp)^2        biased, low variance, always >= 0
  k3  = exp(x) - x - 1                   unbiased, low variance, always >= 0
  k1+ / k3+  straight-through: the value of k1 / k3, the gradient of k2
             (value.detach() + k2 - k2.detach()), as verl's "+" suffix.

Deviation / choice: k3 clamps x to [-20, 20] before exp and the result to [-10, 10], as verl does,
so one wildly off token cannot produce inf; the clamp also zeroes the gradient outside those bounds.
Only the canonical names above are accepted (no "low_var_kl"/"mse" aliases: one name per thing).

Shapes: logp, ref_logp, mask: [N, T]. kl_penalty is elementwise and unmasked; callers aggregate.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from grouprl.objectives.registry import Registry

KLEstimator = Literal["k1", "k2", "k3", "k1+", "k3+"]
# "importance": the per-token KL times the importance ratio pi_theta / pi_old (TRL's
# use_bias_correction_kl, DeepSeek-V3.2 arXiv 2512.02556): the KL estimators assume tokens drawn
# from pi_theta, but they were drawn from pi_old, so each term is reweighted by the ratio.
KLWeighting = Literal["none", "importance"]

KL_ESTIMATORS = Registry("KL estimator")

LOG_RATIO_CLAMP = 20.0  # |ref - logp| bound before exp in k3
K3_CLAMP = 10.0  # bound on the k3 value


@KL_ESTIMATORS.register("k1")
def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return logp - ref_logp  # [N, T]


@KL_ESTIMATORS.register("k2")
def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return 0.5 * (logp - ref_logp).square()  # [N, T]


@KL_ESTIMATORS.register("k3")
def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    x = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N, T]
    return (torch.exp(x) - x - 1.0).clamp(-K3_CLAMP, K3_CLAMP)  # [N, T]


def _straight_through(value: Tensor, logp: Tensor, ref_logp: Tensor) -> Tensor:
    grad_path = k2(logp, ref_logp)  # [N, T]
    return value.detach() + (grad_path - grad_path.detach())  # [N, T] value of `value`, grad of k2


@KL_ESTIMATORS.register("k1+")
def k1_plus(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return _straight_through(k1(logp, ref_logp), logp, ref_logp)  # [N, T]


@KL_ESTIMATORS.register("k3+")
def k3_plus(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return _straight_through(k3(logp, ref_logp), logp, ref_logp)  # [N, T]


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator) -> Tensor:
    """Elementwise KL estimate [N, T] (unmasked: padding slots hold whatever the inputs give)."""
    fn = KL_ESTIMATORS[estimator]
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ in shape"
        )
    return fn(logp, ref_logp)  # [N, T]


def sequence_kl(logp: Tensor, ref_logp: Tensor, mask: Tensor, estimator: KLEstimator) -> Tensor:
    """Masked sum over tokens of the estimator -> Float[N]. Masked slots never leak NaN/inf."""
    if mask.shape != logp.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must match logp {tuple(logp.shape)}")
    kl = kl_penalty(logp, ref_logp, estimator)  # [N, T]
    return torch.where(mask.bool(), kl, torch.zeros_like(kl)).sum(-1)  # [N]


def kl_in_reward(
    rewards: Tensor,
    logp_old: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    coef: float,
    estimator: KLEstimator,
) -> Tensor:
    """Fold the KL into the sequence reward: R_i - coef * sum_t m_it kl_it -> Float[N] (no gradient).

    Uses the sampling policy's log-probs (logp_old), as the reward is fixed before the update.
    A NaN reward (no reward) stays NaN.
    """
    if rewards.shape != logp_old.shape[:1]:
        raise ValueError(f"rewards must be Float[{logp_old.shape[0]}], got {tuple(rewards.shape)}")
    with torch.no_grad():
        kl = sequence_kl(logp_old, ref_logp, mask, estimator)  # [N]
    return rewards - coef * kl.to(rewards.dtype)  # [N]


def importance_weighted_kl(
    kl: Tensor, logp: Tensor, old_logp: Tensor, mask: Tensor, ratio_level: str
) -> Tensor:
    """kl [N, T] times the importance ratio of the configured level -> [N, T] (TRL's
    use_bias_correction_kl).

    token:    rho_t = exp(logp_t - old_logp_t)                      [N, T]
    sequence: s_i = exp(sum_t m_t (logp_t - old_logp_t) / |o_i|)     [N, 1], broadcast over tokens
    As in TRL, the ratio is NOT detached: the gradient flows through both the KL and the ratio
    (with logp == old_logp the value is the plain KL, the gradient gains kl * dlogp). The log-ratio
    is clamped to [-20, 20] before exp, like the surrogates' ratios.
    """
    delta = (logp - old_logp.detach()).masked_fill(~mask.bool(), 0.0)  # [N, T]
    if ratio_level == "token":
        log_w = delta  # [N, T]
    elif ratio_level == "sequence":
        log_w = delta.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # [N, 1]
    else:
        raise ValueError(
            f"kl_weighting='importance' is defined for ratio_level 'token' or 'sequence' (as TRL's "
            f"importance_sampling_level), not {ratio_level!r}"
        )
    return kl * log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # [N, T]
