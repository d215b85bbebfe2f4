"""The DDIM / UNet policy of DDPO (arXiv 2305.13301): an SD 1.x- or SDXL-style epsilon-prediction
UNet2DConditionModel sampled with DDIM steps of eta > 0, each step an action with a Gaussian log-prob.

SDXL (its UNet's addition_embed_type "text_time": models.py passes the pooled embedding and time
ids) takes the same path: the DDIM schedule comes from its pipeline's EulerDiscreteScheduler config
(`ddim_config`: the same scaled_linear betas, steps_offset 1 and leading spacing), and the sampler
is DDIM with eta = diffusion.eta, as DDPO's SDXL ports do. Deviation: the SDXL pipeline itself
samples with Euler; grouprl's rollouts and evaluation use DDIM steps over the same noise schedule.

It is not a class of its own: a FlowPolicy over family "unet" composed with DDIMRules (rules.py:
the DDIM schedule and step, the exact mean-space KL; DDPO has no KL term). `ddim_policy` builds one
with DDPO's defaults (eta 1, 50 steps, DDPO_SCHEDULER); forward_noising (DiffusionNFT / AWM) is
flow-matching only and raises for it.
"""

from __future__ import annotations

from typing import Any

import torch

from grouprl.policies.flow.policy import FlowPolicy
from grouprl.policies.flow.rules import DDPO_SCHEDULER, DDIMRules, ddim_config
from grouprl.policies.flow.types import check_choice

__all__ = ["DDPO_SCHEDULER", "ddim_config", "ddim_policy"]


def ddim_policy(
    model: torch.nn.Module,
    *,
    latent_shape: tuple[int, ...],
    scheduler_config: dict | None = None,
    noise_level: float = 1.0,
    sampler: str = "ddim",
    kl_form: str = "exact",
    rollout_steps: int = 50,
    eval_steps: int = 50,
    **kwargs: Any,
) -> FlowPolicy:
    """FlowPolicy(model, family="unet", rules=DDIMRules(scheduler_config, eta=noise_level), ...);
    scheduler_config is a DDIMScheduler config (default DDPO_SCHEDULER; `ddim_config` turns a
    pipeline's scheduler config into one); the other keywords are FlowPolicy's."""
    check_choice("sampler", sampler, ("ddim",))
    if kl_form != "exact":
        raise ValueError("the DDIM policy's KL has no flow step size: kl_form must be 'exact'")
    return FlowPolicy(
        model,
        latent_shape=latent_shape,
        rules=DDIMRules(scheduler_config, noise_level),
        family=kwargs.pop("family", "unet"),
        rollout_steps=rollout_steps,
        eval_steps=eval_steps,
        **kwargs,
    )
