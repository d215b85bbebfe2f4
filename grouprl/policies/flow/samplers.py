"""One denoising step of a flow-matching (or DDIM) sampler as a pure function: draw or score x_next.

Convention (diffusers): x_sigma = (1 - sigma) x0 + sigma eps, the network predicts the velocity
v ~ eps - x0, sigmas decrease along sampling and delta = sigma_next - sigma < 0. Every step is
Gaussian, x_next = mean + std z; each function returns a `StepOutput` (prev_sample, log_prob, mean,
std). Given `prev_sample` the step only scores it (no noise is drawn), which is how a policy
re-scores stored transitions: same inputs in fp32 give the same log_prob, ratio exactly 1.

  flow_sde   Flow-GRPO, arXiv 2505.05470: g = a sqrt(sigma / (1 - sigma)),
             mean = x (1 + g^2 delta / (2 sigma)) + v (1 + g^2 (1 - sigma) / (2 sigma)) delta,
             std = g sqrt(-delta); Euler-Maruyama of the reverse SDE with the score taken from v.
  dance_sde  DanceGRPO, arXiv 2505.07818: the same SDE with constant g = eta, written as DanceGRPO
             writes it (x0_hat = x - sigma v, score = -(x - (1 - sigma) x0_hat) / sigma^2,
             mean = x + delta v - delta eta^2 score / 2, std = eta sqrt(-delta)).
  cps        Coefficients-preserving sampling (flow_grpo's `cps` step): s = sigma_next sin(a pi / 2),
             mean = (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - s^2) eps_hat, std = s, with
             x0_hat = x - sigma v and eps_hat = x + (1 - sigma) v.
  ode        deterministic Euler step x + delta v (= FlowMatchEulerDiscreteScheduler.step), log_prob 0.
  ddim       DDIM with eta for epsilon-prediction models (DDPO, arXiv 2305.13301; Song et al. eq. 12/16).

log_prob is the Gaussian log density averaged over all non-batch elements (what every reference
implementation does; the tiny clip ranges of these methods assume it); prev_sample enters it detached,
so gradients flow through the mean only. A step whose std is 0 (ode, noise_level 0, eta 0, the cps
step to sigma_next = 0) is deterministic: prev_sample = mean and log_prob = 0.

Deviations from the reference code:
- cps: flow_grpo scores a cps step with -mean (x_next - mean)^2 (no 1/(2 s^2), no constants); here it
  is the true Gaussian log density like every other sampler, so its ratio is a likelihood ratio.
- flow_sde at sigma = 1: the reference divides by 1 - sigma_max with sigma_max = the schedule's second
  sigma; `sigma_max` defaults to sigma_next, which is that value whenever sigma = 1 is the first step.
- All math is fp32 and the outputs are fp32 (the caller casts latents for the network).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class StepOutput:
    """prev_sample Float[B, ...]; log_prob Float[B]; mean Float[B, ...]; std Float[B] (0: deterministic)."""

    prev_sample: Tensor
    log_prob: Tensor
    mean: Tensor
    std: Tensor


def per_sample(value: float | Tensor, x: Tensor, name: str) -> Tensor:
    """A float, 0-d or [B] value as an fp32 [B] tensor on x's device (B = x.shape[0])."""
    t = torch.as_tensor(value, dtype=torch.float32, device=x.device)
    if t.dim() == 0:
        return t.expand(x.shape[0])  # [B]
    if t.shape != (x.shape[0],):
        raise ValueError(
            f"{name} must be a float or a [B] = [{x.shape[0]}] tensor, got {tuple(t.shape)}"
        )
    return t  # [B]


def _bcast(t: Tensor, x: Tensor) -> Tensor:
    """[B] -> [B, 1, ..., 1] to broadcast against x [B, ...]."""
    return t.reshape(t.shape[0], *([1] * (x.dim() - 1)))


def _check_x(x: Tensor, other: Tensor, name: str) -> None:
    if x.dim() < 2:
        raise ValueError(
            f"x must be [B, ...] with at least one non-batch dim, got {tuple(x.shape)}"
        )
    if other.shape != x.shape:
        raise ValueError(f"{name} must have x's shape {tuple(x.shape)}, got {tuple(other.shape)}")


def _sigmas(x: Tensor, sigma: float | Tensor, sigma_next: float | Tensor) -> tuple[Tensor, Tensor]:
    s = per_sample(sigma, x, "sigma")  # [B]
    sn = per_sample(sigma_next, x, "sigma_next")  # [B]
    if bool(((s <= 0) | (s > 1)).any()) or bool(((sn < 0) | (sn >= s)).any()):
        raise ValueError(
            "need 0 < sigma <= 1 and 0 <= sigma_next < sigma (sigmas decrease along sampling), got "
            f"sigma={s.tolist()} sigma_next={sn.tolist()}"
        )
    return s, sn


