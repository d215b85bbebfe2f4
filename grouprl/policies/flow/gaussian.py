"""Pure functions on per-step flow-policy outputs: mean-space Gaussian KL and ratio diagnostics.

KL (Flow-GRPO, arXiv 2505.05470): the policy and the reference step are Gaussians with the same
std s (the SDE noise does not depend on the weights), so the exact KL is mean over elements
|mu - mu_ref|^2 / (2 s^2). Flow-GRPO's code divides by 2 g^2 instead, g the diffusion coefficient
(s = g sqrt(-delta)): its KL is the exact one times |delta|, and its beta (0.04) is tuned for that.
`gaussian_mean_kl` takes the variance to divide by; the policy picks it (`kl_form`). A variance of 0
(a deterministic ODE step) gives KL 0.

Ratio diagnostics (GRPO-Guard arXiv 2510.22319 motivates them: the per-step ratio is biased below 1
and its spread differs by step): per denoising step, the mean and std of the importance ratio over
the valid samples and the fraction outside the clip range [1 - eps, 1 + eps].
"""

from __future__ import annotations

import torch
from torch import Tensor


def gaussian_mean_kl(mean: Tensor, ref_mean: Tensor, var: Tensor) -> Tensor:
    """KL [n, K] = mean over elements (mu - mu_ref)^2 / (2 var); 0 where var == 0.

    mean / ref_mean: [n, K, *latent]; var: [n, K]. Gradient flows into `mean` only (the reference
    is a constant), in float32.
    """
    if mean.shape != ref_mean.shape or mean.shape[:2] != var.shape:
        raise ValueError(
            f"mean and ref_mean must be [n, K, ...] with var [n, K], got {tuple(mean.shape)}, "
            f"{tuple(ref_mean.shape)}, {tuple(var.shape)}"
        )
    sq = (mean.float() - ref_mean.detach().float()).pow(2).flatten(2).mean(-1)  # [n, K]
    v = var.detach().float()  # [n, K]
    safe = torch.where(v > 0, v, torch.ones_like(v))  # [n, K]
    return torch.where(v > 0, sq / (2 * safe), torch.zeros_like(sq))  # [n, K]


def ratio_diagnostics(
    logp: Tensor, old_logp: Tensor, mask: Tensor, *, clip_eps: float, prefix: str = "ratio"
) -> dict[str, float]:
    """Per-step ratio statistics for logging: for each step k with at least one valid sample,
    `{prefix}/step{k}/mean`, `/std` (population std over the valid samples) and `/clip_frac`
    (|ratio - 1| > clip_eps); plus the same three over all valid slots and `{prefix}/max_abs_log`.

    logp / old_logp: [n, K]; mask: Bool[n, K]. Nothing is differentiated (all detached).
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"logp, old_logp and mask must share one [n, K] shape, got {tuple(logp.shape)}, "
            f"{tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )
    mask = mask.bool()
    log_ratio = (logp.detach().double() - old_logp.detach().double()).masked_fill(~mask, 0.0)
    ratio = log_ratio.exp()  # [n, K]
    clipped = ((ratio - 1).abs() > clip_eps) & mask  # [n, K]
    out: dict[str, float] = {}

    def stats(r: Tensor, c: Tensor, m: Tensor, key: str) -> None:
        count = m.sum()
        mean = (r * m).sum() / count
        var = ((r - mean).pow(2) * m).sum() / count
        out[f"{key}/mean"] = float(mean)
        out[f"{key}/std"] = float(var.sqrt())
        out[f"{key}/clip_frac"] = float(c.sum() / count)

    for k in range(mask.shape[1]):
        if bool(mask[:, k].any()):
            stats(ratio[:, k], clipped[:, k], mask[:, k], f"{prefix}/step{k}")
    if bool(mask.any()):
        stats(ratio, clipped, mask, prefix)
        out[f"{prefix}/max_abs_log"] = float(log_ratio.abs().max())
    return out
