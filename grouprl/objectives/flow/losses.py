"""Likelihood-free objectives for flow-matching policies: DiffusionNFT and AWM, as pure functions.

Both train on forward-noised copies of the generated clean samples, x_t = (1 - t) x0 + t eps, with the
pretraining target v* = eps - x0 (diffusers convention, t = sigma), so the sampler needs no
likelihood (an ODE works). METHODS.md sections 7-8 hold the formulas read from the official code.

DiffusionNFT (arXiv 2509.16117, NVlabs/DiffusionNFT `train_nft_sd3.py`):
    r~    = clip(0.5 + clip(A, +-A_max) / (2 A_max), 0, 1)            "optimality probability"
    v+    = beta v + (1 - beta) sg(v_old),  v- = (1 + beta) sg(v_old) - beta v
    x0^+- = x_t - t v+-,  w+- = sg(mean_D |x0^+- - x0|) clipped below at 1e-5
    L     = A_max mean[(r~ mean_D (x0^+ - x0)^2 / w+ + (1 - r~) mean_D (x0^- - x0)^2 / w-) / beta]
            + kl_coef mean mean_D (v - v_ref)^2
AWM (arXiv 2509.25050, scxue/advantage_weighted_matching `train_sd3_awm.py`):
    mse   = mean_D (v - v*)^2;  l = -mse (uniform) or -((mse + 1e-10)^p - 1e-10^p) t / p (ghuber)
    rho   = exp(l - sg(l_old));  A~ = clip(A, +-A_max) adv_max / A_max
    L     = mean clipPG(rho, A~; c, c) + kl_coef mean mean_D (v - v_ref)^2
            + ema_coef mean mean_D (v - v_ema)^2
  The clipped surrogate is `policy_loss` (losses.py, surrogate clip, token_mean) on the [B, K] grid
  of (sample, timestep) log-likelihood surrogates: the same objective library as every modality.

Shapes: B samples, K training timesteps each, D latent dims (C, H, W or C, F, H, W).
v, v_old, v_ref, v_ema, noise: [B, K, *D]; x0: [B, *D]; t: [B, K]; advantages: [B]; mask: Bool[B, K].
v_old None means the old policy is the current one (sg(v)): NFT's v+ = v- = sg(v) in value, AWM's
ratio is exactly 1 (its on-policy case). "mean" over (sample, timestep) pairs is the masked mean, or
sum / num_terms when the caller passes a global count (gradient accumulation, several ranks).

Timestep draws, the old / EMA weight decays and the config -> keyword mapping live in
objectives/flow/support.py.
Deviations: NFT's KL term is added with gradient (Flow-Factory's port computes it under no_grad).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grouprl.objectives.aggregation import masked_mean
from grouprl.objectives.losses import ClipRange, policy_loss
from grouprl.objectives.registry import Registry
from grouprl.types import LossOutput

NFT_MIN_WEIGHT = 1e-5  # the adaptive weight's lower clip (official code)
AWM_GHUBER_EPS = 1e-10

LIKELIHOOD_FREE = Registry("likelihood-free objective")


# ---- shared pieces -----------------------------------------------------------------------------


def forward_noise(x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
    """x_t = (1 - t) x0 + t eps for x0 [B, *D], noise [B, K, *D], t [B, K] -> [B, K, *D]."""
    _check(noise, x0, t)
    tt = t.reshape(*t.shape, *([1] * (x0.dim() - 1))).to(noise.dtype)  # [B, K, 1, ...]
    return (1 - tt) * x0.unsqueeze(1) + tt * noise  # [B, K, *D]


def optimality_probability(advantages: Tensor, adv_max: float) -> Tensor:
    """DiffusionNFT's r~ = clip(0.5 + clip(A, +-A_max) / (2 A_max), 0, 1). [B]."""
    if not adv_max > 0:
        raise ValueError(f"adv_max (A_max) must be > 0, got {adv_max!r}")
    a = advantages.detach().clamp(-adv_max, adv_max)  # [B]
    return (0.5 + a / (2 * adv_max)).clamp(0.0, 1.0)  # [B]


def _check(noise: Tensor, x0: Tensor, t: Tensor) -> None:
    b, k = t.shape if t.dim() == 2 else (None, None)
    if t.dim() != 2 or noise.shape != (b, k, *x0.shape[1:]) or x0.shape[0] != b:
        raise ValueError(
            "need t [B, K], x0 [B, *D] and noise [B, K, *D]; got t "
            f"{tuple(t.shape)}, x0 {tuple(x0.shape)}, noise {tuple(noise.shape)}"
        )
    if bool(((t < 0) | (t > 1)).any()):
        raise ValueError(
            f"timesteps t must lie in [0, 1] (sigmas), got min {float(t.min())} max {float(t.max())}"
        )


