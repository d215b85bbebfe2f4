"""`Config`: the whole run configuration, assembled from one model per section.

Before validation: older spellings are migrated (grouprl/config/migration.py), the workload's own
section is picked (grouprl/config/workload.py: `agent` / `diffusion` for the built-ins, None for
the other workloads; a registered workload's section is validated by its settings model and is
`cfg.workload_settings`), and `algorithm.preset`'s settings for other sections fill the fields the
config left unset. After: the combination checks (grouprl/config/checks.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    ValidationError,
    model_serializer,
    model_validator,
)

from grouprl.config.agent import AgentConfig
from grouprl.config.algorithm import AlgorithmConfig
from grouprl.config.checkpoint import CheckpointConfig
from grouprl.config.checks import check_combinations
from grouprl.config.curriculum import CurriculumConfig
from grouprl.config.diffusion import DiffusionConfig
from grouprl.config.evaluation import EvalConfig
from grouprl.config.migration import migrate
from grouprl.config.model import DEFAULT_MODEL_TYPE, ModelConfig
from grouprl.config.presets import preset_settings
from grouprl.config.rewards import RewardConfig
from grouprl.config.rollout import RolloutConfig
from grouprl.config.run import RunConfig
from grouprl.config.section import Section
from grouprl.config.task import TaskConfig
from grouprl.config.training import TrainConfig
from grouprl.config.workload import (
    BUILTIN_SECTIONS,
    WorkloadConfig,
    split_sections,
    workload_settings_model,
)


class Config(Section):
    """The run configuration: one typed section per component (module docstring)."""

    run: RunConfig = Field(default_factory=RunConfig, description="Run name, folders, seed.")
    workload: WorkloadConfig = Field(
        default_factory=WorkloadConfig, description="The workload and so the section it reads."
    )
    model: ModelConfig = Field(..., description="The policy.")
    task: TaskConfig = Field(..., description="The task (examples and its rewards).")
    rewards: list[RewardConfig] = Field(default_factory=list, description="Empty: task defaults.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Sampling.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Objective.")
    curriculum: CurriculumConfig = Field(
        default_factory=CurriculumConfig, description="Prompt order."
    )
    agent: AgentConfig | None = Field(
        None, description="workload agent only: multi-turn episodes (None for other workloads)."
    )
    diffusion: DiffusionConfig | None = Field(
        None, description="workload images only: diffusion / flow settings (None otherwise)."
    )
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimisation.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoints."
    )
    # a registered workload's own section (not a field: its model is the workload's)
    _section: tuple[str, BaseModel] | None = PrivateAttr(None)

    @model_validator(mode="wrap")
    @classmethod
    def _workload_section(cls, data: Any, handler: Any) -> Config:
        """Older spellings migrated; the workload's section split off and validated by the
        workload's settings model when it is not one of Config's fields."""
        if not isinstance(data, dict):
            return handler(data)
        data, key, raw = split_sections(migrate(data))
        if isinstance(data.get("model"), dict) and "type" not in data["model"]:
            data["model"] = {"type": DEFAULT_MODEL_TYPE, **data["model"]}
        data = apply_preset_sections(data)
        settings = None
        if key is not None:
            model = workload_settings_model(data["workload"]["type"])
            try:
                settings = model.model_validate(raw if raw is not None else {})
            except ValidationError as err:
                lines = "; ".join(
                    f"{key}.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                    + (f" (allowed keys: {', '.join(model.model_fields)})"
                       if e["type"] == "extra_forbidden" else "")
                    for e in err.errors()
                )  # fmt: skip
                raise ValueError(f"section {key!r}: {lines}") from None
        cfg = handler(data)
        if settings is not None:
            cfg._section = (key, settings)
        return cfg

    @model_validator(mode="after")
    def _check_combinations(self) -> Config:
        check_combinations(self)
        return self

    @model_serializer(mode="wrap")
    def _with_workload_section(self, handler, info):  # unannotated: the schema stays Config's
        out = handler(self)
        if not isinstance(out, dict):
            return out
        for key in BUILTIN_SECTIONS:  # another workload's section: not part of this config
            if out.get(key, ...) is None:
                del out[key]
        if self._section is not None:
            key, settings = self._section
            out[key] = settings.model_dump(mode=info.mode)
        return out

    @property
    def workload_settings(self) -> BaseModel | None:
        """The workload's own section: agent / diffusion for the built-ins, the registered
        workload's settings otherwise, None for a workload without settings."""
        if self._section is not None:
            return self._section[1]
        return {"agent": self.agent, "images": self.diffusion}.get(self.workload.type)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


def apply_preset_sections(data: dict) -> dict:
    """Preset settings for other sections ("rollout.group_size") fill fields left unset; a
    mapping ("model.lora") fills the keys missing from the user's mapping (null stays null).
    Settings for a section the workload does not have (agent, diffusion) are left out, with a
    warning naming them."""
    if not isinstance(data, dict):
        return data
    algo = data.get("algorithm") or {}
    if not isinstance(algo, dict):
        return data
    data = dict(data)
    name = algo.get("preset", "grpo")
    blocked, unused = [], []
    for key, value in preset_settings(name, sections=True).items():
        section, field = key.split(".", 1)
        if section in BUILTIN_SECTIONS and data.get(section) is None:
            unused.append(key)  # another workload's section (split_sections set the workload's own)
            continue
        current = data.get(section) or {}
        if not isinstance(current, dict):
            continue
        mine = current.get(field, {})
        if isinstance(value, Mapping) and isinstance(mine, dict) and "type" in value:
            # a typed part (diffusion.objective): the preset's knobs fill the config's only
            # for the same type; a config naming another type keeps its mapping whole
            if mine.get("type", value["type"]) != value["type"]:
                blocked.append((f"{key}.type", value["type"], mine["type"]))
                continue
        if isinstance(value, Mapping) and isinstance(mine, dict):
            data[section] = {**current, field: {**value, **mine}}
            blocked += [(f"{key}.{k}", value[k], mine[k]) for k in value
                        if k in mine and not _same(mine[k], value[k])]  # fmt: skip
        elif field not in current:
            data[section] = {**current, field: value}
        elif not _same(current[field], value):
            blocked.append((key, value, current[field]))
    if unused:
        workload = (data.get("workload") or {}).get("type")
        warnings.warn(
            f"algorithm.preset={name!r} sets {', '.join(unused)}, which workload {workload!r} does "
            "not have; those settings are not used (the preset's algorithm settings are)",
            stacklevel=2,
        )
    if blocked:
        warnings.warn(
            f"algorithm.preset={name!r} cannot apply all its settings: the config sets "
            + ", ".join(
                f"{k}={_plain(mine)!r} (the preset's: {_plain(v)!r})" for k, v, mine in blocked
            )  # fmt: skip
            + " itself; the config's values are kept. Remove those keys from the config to "
            "run the preset as published",
            stacklevel=2,
        )
    return data


def _plain(value: Any) -> Any:
    """A preset value as YAML shows it (read-only mappings -> dict, tuples -> list)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    """Equal as config values (a preset's tuple equals the YAML's list)."""
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b
