"""What a flow family defines per denoising step: its schedule (sigmas and the network's
timesteps), one step x_k -> x_{k+1}, and the variance of the mean-space KL. FlowPolicy inherits
these flow-matching rules; UNetPolicy (unet.py) overrides all three with DDIM's. They read the
policy's family, latent_shape, scheduler_config, sigma_spacing and kl_form.

kl_form "flow_grpo" divides the squared mean difference by 2 g^2 (g^2 = std^2 / (sigma_k -
sigma_{k+1}), Flow-GRPO's code and its beta); "exact" divides by 2 std^2.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from grouprl.policies.flow.samplers import SAMPLER_OPTIONS, SAMPLERS, StepOutput, ode
from grouprl.policies.flow.schedule import flow_sigmas
from grouprl.policies.flow.steps import where_rows
from grouprl.policies.flow.types import FlowBatch


class FlowStepRules:
    """The flow-matching schedule, step and KL variance (module docstring)."""

    family: Any
    model: Any
    latent_shape: tuple[int, ...]
    scheduler_config: dict
    sigma_spacing: str
    kl_form: str

    def _schedule(self, num_steps: int) -> dict[str, Tensor]:
        """Per-slot values [K+1]: sigmas and the network's timesteps (sigma * num_train_timesteps)."""
        seq = None  # image tokens, for dynamic shifting (mu from the resolution)
        if self.family.name == "flux":  # 2x2 packed latents
            seq = (self.latent_shape[-2] // 2) * (self.latent_shape[-1] // 2)
        elif self.family.name == "sd3":  # patch_size x patch_size patches
            patch = int(getattr(getattr(self.model, "config", None), "patch_size", 1))
            seq = (self.latent_shape[-2] // patch) * (self.latent_shape[-1] // patch)
        sigmas = flow_sigmas(self.scheduler_config, num_steps, image_seq_len=seq,
                             spacing=self.sigma_spacing)  # fmt: skip  # [K+1]
        scale = self.scheduler_config.get("num_train_timesteps", 1000)
        return {"sigmas": sigmas, "timesteps": sigmas * scale, "alphas": None}

    def _step(self, batch_cols: dict[str, Tensor], k: int, x: Tensor, pred: Tensor,
              stochastic: Tensor, sampler: str, noise_level: float,
              prev_sample: Tensor | None, generator) -> StepOutput:  # fmt: skip
        """x_k -> x_{k+1} for rows [B]: the sampler on stochastic rows, the ODE step elsewhere."""
        sig, nxt = batch_cols["sigmas"][:, k], batch_cols["sigmas"][:, k + 1]  # [B] each
        det = ode(x, pred, sig, nxt, prev_sample=prev_sample)
        if not bool(stochastic.any()):
            return det
        opts = {name: noise_level for name in SAMPLER_OPTIONS[sampler]}
        sde = SAMPLERS[sampler](
            x, pred, sig, nxt, prev_sample=prev_sample, generator=generator, **opts
        )
        return where_rows(stochastic, sde, det)

    def _kl_var(self, batch: FlowBatch, std: Tensor) -> Tensor:  # [n, K]
        if self.kl_form == "exact":
            return std**2
        gap = (batch.sigmas[:, :-1] - batch.sigmas[:, 1:]).float()  # [n, K]  sigma_k - sigma_{k+1}
        return std**2 / gap
