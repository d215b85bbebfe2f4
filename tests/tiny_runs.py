"""The raw config of a tiny arithmetic training run, shared by the tests that train one end to end
(run directories, untrusted files, rewards, dropout): one place for the base, each test states only
what it changes."""

from __future__ import annotations

import copy
from typing import Any

from grouprl.config.loading import apply_overrides

BASE: dict[str, Any] = {
    "run": {"name": "run", "seed": 0, "device": "cpu", "console": False},
    "task": {"name": "arithmetic",
             "options": {"n_train": 8, "n_eval": 2, "ops": "+", "max_value": 9}},
    "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 3},
    "train": {"steps": 1, "lr": 1e-3},
}  # fmt: skip


def arithmetic_run(out_dir, model_dir, *overrides: str, **sections: dict) -> dict:
    """BASE with run.output_dir / model.name_or_path set, each `sections` mapping merged into its
    section (one level deep: task options merge too), then the dotted `overrides` applied."""
    raw = copy.deepcopy(BASE)
    raw["run"]["output_dir"] = str(out_dir)
    raw["model"] = {"name_or_path": str(model_dir)}
    for name, values in sections.items():
        if not isinstance(values, dict):  # a list section (rewards)
            raw[name] = values
            continue
        merged = raw.setdefault(name, {})
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
    return apply_overrides(raw, list(overrides))
