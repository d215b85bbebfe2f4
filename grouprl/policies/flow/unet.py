"""The DDIM / UNet policy: an SD 1.x-style epsilon-prediction UNet2DConditionModel sampled with DDIM
steps of eta > 0, each step an action with a Gaussian log-prob (DDPO, arXiv 2305.13301).

Same interface as FlowPolicy (sample / log_probs / reference / kl / decode / LoRA / save), which it
extends with a DDIM schedule and step; only the step math differs:
- schedule: a `DDIMScheduler` built from the pipeline's own scheduler config (`ddim_config`: SD 1.5's
  PNDM config, as DDPO's `DDIMScheduler.from_config(pipeline.scheduler.config)`), then
  `set_timesteps(K)` (leading / trailing / linspace spacing and steps_offset as in the pipeline);
  slot k holds the timestep t_k and
  alpha_bar(t_k); the last slot holds alpha_bar of t_{K-1} - T / K, or the scheduler's
  final_alpha_cumprod when that is negative (DDIMScheduler.step's rule). FlowBatch.sigmas stores
  sqrt(1 - alpha_bar), the noise share of x_t.
- step: `samplers.ddim` with eta = noise_level on stochastic steps (DDPO: eta 1), eta 0 elsewhere.
- KL: the exact mean-space Gaussian KL (|mu - mu_ref|^2 / (2 std^2)); DDPO has no KL term.
- forward_noising is flow-matching only (DiffusionNFT / AWM) and raises here.
Deviations: no x0 clipping (diffusers' SD configs have clip_sample False), as samplers.ddim. Step k
goes from alpha_bar(t_k) to alpha_bar(t_{k+1}); DDIMScheduler.step uses t_k - T / K, the same value
under the SD default "leading" spacing (other spacings can differ by a few timesteps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from grouprl.policies.flow.policy import FlowPolicy
from grouprl.policies.flow.samplers import StepOutput, ddim
from grouprl.policies.flow.steps import where_rows
from grouprl.policies.flow.types import FlowBatch

DDPO_SCHEDULER = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
}  # the SD 1.x DDIM config (StableDiffusionPipeline forces steps_offset 1)


def ddim_config(pipeline_scheduler: dict) -> dict:
    """The DDIM config DDPO samples with: `DDIMScheduler.from_config(pipeline.scheduler.config)`
    (SD 1.5 ships PNDM: its betas, num_train_timesteps, steps_offset and timestep_spacing carry
    over), with clip_sample off (the DDIM step here never clips x0, module docstring)."""
    from diffusers import DDIMScheduler

    cfg = {k: v for k, v in dict(DDIMScheduler.from_config(pipeline_scheduler).config).items()
           if not k.startswith("_")}  # fmt: skip
    if cfg.get("prediction_type", "epsilon") != "epsilon":
        raise ValueError(
            f"the UNet's scheduler has prediction_type={cfg['prediction_type']!r}; the DDIM policy "
            "takes epsilon-prediction UNets (SD 1.x)"
        )
    cfg["clip_sample"] = False
    return cfg


class UNetPolicy(FlowPolicy):
    """DDIM policy over a UNet2DConditionModel (module docstring); FlowPolicy's keywords apply, with
    sampler "ddim", noise_level = DDIM eta (default 1.0, DDPO), and scheduler_config a DDIMScheduler
    config (default DDPO_SCHEDULER)."""

    sampler_names = ("ddim",)

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        latent_shape: tuple[int, ...],
        scheduler_config: dict | None = None,
        sampler: str = "ddim",
        noise_level: float = 1.0,
        rollout_steps: int = 50,
        eval_steps: int = 50,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            model,
            latent_shape=latent_shape,
            scheduler_config=DDPO_SCHEDULER if scheduler_config is None else scheduler_config,
            family=kwargs.pop("family", "unet"),
            sampler=sampler,
            noise_level=noise_level,
            rollout_steps=rollout_steps,
            eval_steps=eval_steps,
            kl_form=kwargs.pop("kl_form", "exact"),
            **kwargs,
        )
        if self.kl_form != "exact":
            raise ValueError("the DDIM policy's KL has no flow step size: kl_form must be 'exact'")

    def _schedule(self, num_steps: int) -> dict[str, Tensor]:
        from diffusers import DDIMScheduler

        sched = DDIMScheduler.from_config(self.scheduler_config)
        sched.set_timesteps(num_steps)
        t = sched.timesteps.long()  # [K] decreasing
        last = int(t[-1]) - sched.config.num_train_timesteps // num_steps
        ac = sched.alphas_cumprod.float()  # [T]
        final = ac[last] if last >= 0 else torch.as_tensor(sched.final_alpha_cumprod).float()
        alphas = torch.cat([ac[t], final.reshape(1)])  # [K+1]
        timesteps = torch.cat([t, torch.tensor([max(last, 0)])]).float()  # [K+1]
        return {"sigmas": (1 - alphas).sqrt(), "timesteps": timesteps, "alphas": alphas}

    def _step(self, batch_cols, k, x, pred, stochastic, sampler, noise_level, prev_sample,
              generator) -> StepOutput:  # fmt: skip
        a_t, a_prev = batch_cols["alphas"][:, k], batch_cols["alphas"][:, k + 1]  # [B] each
        det = ddim(x, pred, a_t, a_prev, eta=0.0, prev_sample=prev_sample)
        if not bool(stochastic.any()):
            return det
        sde = ddim(
            x, pred, a_t, a_prev, eta=noise_level, prev_sample=prev_sample, generator=generator
        )
        return where_rows(stochastic, sde, det)

    def _kl_var(self, batch: FlowBatch, std: Tensor) -> Tensor:  # [n, K]
        return std**2

    def forward_noising(self, *args: Any, **kwargs: Any) -> Tensor:
        raise ValueError(
            "forward_noising (DiffusionNFT / AWM) needs a flow-matching policy; the DDIM UNet policy "
            "predicts epsilon: use FlowPolicy with a flow transformer"
        )

    def _save_scheduler(self, directory: Path) -> set[str]:
        """A pipeline's own scheduler (SD 1.5: PNDM) comes with the pipeline folder; without one,
        the DDIM config sampled with."""
        if self.pipeline_source is not None and self.lora is None:
            return set()
        from diffusers import DDIMScheduler

        DDIMScheduler.from_config(self.scheduler_config).save_config(directory / "scheduler")
        return {"scheduler"}