def _noise(x: Tensor, generator: torch.Generator | None) -> Tensor:
    device = generator.device if generator is not None else x.device
    z = torch.randn(x.shape, generator=generator, dtype=torch.float32, device=device)
    return z.to(x.device)  # [B, ...]


def gaussian_log_prob(sample: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """mean over non-batch elements of log N(sample; mean, std^2), std [B]; 0 where std == 0. [B]."""
    s = _bcast(std, mean)  # [B, 1, ...]
    safe = torch.where(s > 0, s, torch.ones_like(s))  # [B, 1, ...]  no 0/0 in the masked rows
    lp = -((sample.detach() - mean) ** 2) / (2 * safe**2) - torch.log(safe) - _HALF_LOG_2PI
    lp = lp.flatten(1).mean(1)  # [B]
    return torch.where(std > 0, lp, torch.zeros_like(lp))  # [B]


def _gaussian_step(
    mean: Tensor, std: Tensor, prev_sample: Tensor | None, generator: torch.Generator | None
) -> StepOutput:
    """Draw x_next = mean + std z (or take the given one) and score it."""
    if prev_sample is None and bool((std == 0).all()):
        prev_sample = mean.detach()  # [B, ...]  deterministic: no draw, the generator is untouched
    elif prev_sample is None:
        prev_sample = mean.detach() + _bcast(std, mean).detach() * _noise(mean, generator)
    else:
        _check_x(mean, prev_sample, "prev_sample")
        prev_sample = prev_sample.to(torch.float32)
    return StepOutput(prev_sample, gaussian_log_prob(prev_sample, mean, std), mean, std)


def _sde_mean(x: Tensor, v: Tensor, s: Tensor, g: Tensor, delta: Tensor) -> Tensor:
    """Flow-GRPO's Euler-Maruyama mean for diffusion scale g [B]. [B, ...]."""
    s_, g2, d = _bcast(s, x), _bcast(g**2, x), _bcast(delta, x)  # [B, 1, ...]
    return x * (1 + g2 * d / (2 * s_)) + v * (1 + g2 * (1 - s_) / (2 * s_)) * d  # [B, ...]


SIGMA_ONE_TOL = 1e-5  # flow_sde: sigmas this close to 1 take Flow-GRPO's sigma = 1 rule


def flow_sde(
    x: Tensor,
    v: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    noise_level: float,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
    sigma_max: float | Tensor | None = None,
) -> StepOutput:
    """Flow-GRPO SDE step, g = noise_level sqrt(sigma / (1 - sigma~)), sigma~ = sigma_max at sigma = 1."""
    _check_x(x, v, "v")
    if not noise_level >= 0:
        raise ValueError(f"noise_level must be >= 0, got {noise_level!r}")
    x, v = x.float(), v.float()  # [B, ...]
    s, sn = _sigmas(x, sigma, sigma_next)  # [B]
    smax = sn if sigma_max is None else per_sample(sigma_max, x, "sigma_max")  # [B]
    # sigma = 1 up to SIGMA_ONE_TOL: UniPC's flow sigmas (Wan) start at 1 - 1e-6 on purpose, where
    # 1 - sigma would make g ~ 700 a
    at_one = s >= 1 - SIGMA_ONE_TOL  # [B]
    if bool((at_one & ((smax >= 1 - SIGMA_ONE_TOL) | (smax <= 0))).any()):
        raise ValueError(
            f"sigma_max must lie in (0, 1) for a step at sigma = 1, got {smax.tolist()}"
        )
    denom = 1 - torch.where(at_one, smax, s)  # [B]
    g = noise_level * torch.sqrt(s / denom)  # [B]
    delta = sn - s  # [B]
    mean = _sde_mean(x, v, s, g, delta)  # [B, ...]
    return _gaussian_step(mean, g * torch.sqrt(-delta), prev_sample, generator)


def dance_sde(
    x: Tensor,
    v: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    eta: float,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> StepOutput:
    """DanceGRPO SDE step with constant diffusion eta (module doc; equals flow_sde with g = eta)."""
    _check_x(x, v, "v")
    if not eta >= 0:
        raise ValueError(f"eta must be >= 0, got {eta!r}")
    x, v = x.float(), v.float()  # [B, ...]
    s, sn = _sigmas(x, sigma, sigma_next)  # [B]
    s_, d = _bcast(s, x), _bcast(sn - s, x)  # [B, 1, ...]
    x0_hat = x - s_ * v  # [B, ...]
    score = -(x - (1 - s_) * x0_hat) / s_**2  # [B, ...]
    mean = x + d * v - d * (eta**2) * score / 2  # [B, ...]
    return _gaussian_step(mean, eta * torch.sqrt(s - sn), prev_sample, generator)


def cps(
    x: Tensor,
    v: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    noise_level: float,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> StepOutput:
    """Coefficients-preserving step: std s = sigma_next sin(a pi / 2); the mean keeps x's noise share."""
    _check_x(x, v, "v")
    if not 0 <= noise_level <= 1:
        raise ValueError(f"cps noise_level must lie in [0, 1], got {noise_level!r}")
    x, v = x.float(), v.float()  # [B, ...]
    s, sn = _sigmas(x, sigma, sigma_next)  # [B]
    std = sn * math.sin(noise_level * math.pi / 2)  # [B]
    s_, sn_ = _bcast(s, x), _bcast(sn, x)  # [B, 1, ...]
    x0_hat = x - s_ * v  # [B, ...]
    eps_hat = x + (1 - s_) * v  # [B, ...]
    keep = torch.sqrt((sn**2 - std**2).clamp(min=0))  # [B]  (>= 0; exactly 0 at noise_level 1)
    mean = (1 - sn_) * x0_hat + _bcast(keep, x) * eps_hat  # [B, ...]
    return _gaussian_step(mean, std, prev_sample, generator)


def ode(
    x: Tensor,
    v: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> StepOutput:
    """Deterministic Euler step x + (sigma_next - sigma) v; log_prob 0, std 0; generator unused."""
    _check_x(x, v, "v")
    x, v = x.float(), v.float()  # [B, ...]
    s, sn = _sigmas(x, sigma, sigma_next)  # [B]
    mean = x + _bcast(sn - s, x) * v  # [B, ...]  same order of operations as diffusers
    return _gaussian_step(mean, torch.zeros_like(s), prev_sample, None)


def ddim(
    x: Tensor,
    eps_pred: Tensor,
    alpha_prod_t: float | Tensor,
    alpha_prod_prev: float | Tensor,
    *,
    eta: float,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> StepOutput:
    """DDIM step for an epsilon-prediction model (no x0 clipping), std = eta sigma_t (DDIM eq. 16)."""
    _check_x(x, eps_pred, "eps_pred")
    if not eta >= 0:
        raise ValueError(f"eta must be >= 0, got {eta!r}")
    x, eps = x.float(), eps_pred.float()  # [B, ...]
    a_t = per_sample(alpha_prod_t, x, "alpha_prod_t")  # [B]
    a_p = per_sample(alpha_prod_prev, x, "alpha_prod_prev")  # [B]
    if bool(((a_t <= 0) | (a_t >= 1) | (a_p <= 0) | (a_p > 1) | (a_p < a_t)).any()):
        raise ValueError(
            "need 0 < alpha_prod_t < 1 and alpha_prod_t <= alpha_prod_prev <= 1 (cumulative alphas "
            f"grow towards the clean end), got {a_t.tolist()} and {a_p.tolist()}"
        )
    var = (1 - a_p) / (1 - a_t) * (1 - a_t / a_p)  # [B]
    std = eta * torch.sqrt(var)  # [B]
    x0_hat = (x - _bcast(torch.sqrt(1 - a_t), x) * eps) / _bcast(torch.sqrt(a_t), x)  # [B, ...]
    direction = _bcast(torch.sqrt((1 - a_p - std**2).clamp(min=0)), x) * eps  # [B, ...]
    mean = _bcast(torch.sqrt(a_p), x) * x0_hat + direction  # [B, ...]
    return _gaussian_step(mean, std, prev_sample, generator)


SAMPLERS: dict[str, Callable[..., StepOutput]] = {
    "flow_sde": flow_sde,
    "dance_sde": dance_sde,
    "cps": cps,
    "ode": ode,
    "ddim": ddim,
}

# The keyword option each sampler takes (a config's `diffusion.noise_level` / `diffusion.eta`), so a
# caller passes `**{k: getattr(cfg, k) for k in SAMPLER_OPTIONS[name]}` without branching on names.
SAMPLER_OPTIONS: dict[str, tuple[str, ...]] = {
    "flow_sde": ("noise_level",),
    "dance_sde": ("eta",),
    "cps": ("noise_level",),
    "ode": (),
    "ddim": ("eta",),
}
