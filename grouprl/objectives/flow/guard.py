"""GRPO-Guard for flow-matching policies: RatioNorm and the 1/dt step weighting, as pure functions.

Source: arXiv 2510.22319 (GRPO-Guard), METHODS section 6. The official code is not released; this
follows the one code-backed reading, verl-omni's `GRPOGuardLoss` (loss_mode "grpo_guard").

One SDE denoising step x_t -> x_{t-dt} is Gaussian with mean mu and std s_t = sigma_t sqrt(dt); its
log-density log p is averaged over the latent dims (Flow-GRPO). The Flow-GRPO log-ratio carries the
term -mean_dims (mu - mu_old)^2 / (2 s_t^2), which pushes ratios below 1 and differs in scale across
steps. RatioNorm adds it back and rescales by s_t:
    b_t        = mean_dims (mu - mu_old)^2 / (2 s_t^2)
    log rho~_t = (log p - log p_old + b_t) * s_t
[inferred, METHODS] With x = mu_old + s_t z: log p - log p_old = mean_dims[z (mu - mu_old)] / s_t - b_t,
so log rho~_t = mean_dims[z (mu - mu_old)]: centred at 0 and free of the 1/s_t blow-up (tested).
The step loss, with A clipped to +-adv_clip_max and PPO's clip on rho~ (eps, eps):
    L_t = mean over (valid) samples of [ clipPG(rho~_t, A; eps, eps) / dt ]
which for one dt per step is verl-omni's mean_batch[...] / sqrt_dt^2.

Shapes: logp / old_logp are S = [B] (one step) or [B, K] (K steps); mean / old_mean are S + D, the
latent dims D after S (e.g. [B, C, H, W]); std and dt are floats or tensors broadcastable to S (one
scalar per step as verl-omni uses, or one per sample). No flow policy exists yet: the caller gathers
mu from the sampler (policies/samplers.py) and passes old_mean from the rollout.
Deviations: verl-omni averages std over the batch into one scalar per step and clips symmetrically;
here a per-sample std is used as given. The [unconfirmed] alternative reading of RatioNorm (per-step
standardisation of the ratios, METHODS section 6) is not implemented.
Defaults: eps = 2e-6 (verl-omni example), adv_clip_max = 5.0 (Flow-GRPO).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grouprl.types import LossOutput

GUARD_EPS = 2e-6
ADV_CLIP_MAX = 5.0
LOG_RATIO_CLAMP = 20.0  # as losses.py: exp never overflows


def _as_tensor(x: float | Tensor, like: Tensor) -> Tensor:
    return torch.as_tensor(x, dtype=like.dtype, device=like.device)


def mean_bias(mean: Tensor, old_mean: Tensor, std: float | Tensor, step_dims: int) -> Tensor:
    """b_t = mean over the latent dims (after the first `step_dims`) of (mu - mu_old)^2 / (2 s^2)."""
    if mean.shape != old_mean.shape or mean.dim() < step_dims:
        raise ValueError(
            f"mean and old_mean must have the same shape S + D with S of {step_dims} dims, got "
            f"{tuple(mean.shape)} and {tuple(old_mean.shape)}"
        )
    sq = (mean - old_mean.detach()) ** 2  # S + D
    sq = sq.flatten(step_dims).mean(-1) if mean.dim() > step_dims else sq  # S
    s = _as_tensor(std, sq)  # S or scalar
    if bool((s <= 0).any()):
        raise ValueError("std (the SDE step std s_t = sigma_t sqrt(dt)) must be > 0")
    return sq / (2 * s**2)  # S


def guard_log_ratio(
    logp: Tensor, old_logp: Tensor, mean: Tensor, old_mean: Tensor, std: float | Tensor
) -> Tensor:
    """RatioNorm log-ratio (log p - log p_old + b_t) * s_t, shape S = logp.shape (module doc)."""
    if old_logp.shape != logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and old_logp {tuple(old_logp.shape)} differ")
    if tuple(mean.shape[: logp.dim()]) != tuple(logp.shape):
        raise ValueError(
            f"mean must be logp's shape {tuple(logp.shape)} + latent dims, got {tuple(mean.shape)}"
        )
    b = mean_bias(mean, old_mean, std, logp.dim())  # S
    return (logp - old_logp.detach() + b) * _as_tensor(std, b)  # S


def guard_step_loss(
    logp: Tensor,
    old_logp: Tensor,
    mean: Tensor,
    old_mean: Tensor,
    std: float | Tensor,
    advantages: Tensor,
    dt: float | Tensor,
    *,
    eps: float = GUARD_EPS,
    adv_clip_max: float = ADV_CLIP_MAX,
    mask: Tensor | None = None,
) -> LossOutput:
    """GRPO-Guard loss L = mean over valid entries of clipPG(rho~, clip(A)) / dt (module doc).
    advantages broadcastable to S (e.g. [B] for S = [B], or [B, 1] / [B, K] for S = [B, K]);
    mask: optional Bool S of the steps that count. Metrics: ratio_mean/min/max, clip_frac, bias_mean."""
    log_ratio = guard_log_ratio(logp, old_logp, mean, old_mean, std)  # S
    dt_t = _as_tensor(dt, log_ratio)  # S or scalar
    if bool((dt_t <= 0).any()):
        raise ValueError("dt (the step size, > 0) must be positive")
    if not eps >= 0 or not adv_clip_max > 0:
        raise ValueError(f"need eps >= 0 and adv_clip_max > 0, got {eps!r}, {adv_clip_max!r}")
    valid = torch.ones_like(log_ratio, dtype=torch.bool) if mask is None else mask.bool()  # S
    if valid.shape != log_ratio.shape:
        raise ValueError(f"mask must be {tuple(log_ratio.shape)}, got {tuple(valid.shape)}")
    adv = advantages.detach().to(log_ratio.dtype).clamp(-adv_clip_max, adv_clip_max)
    adv = adv.expand_as(log_ratio)  # S
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # S
    # PPO clip written with `where` on the strict conditions, as losses._ppo_clip
    r = ratio.detach()  # S
    clipped = ((adv > 0) & (r > 1 + eps)) | ((adv < 0) & (r < 1 - eps))  # S
    per = torch.where(clipped, -adv * r.clamp(1 - eps, 1 + eps), -adv * ratio)  # S
    per = (per / dt_t).masked_fill(~valid, 0.0)  # S
    count = valid.sum().clamp(min=1)  # scalar
    loss = per.sum() / count  # scalar
    vals = r[valid]  # [K]
    bias = mean_bias(mean.detach(), old_mean, std, logp.dim())  # S
    metrics = {
        "ratio_mean": float(vals.mean()) if vals.numel() else 0.0,
        "ratio_min": float(vals.min()) if vals.numel() else 0.0,
        "ratio_max": float(vals.max()) if vals.numel() else 0.0,
        "clip_frac": float((clipped & valid).sum() / count),
        "bias_mean": float(bias.masked_fill(~valid, 0.0).sum() / count),
        "pg_loss": float(loss.detach()),
    }
    return LossOutput(loss=loss, metrics=metrics)
