"""Older config spellings -> the current ones, each with a warning that says what to write.

- `algorithm:` flat surrogate knobs (`eps_high: 0.28`, `sapo_tau_pos`, `clip_cov_ratio`, ...) and
  a surrogate given as a bare name (`surrogate: sapo`) -> the typed `algorithm.surrogate` mapping
  (`surrogate: {type: sapo, tau_pos: ...}`, grouprl/config/surrogates.py).
- `diffusion:` flat step-selection and objective keys (`window_size`, `nft_beta`, `awm_clip`,
  `lf_timesteps`, `ema_decay`, ...) and bare names (`objective: awm`) -> the typed
  `diffusion.train_steps` / `diffusion.objective` mappings (grouprl/config/diffusion.py).
- a config without `workload:` -> the workload inferred as older versions did (task.name "env":
  agent; model.type flow / unet: images; otherwise text).

Both are pure functions of the raw mapping (no pydantic), run before validation; a mapping already
in the current form passes through unchanged and silently.
"""

from __future__ import annotations

import warnings
from typing import Any

from grouprl.config.surrogates import FLAT_KEY_FAMILY, FLAT_KEYS


class ConfigDeprecation(FutureWarning):
    """An older config spelling was read; the message says what to write instead (a FutureWarning,
    so that it is shown to the person running the config by default)."""


class MigrationError(ValueError):
    """An older spelling that cannot be carried over (it conflicts with a newer one)."""


def migrate_algorithm(algo: Any) -> Any:
    """Flat surrogate keys of `algorithm:` -> `algorithm.surrogate`; other values pass through."""
    if not isinstance(algo, dict):
        return algo
    flat = [k for k in FLAT_KEYS if k in algo]
    named = isinstance(algo.get("surrogate"), str)
    if not flat and not named:
        return algo
    algo = dict(algo)
    surrogate = algo.pop("surrogate", None)
    nested = {"type": surrogate} if isinstance(surrogate, str) else dict(surrogate or {})
    moved = []
    for key in flat:
        family = FLAT_KEY_FAMILY.get(key)
        kind = nested.get("type")
        if family is not None and kind is not None and kind != family:
            raise MigrationError(
                f"algorithm.{key} applies to surrogate {family!r}, but the surrogate is {kind!r}; "
                f"remove it, or write algorithm.surrogate: {{type: {family}, "
                f"{FLAT_KEYS[key]}: ...}}"
            )
        new = FLAT_KEYS[key]
        if new in nested and nested[new] != algo[key]:
            raise MigrationError(
                f"algorithm.{key}={algo[key]!r} and algorithm.surrogate.{new}={nested[new]!r} "
                "disagree; keep only algorithm.surrogate." + new
            )
        nested[new] = algo.pop(key)
        moved.append(f"algorithm.{key} -> algorithm.surrogate.{new}")
    if named:
        moved.insert(
            0, f"algorithm.surrogate: {surrogate} -> algorithm.surrogate.type: {surrogate}"
        )
    algo["surrogate"] = nested
    warnings.warn(
        "deprecated flat surrogate keys: "
        + "; ".join(moved)
        + ". Write algorithm.surrogate: {"
        + ", ".join(f"{k}: {v}" for k, v in nested.items())
        + "} (the knobs of each type: grouprl/config/surrogates.py)",
        ConfigDeprecation,
        stacklevel=4,
    )
    return algo


_WINDOWS = ("random_window", "sliding_window")
_LIKELIHOOD_FREE = ("diffusion_nft", "awm")
# flat `diffusion:` key of older configs -> (typed part, its field, the types that have it)
FLAT_DIFFUSION_KEYS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "train_fraction": ("train_steps", "fraction", ("random_fraction",)),
    "window_size": ("train_steps", "window_size", _WINDOWS),
    "window_range": ("train_steps", "window_range", _WINDOWS),
    "window_shift_every": ("train_steps", "shift_every", ("sliding_window",)),
    "window_shift_by": ("train_steps", "shift_by", ("sliding_window",)),
    "window_at_end": ("train_steps", "at_end", ("sliding_window",)),
    "ratio_norm": ("objective", "ratio_norm", ("policy_gradient",)),
    "nft_beta": ("objective", "beta", ("diffusion_nft",)),
    "awm_weighting": ("objective", "weighting", ("awm",)),
    "awm_ghuber_p": ("objective", "ghuber_p", ("awm",)),
    "awm_clip": ("objective", "clip", ("awm",)),
    "awm_adv_max": ("objective", "adv_max", ("awm",)),
    "awm_ema_coef": ("objective", "ema_coef", ("awm",)),
    "lf_timesteps": ("objective", "timesteps", _LIKELIHOOD_FREE),
    "lf_timestep_fraction": ("objective", "timestep_fraction", _LIKELIHOOD_FREE),
    "ema_decay": ("objective", "ema_decay", _LIKELIHOOD_FREE),
}


