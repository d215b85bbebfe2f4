"""Support for the likelihood-free flow objectives (objectives/flow/losses.py): which timesteps
are trained, how the old (DiffusionNFT, arXiv 2509.16117) / EMA (AWM, arXiv 2509.25050) weights
follow the trained ones, and which `diffusion:` config fields set each loss's keyword options.

Sources: METHODS.md sections 7-8. AWM draws K = 6 timesteps per sample, stratified over the step
indices [1, floor(0.9 K_s)] of its K_s-step sampling schedule. DiffusionNFT trains on the schedule's
steps; taking every index of the same range (k = None) is our reading [inferred]. Decay schedules
(old/EMA weights w <- d w + (1 - d) theta after each update): DiffusionNFT decay_type 1 ("nft_ramp")
and 2 ("nft_delayed"), AWM's EMA adapter ("awm_ramp").
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from grouprl.objectives.flow.losses import LIKELIHOOD_FREE
from grouprl.objectives.registry import Registry

EMA_DECAYS = Registry("old/EMA weight decay")


def stratified_timestep_indices(
    num_steps: int,
    k: int | None,
    fraction: float,
    batch: int,
    *,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Long[B, K] indices into the K_s + 1 rollout sigmas: candidates 1 .. min(floor(fraction K_s),
    K_s - 1) (index 0 is pure noise, K_s is the clean end), split into k contiguous strata with one
    uniform draw each per sample (AWM); k None: every candidate, the same for every sample."""
    if not 0 < fraction <= 1:
        raise ValueError(f"timestep fraction must be in (0, 1], got {fraction!r}")
    hi = min(math.floor(fraction * num_steps), num_steps - 1)
    if hi < 1:
        raise ValueError(
            f"no training timestep: {num_steps} steps with fraction {fraction} leave none"
        )
    candidates = torch.arange(1, hi + 1)  # [C]
    if k is None:
        return candidates.expand(batch, -1).clone()  # [B, C]
    if not 1 <= k <= len(candidates):
        raise ValueError(
            f"k = {k} timesteps per sample, but only {len(candidates)} candidates (1..{hi})"
        )
    strata = torch.tensor_split(candidates, k)  # k chunks
    cols = [s[torch.randint(len(s), (batch,), generator=generator)] for s in strata]  # k x [B]
    return torch.stack(cols, dim=1)  # [B, K]


@EMA_DECAYS.register("none")
def _no_decay(step: int) -> float:
    return 0.0


@EMA_DECAYS.register("nft_ramp")
def _nft_ramp(step: int) -> float:
    return min(0.001 * step, 0.5)  # DiffusionNFT decay_type 1


@EMA_DECAYS.register("nft_delayed")
def _nft_delayed(step: int) -> float:
    return 0.0 if step < 75 else min(0.0075 * (step - 75), 0.999)  # DiffusionNFT decay_type 2


@EMA_DECAYS.register("awm_ramp")
def _awm_ramp(step: int) -> float:
    return min(0.3, 0.001 * step)  # AWM's EMA adapter


@torch.no_grad()
def ema_update_(tracked: Iterable[Tensor], params: Iterable[Tensor], decay: float) -> None:
    """In place: w <- decay w + (1 - decay) theta for each pair (old / EMA weights follow theta)."""
    if not 0 <= decay <= 1:
        raise ValueError(f"decay must be in [0, 1], got {decay!r}")
    tracked, params = list(tracked), list(params)
    if len(tracked) != len(params):
        raise ValueError(f"{len(tracked)} tracked tensors for {len(params)} parameters")
    for w, p in zip(tracked, params):
        w.mul_(decay).add_(p.detach().to(w.dtype), alpha=1 - decay)


# kwarg of each objective -> the field of `diffusion.objective` that sets it (config/diffusion.py);
# adv_clip_max is the section's own `diffusion.adv_clip_max`
LIKELIHOOD_FREE_OPTIONS: dict[str, dict[str, str]] = {
    "diffusion_nft": {"beta": "beta"},
    "awm": {
        "clip": "clip", "weighting": "weighting", "p": "ghuber_p", "adv_max": "adv_max",
        "ema_coef": "ema_coef",
    },
}  # fmt: skip


def likelihood_free_options(diffusion_cfg: object) -> dict[str, object]:
    """The keyword options of `diffusion_cfg.objective`'s loss, read from the config section."""
    objective = diffusion_cfg.objective
    name = objective.type
    LIKELIHOOD_FREE[name]  # unknown names fail here, naming the allowed ones
    options = {kw: getattr(objective, f) for kw, f in LIKELIHOOD_FREE_OPTIONS[name].items()}
    return {**options, "adv_clip_max": diffusion_cfg.adv_clip_max}
