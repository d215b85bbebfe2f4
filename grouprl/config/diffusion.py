"""The `diffusion:` config section: sampler, trained steps, CFG, resolution and the flow objective.

Used by image / video policies (model.type flow or unet); text and agent runs ignore it. Defaults are
Flow-GRPO's (arXiv 2505.05470) where one method is meant: SDE sampler with noise level 0.7,
10 rollout / 40 evaluation steps, all steps but the last trained, advantages clipped to +-5.
Sources of the other values: METHODS.md sections 6-8 and peers/diffusion.md.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from grouprl.config.sections import _Section

Sampler = Literal["flow_sde", "dance_sde", "cps", "ode", "ddim"]
TrainSteps = Literal["all_but_last", "random_fraction", "random_window", "sliding_window"]
FlowObjective = Literal["policy_gradient", "diffusion_nft", "awm"]
EmaDecay = Literal["none", "nft_ramp", "nft_delayed", "awm_ramp"]

# the option that sets each stochastic sampler's noise (see policies.samplers.SAMPLER_OPTIONS)
_NOISE_FIELD = {"flow_sde": "noise_level", "cps": "noise_level", "dance_sde": "eta", "ddim": "eta"}


class DiffusionConfig(_Section):
    """Sampling, step selection, guidance and objective settings of a diffusion / flow policy."""

    # ---- sampler ----
    sampler: Sampler = Field(
        "flow_sde",
        description="Rollout step: flow_sde (Flow-GRPO), dance_sde (DanceGRPO, constant eta), cps "
        "(coefficients-preserving), ode (deterministic Euler; likelihood-free objectives only), "
        "ddim (epsilon-prediction UNets, DDPO).",
    )
    noise_level: float = Field(
        0.7, ge=0, description="a in g = a sqrt(sigma / (1 - sigma)) (flow_sde; 0.7 SD3, 0.9 FLUX), "
        "or cps's a in s = sigma_next sin(a pi / 2) (<= 1)."
    )  # fmt: skip
    eta: float = Field(
        0.3, ge=0, description="dance_sde's constant diffusion (0.3 FLUX) or DDIM's eta (1.0 DDPO)."
    )
    rollout_steps: int = Field(10, ge=1, description="Denoising steps of a training rollout.")
    eval_steps: int = Field(40, ge=1, description="Denoising steps of evaluation samples (ODE).")
    shift: float | None = Field(
        None, gt=0, description="Shift of the sigma schedule (None: the model's scheduler as "
        "shipped: SD3 shift 3.0, FLUX.1-dev dynamic shifting from the image size, Wan UniPC "
        "flow_shift 3.0). Set: replaces shift / flow_shift with a warning; on a scheduler with "
        "dynamic shifting it turns that off. An error for model.type unet."
    )  # fmt: skip
    sigma_spacing: Literal["scheduler", "linear"] = Field(
        "scheduler",
        description="scheduler: the scheduler's own timesteps (SD3, Wan); linear: linspace(1, 1/K) "
        "before shifting (the FLUX pipeline).",
    )

    # ---- which steps are stochastic and trained ----
    train_steps: TrainSteps = Field(
        "all_but_last",
        description="all_but_last (Flow-GRPO), random_fraction (DanceGRPO, per sample), "
        "random_window (Flow-GRPO-Fast: SDE window, ODE elsewhere), sliding_window (MixGRPO).",
    )
    train_fraction: float = Field(
        0.6, gt=0, le=1, description="random_fraction: share of the first K - 1 steps trained."
    )
    window_size: int = Field(
        2, ge=1, description="Steps in the SDE window (random/sliding_window)."
    )
    window_range: tuple[int, int] | None = Field(
        None, description="[lo, hi) step range the window lives in (None: (0, K // 2) for "
        "random_window, (0, K) for sliding_window)."
    )  # fmt: skip
    window_shift_every: int = Field(
        25, ge=1, description="sliding_window: optimizer steps per window position (MixGRPO 25)."
    )
    window_shift_by: int = Field(
        1, ge=0, description="sliding_window: steps the window moves each time (MixGRPO 1)."
    )
    window_at_end: Literal["stay", "wrap"] = Field(
        "stay", description="sliding_window: at the end of the range stay there or wrap to lo."
    )

    # ---- conditioning, noise, resolution ----
    guidance_scale: float = Field(
        1.0, ge=1, description="Classifier-free guidance scale at rollout (1.0: no CFG)."
    )
    train_guidance: Literal["same", "none"] = Field(
        "same",
        description="same: training recomputes the CFG'd velocity as in the rollout; none: the "
        "conditional velocity only (CFG-free training).",
    )
    shared_noise: Literal["off", "group"] = Field(
        "off", description="group: one initial noise per group (DanceGRPO / Flow-GRPO same_latent)."
    )
    height: int = Field(512, ge=8, description="Image height in pixels.")
    width: int = Field(512, ge=8, description="Image width in pixels.")
    num_frames: int = Field(1, ge=1, description="Video frames (1: an image model).")

    # ---- objective ----
    objective: FlowObjective = Field(
        "policy_gradient",
        description="policy_gradient: per-step log-probs through algorithm.* (Flow-GRPO family); "
        "diffusion_nft (arXiv 2509.16117) / awm (arXiv 2509.25050): likelihood-free losses on "
        "forward-noised samples; their velocity KL uses algorithm.kl_coef.",
    )
    adv_clip_max: float | None = Field(
        5.0, gt=0, description="Advantages clipped to +-this (None: off); A_max of NFT and AWM."
    )
    ratio_norm: Literal["off", "grpo_guard"] = Field(
        "off", description="grpo_guard: RatioNorm + 1/dt step weights (arXiv 2510.22319)."
    )
    nft_beta: float = Field(
        1.0, gt=0, description="DiffusionNFT mixing beta of v+ / v- (1.0; 0.1 OCR, multi-reward)."
    )
    awm_weighting: Literal["uniform", "ghuber"] = Field(
        "ghuber", description="AWM per-timestep weighting of the flow-matching error."
    )
    awm_ghuber_p: float = Field(0.25, gt=0, description="AWM ghuber exponent p.")
    awm_clip: float = Field(
        1.0, gt=0, description="AWM ratio clip range c (1.0: inactive on-policy)."
    )
    awm_adv_max: float = Field(
        1.0, gt=0, description="AWM: clipped advantages are scaled by awm_adv_max / adv_clip_max."
    )
    awm_ema_coef: float = Field(
        0.0, ge=0, description="AWM beta_ema on |v - v_ema|^2 (paper 1.0; needs EMA weights)."
    )
    lf_timesteps: int | None = Field(
        None, ge=1, description="Likelihood-free objectives: timesteps per sample, stratified "
        "(None: every step in the range; AWM 6)."
    )  # fmt: skip
    lf_timestep_fraction: float = Field(
        0.9, gt=0, le=1, description="Likelihood-free objectives: timesteps come from step "
        "indices [1, floor(fraction K)] of the rollout schedule."
    )  # fmt: skip
    ema_decay: EmaDecay = Field(
        "nft_ramp",
        description="How the old (NFT) / EMA (AWM) weights follow the trained ones, "
        "w <- d w + (1 - d) theta: nft_ramp d = min(0.001 step, 0.5); nft_delayed d = 0 before "
        "step 75, then min(0.0075 (step - 75), 0.999); awm_ramp d = min(0.001 step, 0.3); none d = 0.",
    )

    @model_validator(mode="after")
    def _check(self) -> DiffusionConfig:
        likelihood_free = self.objective != "policy_gradient"
        if self.objective == "policy_gradient":
            if self.sampler == "ode":
                raise ValueError(
                    "sampler='ode' has no step log-probs, so objective='policy_gradient' gets no "
                    "gradient; use a stochastic sampler or objective 'diffusion_nft' / 'awm'"
                )
            noise = _NOISE_FIELD[self.sampler]
            if getattr(self, noise) == 0:
                raise ValueError(
                    f"sampler={self.sampler!r} with {noise}=0 is deterministic (no log-probs); "
                    f"objective='policy_gradient' needs {noise} > 0"
                )
        if self.sampler == "cps" and self.noise_level > 1:
            raise ValueError(f"sampler='cps' needs noise_level in [0, 1], got {self.noise_level}")
        if likelihood_free and self.adv_clip_max is None:
            raise ValueError(
                f"objective={self.objective!r} maps advantages through A_max = adv_clip_max; "
                "set adv_clip_max (the papers use 5.0)"
            )
        if likelihood_free and self.ratio_norm != "off":
            raise ValueError(
                f"ratio_norm={self.ratio_norm!r} normalises step likelihood ratios; "
                f"objective={self.objective!r} has none (use objective='policy_gradient')"
            )
        k = self.rollout_steps
        if likelihood_free:  # the range of objectives.flow_support.stratified_timestep_indices
            hi = min(math.floor(self.lf_timestep_fraction * k), k - 1)
            if hi < 1 or (self.lf_timesteps or 0) > hi:
                raise ValueError(
                    f"objective={self.objective!r} trains on step indices 1..min(floor("
                    f"lf_timestep_fraction * rollout_steps), rollout_steps - 1) = 1..{hi}; "
                    f"lf_timesteps={self.lf_timesteps} does not fit (raise rollout_steps or "
                    "lf_timestep_fraction, or lower lf_timesteps)"
                )
        if self.objective == "policy_gradient" and self.train_steps in (
            "all_but_last", "random_fraction"
        ) and k < 2:  # fmt: skip
            raise ValueError(f"train_steps={self.train_steps!r} needs rollout_steps >= 2, got {k}")
        if self.train_steps in ("random_window", "sliding_window"):
            lo, hi = self.window_range or (0, max(k // 2, self.window_size))
            if self.train_steps == "sliding_window" and self.window_range is None:
                hi = k
            if not (0 <= lo and hi <= k and hi - lo >= self.window_size):
                raise ValueError(
                    f"window_range [{lo}, {hi}) with window_size {self.window_size} does not fit "
                    f"rollout_steps={k} (need 0 <= lo, hi <= rollout_steps, hi - lo >= window_size)"
                )
        return self
