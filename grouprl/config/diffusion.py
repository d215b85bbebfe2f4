"""The `diffusion:` config section: sampler, trained steps, CFG, resolution and the flow objective.

The section of workload images (text and agent configs have none). Two of its parts are typed by
`type`: `train_steps` (which steps are stochastic and trained) and `objective` (the loss and its
knobs); a knob of another type is an error naming the allowed ones. Defaults are
Flow-GRPO's (arXiv 2505.05470) where one method is meant: SDE sampler with noise level 0.7,
10 rollout / 40 evaluation steps, all steps but the last trained, advantages clipped to +-5.
Sources of the other values: METHODS.md sections 6-8 and peers/diffusion.md.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from grouprl.config.migration import migrate_diffusion
from grouprl.config.section import Section

Sampler = Literal["flow_sde", "dance_sde", "cps", "ode", "ddim"]
EmaDecay = Literal["none", "nft_ramp", "nft_delayed", "awm_ramp"]

# the field that sets each stochastic sampler's noise (see policies.flow.samplers.SAMPLER_OPTIONS);
# the one copy (grouprl/workloads/images/policy.py imports it)
NOISE_FIELD = {"flow_sde": "noise_level", "cps": "noise_level", "dance_sde": "eta", "ddim": "eta"}


# ---- which steps are stochastic and trained (policies/flow/schedule.py) ----


class AllButLastSteps(Section):
    """Flow-GRPO: every step but the last is stochastic and trained."""

    type: Literal["all_but_last"] = Field("all_but_last", description="Flow-GRPO's selection.")


class RandomFractionSteps(Section):
    """DanceGRPO: a random share of the first K - 1 steps, drawn per sample."""

    type: Literal["random_fraction"] = Field("random_fraction", description="DanceGRPO's.")
    fraction: float = Field(0.6, gt=0, le=1, description="Share of the first K - 1 steps trained.")


class RandomWindowSteps(Section):
    """Flow-GRPO-Fast: an SDE window at a random place per group, ODE elsewhere."""

    type: Literal["random_window"] = Field("random_window", description="Flow-GRPO-Fast's.")
    window_size: int = Field(2, ge=1, description="Steps in the SDE window.")
    window_range: tuple[int, int] | None = Field(
        None, description="[lo, hi) step range the window lives in (None: (0, K // 2))."
    )


class SlidingWindowSteps(Section):
    """MixGRPO: an SDE window that moves along the schedule as training goes."""

    type: Literal["sliding_window"] = Field("sliding_window", description="MixGRPO's.")
    window_size: int = Field(2, ge=1, description="Steps in the SDE window.")
    window_range: tuple[int, int] | None = Field(
        None, description="[lo, hi) step range the window lives in (None: (0, K))."
    )
    shift_every: int = Field(
        25, ge=1, description="Optimizer steps per window position (MixGRPO 25)."
    )
    shift_by: int = Field(1, ge=0, description="Steps the window moves each time (MixGRPO 1).")
    at_end: Literal["stay", "wrap"] = Field(
        "stay", description="At the end of the range stay there or wrap to lo."
    )


TrainSteps = Annotated[
    AllButLastSteps | RandomFractionSteps | RandomWindowSteps | SlidingWindowSteps,
    Field(discriminator="type"),
]


# ---- objective ----


class PolicyGradientObjective(Section):
    """Per-step log-probs through algorithm.* (the Flow-GRPO family)."""

    type: Literal["policy_gradient"] = Field(
        "policy_gradient", description="Per-step likelihood ratios and algorithm.surrogate."
    )
    ratio_norm: Literal["off", "grpo_guard"] = Field(
        "off", description="grpo_guard: RatioNorm + 1/dt step weights (arXiv 2510.22319)."
    )


_EMA_DESCRIPTION = (
    "How the old (NFT) / EMA (AWM) weights follow the trained ones, w <- d w + (1 - d) theta: "
    "nft_ramp d = min(0.001 step, 0.5); nft_delayed d = 0 before step 75, then "
    "min(0.0075 (step - 75), 0.999); awm_ramp d = min(0.001 step, 0.3); none d = 0."
)


class DiffusionNftObjective(Section):
    """DiffusionNFT (arXiv 2509.16117): flow matching on forward-noised samples, likelihood-free."""

    type: Literal["diffusion_nft"] = Field("diffusion_nft", description="DiffusionNFT's loss.")
    beta: float = Field(
        1.0, gt=0, description="Mixing beta of v+ / v- (1.0; 0.1 OCR, multi-reward)."
    )
    timesteps: int | None = Field(
        None, ge=1, description="Timesteps per sample, stratified (None: every step in the range)."
    )
    timestep_fraction: float = Field(
        0.9, gt=0, le=1, description="Timesteps come from step indices [1, floor(fraction K)] of "
        "the rollout schedule."
    )  # fmt: skip
    ema_decay: EmaDecay = Field("nft_ramp", description=_EMA_DESCRIPTION)


class AwmObjective(Section):
    """AWM (arXiv 2509.25050): advantage-weighted flow matching, likelihood-free."""

    type: Literal["awm"] = Field("awm", description="Advantage-weighted matching.")
    weighting: Literal["uniform", "ghuber"] = Field(
        "ghuber", description="Per-timestep weighting of the flow-matching error."
    )
    ghuber_p: float = Field(0.25, gt=0, description="ghuber exponent p.")
    clip: float = Field(1.0, gt=0, description="Ratio clip range c (1.0: inactive on-policy).")
    adv_max: float = Field(
        1.0, gt=0, description="Clipped advantages are scaled by adv_max / adv_clip_max."
    )
    ema_coef: float = Field(
        0.0, ge=0, description="beta_ema on |v - v_ema|^2 (paper 1.0; needs EMA weights)."
    )
    timesteps: int | None = Field(
        None, ge=1, description="Timesteps per sample, stratified (None: every step in the "
        "range; AWM 6)."
    )  # fmt: skip
    timestep_fraction: float = Field(
        0.9, gt=0, le=1, description="Timesteps come from step indices [1, floor(fraction K)] of "
        "the rollout schedule."
    )  # fmt: skip
    ema_decay: EmaDecay = Field("nft_ramp", description=_EMA_DESCRIPTION)


FlowObjectiveConfig = Annotated[
    PolicyGradientObjective | DiffusionNftObjective | AwmObjective, Field(discriminator="type")
]
# the default `type` of each typed part, for a mapping that names none
DEFAULT_TYPES = {"train_steps": "all_but_last", "objective": "policy_gradient"}


class DiffusionConfig(Section):
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
        default_factory=AllButLastSteps,
        description="{type: all_but_last} (Flow-GRPO), {type: random_fraction, fraction} "
        "(DanceGRPO, per sample), {type: random_window, window_size, window_range} "
        "(Flow-GRPO-Fast: SDE window, ODE elsewhere), {type: sliding_window, window_size, "
        "window_range, shift_every, shift_by, at_end} (MixGRPO).",
    )

    # ---- conditioning, noise, resolution ----
    guidance_scale: float = Field(
        1.0, ge=1, description="Classifier-free guidance scale at rollout (1.0: no CFG)."
    )
    guidance_scale_2: float | None = Field(
        None,
        ge=1,
        description="A two-expert pipeline (Wan 2.2 A14B): the low-noise expert's (transformer_2) "
        "guidance scale, as WanPipeline's guidance_scale_2; None: guidance_scale.",
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
    objective: FlowObjectiveConfig = Field(
        default_factory=PolicyGradientObjective,
        description="{type: policy_gradient, ratio_norm}: per-step log-probs through "
        "algorithm.* (Flow-GRPO family); {type: diffusion_nft, ...} (arXiv 2509.16117) / "
        "{type: awm, ...} (arXiv 2509.25050): likelihood-free losses on forward-noised samples; "
        "their velocity KL uses algorithm.kl_coef.",
    )
    adv_clip_max: float | None = Field(
        5.0, gt=0, description="Advantages clipped to +-this (None: off); A_max of NFT and AWM."
    )

    @model_validator(mode="before")
    @classmethod
    def _typed_parts(cls, data: Any) -> Any:
        """Older flat keys (train_fraction, nft_beta, awm_clip ...) moved with a warning; a typed
        part given without a type takes the default one."""
        data = migrate_diffusion(data)
        if isinstance(data, dict):
            data = dict(data)
            for key, default in DEFAULT_TYPES.items():
                if isinstance(data.get(key), dict) and "type" not in data[key]:
                    data[key] = {"type": default, **data[key]}
        return data

    @model_validator(mode="after")
    def _check(self) -> DiffusionConfig:
        obj, steps = self.objective, self.train_steps
        likelihood_free = obj.type != "policy_gradient"
        if obj.type == "policy_gradient":
            if self.sampler == "ode":
                raise ValueError(
                    "sampler='ode' has no step log-probs, so objective='policy_gradient' gets no "
                    "gradient; use a stochastic sampler or objective 'diffusion_nft' / 'awm'"
                )
            noise = NOISE_FIELD[self.sampler]
            if getattr(self, noise) == 0:
                raise ValueError(
                    f"sampler={self.sampler!r} with {noise}=0 is deterministic (no log-probs); "
                    f"objective='policy_gradient' needs {noise} > 0"
                )
        if self.sampler == "cps" and self.noise_level > 1:
            raise ValueError(f"sampler='cps' needs noise_level in [0, 1], got {self.noise_level}")
        if likelihood_free and self.adv_clip_max is None:
            raise ValueError(
                f"objective {obj.type!r} maps advantages through A_max = adv_clip_max; "
                "set adv_clip_max (the papers use 5.0)"
            )
        k = self.rollout_steps
        if likelihood_free:  # the range of objectives.flow_support.stratified_timestep_indices
            hi = min(math.floor(obj.timestep_fraction * k), k - 1)
            if hi < 1 or (obj.timesteps or 0) > hi:
                raise ValueError(
                    f"objective {obj.type!r} trains on step indices 1..min(floor("
                    f"timestep_fraction * rollout_steps), rollout_steps - 1) = 1..{hi}; "
                    f"objective.timesteps={obj.timesteps} does not fit (raise rollout_steps or "
                    "objective.timestep_fraction, or lower objective.timesteps)"
                )
        if obj.type == "policy_gradient" and steps.type in (
            "all_but_last", "random_fraction"
        ) and k < 2:  # fmt: skip
            raise ValueError(f"train_steps {steps.type!r} needs rollout_steps >= 2, got {k}")
        if steps.type in ("random_window", "sliding_window"):
            lo, hi = steps.window_range or (0, max(k // 2, steps.window_size))
            if steps.type == "sliding_window" and steps.window_range is None:
                hi = k
            if not (0 <= lo and hi <= k and hi - lo >= steps.window_size):
                raise ValueError(
                    f"train_steps.window_range [{lo}, {hi}) with window_size {steps.window_size} "
                    f"does not fit rollout_steps={k} (need 0 <= lo, hi <= rollout_steps, "
                    "hi - lo >= window_size)"
                )
        return self
