"""Step rules: what a sampler defines per denoising step, as objects a FlowPolicy is composed with
(`FlowPolicy(model, ..., rules=FlowMatchRules(...))`), the way diffusers keeps its schedulers apart
from its models. A rules object has

  set_timesteps(num_steps) -> cols   the per-slot schedule [K+1]: "sigmas", "timesteps" (the
                                     network's time input) and "alphas" (DDIM) or None
  step(cols, k, x, pred, stochastic, *, noise_level=None, prev_sample=None, generator=None)
                                     x_k -> x_{k+1} for rows [B] (cols [B, K+1]): the stochastic
                                     sampler on `stochastic` rows, its deterministic step elsewhere;
                                     given prev_sample it only scores it (samplers.py)
  kl_var(batch, std) -> [n, K]       the variance of the mean-space Gaussian KL
  save_scheduler(directory, from_pipeline) -> names of the folders written
and the attributes sampler (the name stored in FlowBatch.sampler), noise_level (its parameter,
stored in FlowBatch.noise_level), prediction ("velocity" | "epsilon": what the denoiser predicts)
and scheduler_config (the diffusers scheduler config the schedule comes from).

Two rules ship:
- FlowMatchRules (flow_sde, dance_sde, cps, ode; velocity prediction): sigmas from the scheduler
  config (schedule.flow_sigmas, dynamic shifting from image_seq_len), timesteps = sigma *
  num_train_timesteps. kl_form "flow_grpo" divides the squared mean difference by 2 g^2 (g^2 =
  std^2 / (sigma_k - sigma_{k+1}), Flow-GRPO's code and its beta); "exact" divides by 2 std^2.
- DDIMRules (ddim; SD 1.x epsilon prediction, DDPO arXiv 2305.13301): a `DDIMScheduler` built from
  the pipeline's scheduler config (`ddim_config`), `set_timesteps(K)` as the pipeline does; slot k
  holds t_k and alpha_bar(t_k); the last slot alpha_bar of t_{K-1} - T / K, or the scheduler's
  final_alpha_cumprod when that is negative (DDIMScheduler.step's rule); "sigmas" holds
  sqrt(1 - alpha_bar), the noise share of x_t. eta = noise_level on stochastic steps (DDPO: 1),
  0 elsewhere; the exact KL. Deviations: no x0 clipping (diffusers' SD configs have clip_sample
  False); step k goes from alpha_bar(t_k) to alpha_bar(t_{k+1}), where DDIMScheduler.step uses
  t_k - T / K: the same value under SD's default "leading" spacing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from grouprl.policies.flow.samplers import SAMPLER_OPTIONS, SAMPLERS, StepOutput, ddim, ode
from grouprl.policies.flow.schedule import flow_sigmas
from grouprl.policies.flow.steps import where_rows
from grouprl.policies.flow.types import FlowBatch, check_choice

FLOW_SAMPLERS = ("flow_sde", "dance_sde", "cps", "ode")

DDPO_SCHEDULER = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
}  # the SD 1.x DDIM config (StableDiffusionPipeline forces steps_offset 1)


class StepRules(Protocol):
    """What FlowPolicy asks of its rules (module docstring)."""

    sampler: str
    noise_level: float
    prediction: Literal["velocity", "epsilon"]
    scheduler_config: dict

    def set_timesteps(self, num_steps: int) -> dict[str, Tensor | None]: ...

    def step(
        self, cols: dict[str, Tensor], k: int, x: Tensor, pred: Tensor, stochastic: Tensor, *,
        noise_level: float | None = None, prev_sample: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> StepOutput: ...  # fmt: skip

    def kl_var(self, batch: FlowBatch, std: Tensor) -> Tensor: ...

    def save_scheduler(self, directory: Path, from_pipeline: bool) -> set[str]: ...


def image_seq_len(family: Any, model: Any, latent_shape: tuple[int, ...]) -> int | None:
    """Image tokens of one latent, for dynamic shifting (mu from the resolution): FLUX, FLUX
    Kontext and Qwen-Image pack 2x2 latents (Kontext: the generated latents' tokens only, as its
    pipeline), SD3 uses patch_size x patch_size patches; None for the other families."""
    if family.packed_2x2:
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)
    if family.name == "sd3":
        patch = int(getattr(getattr(model, "config", None), "patch_size", 1))
        return (latent_shape[-2] // patch) * (latent_shape[-1] // patch)
    return None


class FlowMatchRules:
    """Flow-matching schedule, step and KL variance (module docstring)."""

    prediction: Literal["velocity", "epsilon"] = "velocity"

    def __init__(
        self,
        scheduler_config: dict | None = None,
        sampler: str = "flow_sde",
        noise_level: float = 0.7,
        *,
        sigma_spacing: Literal["scheduler", "linear"] = "scheduler",
        kl_form: Literal["flow_grpo", "exact"] = "flow_grpo",
        image_seq_len: int | None = None,
    ) -> None:
        check_choice("sampler", sampler, FLOW_SAMPLERS)
        check_choice("kl_form", kl_form, ("flow_grpo", "exact"))
        check_choice("sigma_spacing", sigma_spacing, ("scheduler", "linear"))
        self.scheduler_config = dict(scheduler_config or {})
        self.sampler, self.noise_level = sampler, float(noise_level)
        self.sigma_spacing, self.kl_form, self.image_seq_len = sigma_spacing, kl_form, image_seq_len

    def set_timesteps(self, num_steps: int) -> dict[str, Tensor | None]:
        """Per-slot values [K+1]: sigmas and the network's timesteps (sigma * num_train_timesteps)."""
        sigmas = flow_sigmas(self.scheduler_config, num_steps, image_seq_len=self.image_seq_len,
                             spacing=self.sigma_spacing)  # fmt: skip  # [K+1]
        scale = self.scheduler_config.get("num_train_timesteps", 1000)
        return {"sigmas": sigmas, "timesteps": sigmas * scale, "alphas": None}

    def step(self, cols, k, x, pred, stochastic, *, noise_level=None, prev_sample=None,
             generator=None) -> StepOutput:  # fmt: skip
        """x_k -> x_{k+1} for rows [B]: the sampler on stochastic rows, the ODE step elsewhere."""
        sig, nxt = cols["sigmas"][:, k], cols["sigmas"][:, k + 1]  # [B] each
        det = ode(x, pred, sig, nxt, prev_sample=prev_sample)
        if not bool(stochastic.any()):
            return det
        level = self.noise_level if noise_level is None else noise_level
        opts = {name: level for name in SAMPLER_OPTIONS[self.sampler]}
        sde = SAMPLERS[self.sampler](
            x, pred, sig, nxt, prev_sample=prev_sample, generator=generator, **opts
        )
        return where_rows(stochastic, sde, det)

    def kl_var(self, batch: FlowBatch, std: Tensor) -> Tensor:  # [n, K]
        if self.kl_form == "exact":
            return std**2
        gap = (batch.sigmas[:, :-1] - batch.sigmas[:, 1:]).float()  # [n, K]  sigma_k - sigma_{k+1}
        return std**2 / gap

    def save_scheduler(self, directory: Path, from_pipeline: bool) -> set[str]:
        """Write scheduler/ (the class the config names, with any shift override applied)."""
        import diffusers

        from grouprl.policies.flow.schedule import scheduler_class

        cls = getattr(diffusers, scheduler_class(self.scheduler_config))  # Wan: UniPC
        cls.from_config(self.scheduler_config).save_config(directory / "scheduler")
        return {"scheduler"}


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