def _inputs(v, x0, noise, t, advantages, mask, others) -> Tensor:
    """Shape checks; returns the mask Bool[B, K]."""
    _check(noise, x0, t)
    for name, other in {"v": v, **others}.items():
        if other is not None and other.shape != noise.shape:
            raise ValueError(
                f"{name} must be [B, K, *D] = {tuple(noise.shape)}, got {tuple(other.shape)}"
            )
    if advantages.shape != t.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{t.shape[0]}], got {tuple(advantages.shape)}")
    valid = torch.ones_like(t, dtype=torch.bool) if mask is None else mask.bool()  # [B, K]
    if valid.shape != t.shape:
        raise ValueError(f"mask must be [B, K] = {tuple(t.shape)}, got {tuple(valid.shape)}")
    return valid


def _zero_masked(valid: Tensor, *xs: Tensor | None) -> list[Tensor | None]:
    """fp32 copies of [B, K, *D] tensors with the masked (sample, timestep) slots set to 0, so a
    padded slot (even NaN) reaches neither the loss nor, through 0 * NaN, the gradient."""
    out = []
    for x in xs:
        m = None if x is None else valid.reshape(*valid.shape, *([1] * (x.dim() - 2)))
        out.append(None if x is None else x.float().masked_fill(~m, 0.0))  # [B, K, *D]
    return out


def _mean_d(x: Tensor) -> Tensor:
    """Mean over the latent dims of [B, K, *D] -> [B, K]."""
    return x.flatten(2).mean(-1)


def _velocity_reg(v: Tensor, other: Tensor | None, coef: float, valid, num_terms) -> Tensor:
    """coef * mean over pairs of mean_D (v - sg(other))^2; 0 when coef is 0."""
    if coef == 0:
        return v.new_zeros(())
    if other is None:
        raise ValueError(f"a velocity regulariser with coefficient {coef} needs its velocities")
    return coef * masked_mean(_mean_d((v - other.detach()) ** 2), valid, num_terms)


# ---- DiffusionNFT ------------------------------------------------------------------------------


@LIKELIHOOD_FREE.register("diffusion_nft")
def nft_loss(
    v: Tensor,
    x0: Tensor,
    noise: Tensor,
    t: Tensor,
    advantages: Tensor,
    *,
    v_old: Tensor | None = None,
    v_ref: Tensor | None = None,
    mask: Tensor | None = None,
    kl_coef: float = 0.0,
    adv_clip_max: float = 5.0,
    num_terms: float | Tensor | None = None,
    beta: float = 1.0,
) -> LossOutput:
    """DiffusionNFT loss (module doc). Metrics: nft_loss, positive / negative x0 errors, r_mean, kl."""
    valid = _inputs(v, x0, noise, t, advantages, mask, {"v_old": v_old, "v_ref": v_ref})  # [B, K]
    if not beta > 0:
        raise ValueError(f"DiffusionNFT beta must be > 0, got {beta!r}")
    v, v_old, v_ref, noise_ = _zero_masked(valid, v, v_old, v_ref, noise)  # [B, K, *D] each
    old = (v if v_old is None else v_old).detach()  # [B, K, *D]
    x0_, t_ = x0.float(), t.float()  # [B, *D], [B, K]
    x_t = forward_noise(x0_, noise_, t_)  # [B, K, *D]
    tt = t_.reshape(*t_.shape, *([1] * (x0.dim() - 1)))  # [B, K, 1, ...]
    target = x0_.unsqueeze(1)  # [B, 1, *D]
    pos = x_t - tt * (beta * v + (1 - beta) * old)  # [B, K, *D]  x0 from v+
    neg = x_t - tt * ((1 + beta) * old - beta * v)  # [B, K, *D]  x0 from v-
    w_pos = _mean_d((pos - target).abs()).detach().clamp(min=NFT_MIN_WEIGHT)  # [B, K]
    w_neg = _mean_d((neg - target).abs()).detach().clamp(min=NFT_MIN_WEIGHT)  # [B, K]
    err_pos = _mean_d((pos - target) ** 2) / w_pos  # [B, K]
    err_neg = _mean_d((neg - target) ** 2) / w_neg  # [B, K]
    r = optimality_probability(advantages.float(), adv_clip_max)[:, None]  # [B, 1]
    per = (r * err_pos + (1 - r) * err_neg) / beta  # [B, K]
    main = adv_clip_max * masked_mean(per, valid, num_terms)  # scalar
    kl = _velocity_reg(v, v_ref, kl_coef, valid, num_terms)  # scalar
    loss = main + kl
    metrics = {
        "nft_loss": float(main.detach()),
        "kl": float(kl.detach()),
        "x0_err_pos": float(masked_mean(err_pos.detach() * w_pos, valid, None)),
        "x0_err_neg": float(masked_mean(err_neg.detach() * w_neg, valid, None)),
        "r_mean": float(r.mean()),
    }
    return LossOutput(loss=loss, metrics=metrics)