def migrate_diffusion(section: Any) -> Any:
    """Flat step-selection / objective keys of `diffusion:` and the bare names `train_steps:
    random_window`, `objective: awm` -> the typed `diffusion.train_steps` / `diffusion.objective`
    mappings; other values pass through."""
    if not isinstance(section, dict):
        return section
    flat = [k for k in FLAT_DIFFUSION_KEYS if k in section]
    named = [k for k in ("train_steps", "objective") if isinstance(section.get(k), str)]
    if not flat and not named:
        return section
    section = dict(section)
    moved = []
    for part in named:
        moved.append(f"diffusion.{part}: {section[part]} -> diffusion.{part}.type")
        section[part] = {"type": section[part]}
    for key in flat:
        part, new, kinds = FLAT_DIFFUSION_KEYS[key]
        nested = dict(section.get(part) or {})
        kind = nested.get("type")
        if kind is not None and kind not in kinds:
            raise MigrationError(
                f"diffusion.{key} applies to diffusion.{part} of type {' / '.join(kinds)}, not "
                f"{kind!r}; remove it"
            )
        if new in nested and nested[new] != section[key]:
            raise MigrationError(
                f"diffusion.{key}={section[key]!r} and diffusion.{part}.{new}={nested[new]!r} "
                f"disagree; keep only diffusion.{part}.{new}"
            )
        nested[new] = section.pop(key)
        section[part] = nested
        moved.append(f"diffusion.{key} -> diffusion.{part}.{new}")
    warnings.warn(
        "deprecated flat diffusion keys: "
        + "; ".join(moved)
        + ". Write "
        + " and ".join(
            f"diffusion.{part}: {{" + ", ".join(f"{k}: {v}" for k, v in section[part].items()) + "}"
            for part in ("train_steps", "objective")
            if isinstance(section.get(part), dict)
        )
        + " (the knobs of each type: grouprl/config/diffusion.py)",
        ConfigDeprecation,
        stacklevel=4,
    )
    return section


def infer_workload(raw: dict) -> str:
    """The workload older configs meant: task.name env -> agent, model.type flow / unet ->
    images, model.type vlm -> vlm, else text."""
    task = raw.get("task") if isinstance(raw.get("task"), dict) else {}
    model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    if task.get("name") == "env":
        return "agent"
    if model.get("type") in ("flow", "unet"):
        return "images"
    if model.get("type") == "vlm":
        return "vlm"
    return "text"


def migrate(raw: Any) -> Any:
    """The whole raw config in the current spelling (a copy when anything changes)."""
    if not isinstance(raw, dict):
        return raw
    out = raw
    if isinstance(raw.get("algorithm"), dict):
        algo = migrate_algorithm(raw["algorithm"])
        if algo is not raw["algorithm"]:
            out = {**out, "algorithm": algo}
    if isinstance(raw.get("diffusion"), dict):
        diffusion = migrate_diffusion(raw["diffusion"])
        if diffusion is not raw["diffusion"]:
            out = {**out, "diffusion": diffusion}
    if "workload" not in raw:
        name = infer_workload(raw)
        out = {**out, "workload": {"type": name}}
        warnings.warn(
            f"the config names no workload; inferred workload: {{type: {name}}} from task.name / "
            "model.type as older versions did. Write it at the top level of the config: "
            f"`workload: {{type: {name}}}`",
            ConfigDeprecation,
            stacklevel=3,
        )
    return out