class DDIMRules:
    """DDIM schedule and step for epsilon-prediction UNets, exact KL (module docstring);
    noise_level is DDIM's eta on stochastic steps."""

    sampler = "ddim"
    prediction: Literal["velocity", "epsilon"] = "epsilon"

    def __init__(self, scheduler_config: dict | None = None, noise_level: float = 1.0) -> None:
        self.scheduler_config = dict(
            DDPO_SCHEDULER if scheduler_config is None else scheduler_config
        )
        self.noise_level = float(noise_level)

    def set_timesteps(self, num_steps: int) -> dict[str, Tensor | None]:
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

    def step(self, cols, k, x, pred, stochastic, *, noise_level=None, prev_sample=None,
             generator=None) -> StepOutput:  # fmt: skip
        """x_k -> x_{k+1} for rows [B]: DDIM with eta on stochastic rows, eta 0 elsewhere."""
        a_t, a_prev = cols["alphas"][:, k], cols["alphas"][:, k + 1]  # [B] each
        det = ddim(x, pred, a_t, a_prev, eta=0.0, prev_sample=prev_sample)
        if not bool(stochastic.any()):
            return det
        eta = self.noise_level if noise_level is None else noise_level
        sde = ddim(x, pred, a_t, a_prev, eta=eta, prev_sample=prev_sample, generator=generator)
        return where_rows(stochastic, sde, det)

    def kl_var(self, batch: FlowBatch, std: Tensor) -> Tensor:  # [n, K]
        return std**2

    def save_scheduler(self, directory: Path, from_pipeline: bool) -> set[str]:
        """A pipeline's own scheduler (SD 1.5: PNDM) comes with the pipeline folder; without one,
        the DDIM config sampled with."""
        if from_pipeline:
            return set()
        from diffusers import DDIMScheduler

        DDIMScheduler.from_config(self.scheduler_config).save_config(directory / "scheduler")
        return {"scheduler"}
