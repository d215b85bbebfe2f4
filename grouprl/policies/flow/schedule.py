"""Sigma schedules, per-sample step selection and initial noise for flow-matching policies.

Sigmas (diffusers convention, x_sigma = (1 - sigma) x0 + sigma eps, decreasing, last = 0) come from the
model's own scheduler class built from its config (`_class_name`: FlowMatchEulerDiscreteScheduler, or
UniPC / DPM-Solver multistep in flow mode as Wan ships them), so shift, flow_shift, dynamic shifting
and Karras options behave exactly as in the diffusers pipelines. The policy then takes its own
stochastic step between those sigmas (not UniPC's multistep update: a deviation for Wan, whose
pipeline solves the same schedule with UniPC). `override_shift` applies an explicit shift and says
what it replaced (with dynamic shifting: the dynamic shifting itself). Rollouts use fewer steps than evaluation ("denoising
reduction", Flow-GRPO arXiv 2505.05470: 10 vs 40): both come from the same function with a different K.

Step selection (a registry, `STEP_SELECTIONS`) decides per sample which of the K steps are stochastic
(taken with the SDE) and which are trained (scored in the loss); train is always a subset of stochastic,
the other steps are taken with the deterministic `ode` step and never scored:
- "all_but_last" (Flow-GRPO): every step is stochastic, the first K - 1 are trained (the reference
  takes floor(K * 0.99) = K - 1 for K < 100).
- "random_fraction" (DanceGRPO arXiv 2505.07818): every step is stochastic; per sample a random
  floor((K - 1) * fraction) (at least 1) of the first K - 1 steps are trained.
- "random_window" (Flow-GRPO-Fast): a window of `window_size` steps starting uniformly in
  [lo, hi - window_size] is stochastic and trained, ODE elsewhere. Deviation: the reference draws one
  window per sampling batch; here one window per group (members of a group share it).
- "sliding_window" (MixGRPO arXiv 2507.21802): the window starts at lo + shift_by * (optimizer_step //
  shift_every), the same for every sample; at the end of the range it stays there ("stay") or wraps
  back to lo ("wrap").
The range [lo, hi) is `window_range` (default: (0, K // 2) for random_window, (0, K) for sliding).

Initial noise: "independent" per sample, or "shared" (one draw per group, repeated to its members:
DanceGRPO's init_same_noise, Flow-GRPO's same_latent).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

SelectionName = Literal["all_but_last", "random_fraction", "random_window", "sliding_window"]
NoiseMode = Literal["independent", "shared"]
BaseSpacing = Literal["scheduler", "linear"]


# flow-matching schedulers whose sigmas a policy samples with; the multistep ones only in their
# flow mode (use_flow_sigmas + flow_prediction, as Wan 2.1 ships UniPC); the key each names its shift
SHIFT_KEYS = {
    "FlowMatchEulerDiscreteScheduler": "shift",
    "UniPCMultistepScheduler": "flow_shift",
    "DPMSolverMultistepScheduler": "flow_shift",
}
DEFAULT_SCHEDULER = "FlowMatchEulerDiscreteScheduler"


def scheduler_class(scheduler_config: dict[str, Any] | None) -> str:
    """The diffusers scheduler class a config names (`_class_name`; none: FlowMatchEuler)."""
    name = dict(scheduler_config or {}).get("_class_name") or DEFAULT_SCHEDULER
    if name not in SHIFT_KEYS:
        raise ValueError(
            f"scheduler {name!r} is not a flow-matching scheduler this policy samples with; "
            f"supported: {sorted(SHIFT_KEYS)}"
        )
    if name != DEFAULT_SCHEDULER:
        cfg = dict(scheduler_config or {})
        if not cfg.get("use_flow_sigmas") or cfg.get("prediction_type") != "flow_prediction":
            raise ValueError(
                f"{name} is a flow-matching schedule only with use_flow_sigmas=true and "
                f"prediction_type='flow_prediction' (got {cfg.get('use_flow_sigmas')!r}, "
                f"{cfg.get('prediction_type')!r})"
            )
    return name


def override_shift(scheduler_config: dict[str, Any], shift: float) -> tuple[dict[str, Any], str]:
    """(config with an explicit shift applied, a sentence saying what changed).

    FlowMatchEuler: `shift`; with dynamic shifting (FLUX.1-dev) the explicit shift replaces it
    (use_dynamic_shifting -> false), since diffusers ignores `shift` when the shift comes from mu.
    UniPC / DPM-Solver in flow mode (Wan): `flow_shift`."""
    cfg = dict(scheduler_config)
    name = scheduler_class(cfg)
    key = SHIFT_KEYS[name]
    was = cfg.get(key, 1.0)
    cfg[key] = float(shift)
    note = f"diffusion.shift={shift} overrides the scheduler's {key} {was} ({name})"
    if cfg.get("use_dynamic_shifting"):
        cfg["use_dynamic_shifting"] = False
        note += (
            "; it replaces the scheduler's resolution-dependent dynamic shifting "
            "(use_dynamic_shifting -> false)"
        )
    return cfg, note


def flow_sigmas(
    scheduler_config: dict[str, Any] | None,
    num_steps: int,
    *,
    image_seq_len: int | None = None,
    spacing: BaseSpacing = "scheduler",
) -> Tensor:
    """The K + 1 sigmas (float32, decreasing, last = 0) of a K-step flow-matching sampling run.

    scheduler_config: a diffusers scheduler config (`_class_name` names the class: FlowMatchEuler,
    or UniPC / DPM-Solver multistep in flow mode as Wan ships them; None: FlowMatchEuler's defaults,
    shift 1). The sigmas are that scheduler's own after `set_timesteps(K)`, so shift, flow_shift,
    dynamic shifting and Karras options are exactly the pipelines'.
    spacing: "scheduler" = the scheduler's own default timesteps (SD3 / Wan pipelines); "linear" =
    linspace(1, 1/K, K) before shifting (the FLUX pipeline; FlowMatchEuler only). With
    `use_dynamic_shifting` the shift mu comes from `image_seq_len` (tokens of the packed latent) as
    in the FLUX pipeline.
    """
    import diffusers

    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if spacing not in ("scheduler", "linear"):
        raise ValueError(f"spacing must be 'scheduler' or 'linear', got {spacing!r}")
    name = scheduler_class(scheduler_config)
    sched = getattr(diffusers, name).from_config(dict(scheduler_config or {}))
    kwargs: dict[str, Any] = {}
    if name != DEFAULT_SCHEDULER:
        if spacing != "scheduler":
            raise ValueError(f"sigma spacing {spacing!r} needs FlowMatchEuler; {name} sets its own")
        sched.set_timesteps(num_steps)
        sigmas = torch.as_tensor(sched.sigmas).to(torch.float32)  # [K+1]
        if len(sigmas) != num_steps + 1 or float(sigmas[-1]) != 0.0:
            raise ValueError(
                f"{name} gave {len(sigmas)} sigmas ending at {float(sigmas[-1])}; a K-step run needs "
                "K + 1 ending at 0 (final_sigmas_type='zero')"
            )
        return sigmas
    if spacing == "linear":
        kwargs["sigmas"] = np.linspace(1.0, 1.0 / num_steps, num_steps)
    if sched.config.use_dynamic_shifting:
        if image_seq_len is None:
            raise ValueError("the scheduler uses dynamic shifting: pass image_seq_len")
        kwargs["mu"] = dynamic_shift_mu(sched.config, image_seq_len)
    sched.set_timesteps(num_steps, **kwargs)
    return sched.sigmas.to(torch.float32)  # [K+1]


def dynamic_shift_mu(config: Any, image_seq_len: int) -> float:
    """Resolution-dependent shift: linear in the token count between (base_len, base_shift) and
    (max_len, max_shift), as the FLUX pipeline computes it."""
    base_len, max_len = config.base_image_seq_len, config.max_image_seq_len
    slope = (config.max_shift - config.base_shift) / (max_len - base_len)
    return float(image_seq_len * slope + config.base_shift - slope * base_len)


# ---- step selection ----------------------------------------------------------------------------


@dataclass
class StepSelectionSettings:
    """Which denoising steps are stochastic and trained (see the module docstring)."""

    name: SelectionName = "all_but_last"
    fraction: float = 0.6  # random_fraction: share of the first K - 1 steps trained (DanceGRPO 0.6)
    window_size: int = 2  # random_window / sliding_window: steps in the SDE window
    window_range: tuple[int, int] | None = (
        None  # [lo, hi) the window lives in; None = see docstring
    )
    shift_every: int = 25  # sliding_window: optimizer steps per window position (MixGRPO 25)
    shift_by: int = 1  # sliding_window: steps the window moves each time (MixGRPO 1)
    at_end: Literal["stay", "wrap"] = "stay"  # sliding_window: what happens at the end of the range


@dataclass
class StepSelection:
    """train: Bool[N, K] steps scored in the loss; stochastic: Bool[N, K] steps taken with the SDE."""

    train: Tensor
    stochastic: Tensor


def _all_but_last(s, n, k, group_ids, generator, optimizer_step) -> StepSelection:
    if k < 2:
        raise ValueError(f"step selection 'all_but_last' needs >= 2 steps, got {k}")
    train = torch.ones(n, k, dtype=torch.bool)  # [N, K]
    train[:, -1] = False
    return StepSelection(train, torch.ones(n, k, dtype=torch.bool))


def _random_fraction(s, n, k, group_ids, generator, optimizer_step) -> StepSelection:
    if k < 2:
        raise ValueError(f"step selection 'random_fraction' needs >= 2 steps, got {k}")
    if not 0 < s.fraction <= 1:
        raise ValueError(f"step selection fraction must be in (0, 1], got {s.fraction}")
    count = max(1, math.floor((k - 1) * s.fraction))
    train = torch.zeros(n, k, dtype=torch.bool)  # [N, K]
    for i in range(n):  # a fresh permutation per sample, as DanceGRPO draws them
        train[i, torch.randperm(k - 1, generator=generator)[:count]] = True
    return StepSelection(train, torch.ones(n, k, dtype=torch.bool))


def _window_bounds(s: StepSelectionSettings, k: int, default_hi: int) -> tuple[int, int]:
    lo, hi = s.window_range if s.window_range is not None else (0, default_hi)
    if not (0 <= lo and hi <= k and hi - lo >= s.window_size >= 1):
        raise ValueError(
            f"step selection {s.name!r}: window_range [{lo}, {hi}) with window_size {s.window_size} "
            f"does not fit {k} steps (need 0 <= lo, hi <= K and hi - lo >= window_size >= 1)"
        )
    return lo, hi


def _window(n: int, k: int, starts: Tensor, size: int) -> Tensor:
    steps = torch.arange(k)  # [K]
    return (steps >= starts[:, None]) & (steps < starts[:, None] + size)  # [N, K]


def _random_window(s, n, k, group_ids, generator, optimizer_step) -> StepSelection:
    lo, hi = _window_bounds(s, k, max(k // 2, s.window_size))
    groups, inverse = torch.unique(group_ids, return_inverse=True)  # [G], [N]
    per_group = torch.randint(lo, hi - s.window_size + 1, (len(groups),), generator=generator)
    mask = _window(n, k, per_group[inverse], s.window_size)  # [N, K]
    return StepSelection(mask, mask.clone())


def _sliding_window(s, n, k, group_ids, generator, optimizer_step) -> StepSelection:
    if s.shift_every < 1 or s.shift_by < 0:
        raise ValueError(
            f"shift_every must be >= 1 and shift_by >= 0, got {s.shift_every}, {s.shift_by}"
        )
    if s.at_end not in ("stay", "wrap"):
        raise ValueError(f"at_end must be 'stay' or 'wrap', got {s.at_end!r}")
    lo, hi = _window_bounds(s, k, k)
    positions = hi - s.window_size - lo + 1  # distinct window starts in the range
    moved = s.shift_by * (optimizer_step // s.shift_every)
    offset = moved % positions if s.at_end == "wrap" else min(moved, positions - 1)
    mask = _window(n, k, torch.full((n,), lo + offset), s.window_size)  # [N, K]
    return StepSelection(mask, mask.clone())


STEP_SELECTIONS: dict[str, Callable[..., StepSelection]] = {
    "all_but_last": _all_but_last,
    "random_fraction": _random_fraction,
    "random_window": _random_window,
    "sliding_window": _sliding_window,
}


def select_steps(
    settings: StepSelectionSettings,
    num_steps: int,
    group_ids: Tensor,
    *,
    generator: torch.Generator | None = None,
    optimizer_step: int = 0,
) -> StepSelection:
    """train / stochastic masks Bool[N, K] for N = len(group_ids) samples of `num_steps` steps.

    generator: a CPU generator (the masks are small and built on CPU). optimizer_step: the number of
    optimizer steps taken so far (sliding_window only).
    """
    if settings.name not in STEP_SELECTIONS:
        raise ValueError(
            f"unknown step selection {settings.name!r}; allowed: {sorted(STEP_SELECTIONS)}"
        )
    group_ids = torch.as_tensor(group_ids).cpu()  # [N]
    out = STEP_SELECTIONS[settings.name](
        settings, int(group_ids.shape[0]), num_steps, group_ids, generator, optimizer_step
    )
    if bool((out.train & ~out.stochastic).any()):  # a trained ODE step would have no likelihood
        raise AssertionError("step selection trains a deterministic step")
    return out


# ---- initial noise -----------------------------------------------------------------------------


def initial_noise(
    shape: tuple[int, ...],
    group_ids: Tensor,
    mode: NoiseMode = "independent",
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Float32 N(0, I) noise [N, *shape]: one draw per sample, or one per group ("shared").

    Drawn on the generator's device (CPU without a generator) and moved to `device`, so a seeded CPU
    generator gives the same noise whatever device the model is on.
    """
    group_ids = torch.as_tensor(group_ids)  # [N]
    gen_device = generator.device if generator is not None else torch.device("cpu")
    if mode == "independent":
        rows = len(group_ids)
        noise = torch.randn(rows, *shape, generator=generator, device=gen_device)  # [N, *shape]
    elif mode == "shared":
        groups, inverse = torch.unique(group_ids.cpu(), return_inverse=True)  # [G], [N]
        per_group = torch.randn(len(groups), *shape, generator=generator, device=gen_device)
        noise = per_group[inverse.to(gen_device)]  # [N, *shape]
    else:
        raise ValueError(f"noise mode must be 'independent' or 'shared', got {mode!r}")
    return noise.to(device=device, dtype=torch.float32)