# ---- AWM ---------------------------------------------------------------------------------------


def _uniform(mse: Tensor, t: Tensor, p: float) -> Tensor:
    return -mse  # [B, K]


def _ghuber(mse: Tensor, t: Tensor, p: float) -> Tensor:
    return -((mse + AWM_GHUBER_EPS) ** p - AWM_GHUBER_EPS**p) * t / p  # [B, K]


AWM_WEIGHTINGS: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "uniform": _uniform,
    "ghuber": _ghuber,
}


def awm_log_likelihood(v: Tensor, target: Tensor, t: Tensor, weighting: str, p: float) -> Tensor:
    """AWM's surrogate log-likelihood l = weighting(mean_D (v - v*)^2, t). v, target [B, K, *D] -> [B, K]."""
    if weighting not in AWM_WEIGHTINGS:
        raise ValueError(
            f"unknown AWM weighting {weighting!r}: allowed are {', '.join(AWM_WEIGHTINGS)}"
        )
    if not p > 0:
        raise ValueError(f"AWM ghuber exponent p must be > 0, got {p!r}")
    return AWM_WEIGHTINGS[weighting](_mean_d((v - target) ** 2), t, p)  # [B, K]


@LIKELIHOOD_FREE.register("awm")
def awm_loss(
    v: Tensor,
    x0: Tensor,
    noise: Tensor,
    t: Tensor,
    advantages: Tensor,
    *,
    v_old: Tensor | None = None,
    v_ref: Tensor | None = None,
    mask: Tensor | None = None,
    kl_coef: float = 0.0,
    adv_clip_max: float = 5.0,
    num_terms: float | Tensor | None = None,
    clip: float = 1.0,
    weighting: str = "ghuber",
    p: float = 0.25,
    adv_max: float = 1.0,
    v_ema: Tensor | None = None,
    ema_coef: float = 0.0,
) -> LossOutput:
    """AWM loss (module doc). Metrics: policy_loss's (pg_loss, ratio_*, clip_frac ...), fm_mse, kl, ema."""
    valid = _inputs(
        v, x0, noise, t, advantages, mask, {"v_old": v_old, "v_ref": v_ref, "v_ema": v_ema}
    )
    if not adv_clip_max > 0 or not adv_max > 0:
        raise ValueError(
            f"need adv_clip_max > 0 and adv_max > 0, got {adv_clip_max!r}, {adv_max!r}"
        )
    v, v_old, v_ref, v_ema, noise_ = _zero_masked(valid, v, v_old, v_ref, v_ema, noise)
    t_ = t.float()  # [B, K]
    target = noise_ - x0.float().unsqueeze(1)  # [B, K, *D]  v* = eps - x0
    logl = awm_log_likelihood(v, target, t_, weighting, p)  # [B, K]
    old = logl if v_old is None else awm_log_likelihood(v_old, target, t_, weighting, p)
    adv = advantages.detach().float().clamp(-adv_clip_max, adv_clip_max) * (adv_max / adv_clip_max)
    pg = policy_loss(
        logl, old.detach(), adv, valid, surrogate=ClipRange(clip, clip), ratio_level="token",
        aggregation="token_mean", num_tokens=num_terms,
    )  # fmt: skip
    kl = _velocity_reg(v, v_ref, kl_coef, valid, num_terms)  # scalar
    ema = _velocity_reg(v, v_ema, ema_coef, valid, num_terms)  # scalar
    mse = _mean_d((v.detach() - target) ** 2)  # [B, K]
    metrics = {**pg.metrics, "kl": float(kl.detach()), "ema_reg": float(ema.detach())}
    metrics["fm_mse"] = float(masked_mean(mse, valid, None))
    return LossOutput(loss=pg.loss + kl + ema, metrics=metrics)
