"""Typed run configuration: YAML file + dotted CLI overrides -> validated `Config`.

One pydantic model per component, a docstring (description) per field; unknown keys fail with the
nearest valid key, wrong values with the allowed ones; incompatible settings fail or warn with why.
The `algorithm.preset` named in config.presets fills every algorithm field the user left unset
(and the fields of other sections it names, when the config leaves them unset: a preset blocked by
the config's own values warns, naming the keys).

What the user wrote is kept apart from what defaults and the preset filled in: `user_settings(cfg)`
gives the former (a run's config.yaml), `cfg.model_dump()` the latter (config.resolved.yaml), so a
saved config.yaml re-used with another preset (`grouprl train runs/x/config.yaml
algorithm.preset=dapo`) is re-resolved under the new preset instead of keeping the old one's values.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from grouprl.config.diffusion import DiffusionConfig
from grouprl.config.loop import (  # noqa: F401  (re-exported: the public config API)
    AgentConfig,
    CheckpointConfig,
    CurriculumConfig,
    EvalConfig,
    TrainConfig,
)
from grouprl.config.presets import preset_settings
from grouprl.config.sections import (  # noqa: F401  (re-exported: the public config API)
    Advantage,
    Aggregation,
    AlgorithmConfig,
    Correction,
    LoRAConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
    _Section,
)


class ConfigError(ValueError):
    """A config problem, with a message a person can act on."""


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig
    task: TaskConfig
    rewards: list[RewardConfig] = Field(default_factory=list, description="Empty: task defaults.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    diffusion: DiffusionConfig = Field(
        default_factory=DiffusionConfig, description="Image / video policies only."
    )
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @model_validator(mode="before")
    @classmethod
    def _apply_preset_sections(cls, data: Any) -> Any:
        """Preset settings for other sections ("rollout.group_size") fill fields left unset; a
        mapping ("model.lora") fills the keys missing from the user's mapping (null stays null)."""
        if not isinstance(data, dict):
            return data
        algo = data.get("algorithm") or {}
        if not isinstance(algo, dict):
            return data
        data = dict(data)
        name = algo.get("preset", "grpo")
        blocked = []
        for key, value in preset_settings(name, sections=True).items():
            section, field = key.split(".", 1)
            current = data.get(section) or {}
            if not isinstance(current, dict):
                continue
            mine = current.get(field, {})
            if isinstance(value, Mapping) and isinstance(mine, dict):
                data[section] = {**current, field: {**value, **mine}}
                blocked += [(f"{key}.{k}", value[k], mine[k]) for k in value
                            if k in mine and not _same(mine[k], value[k])]  # fmt: skip
            elif field not in current:
                data[section] = {**current, field: value}
            elif not _same(current[field], value):
                blocked.append((key, value, current[field]))
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

    @model_validator(mode="after")
    def _check_combinations(self) -> Config:
        check_combinations(self)
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


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


_GROUP_BASELINES = {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "gpg", "grpo_passk"}


def check_combinations(cfg: Config) -> None:
    """Errors for settings that cannot work together, warnings for ones that rarely make sense."""
    a, r = cfg.algorithm, cfg.rollout
    if r.group_size == 1 and a.advantage in _GROUP_BASELINES:
        raise ValueError(
            f"rollout.group_size=1 with advantage={a.advantage!r}: every estimator here compares a "
            "sample with its own group, so a group of one has advantage 0 and nothing is learned; "
            "use group_size >= 2"
        )
    n = r.prompts_per_step * r.group_size
    if n % a.minibatches:
        raise ValueError(
            f"algorithm.minibatches={a.minibatches} must divide the batch of "
            f"prompts_per_step * group_size = {n} samples"
        )
    if a.ratio_level == "sequence" and a.aggregation in ("token_mean", "seq_mean_token_sum",
                                                         "seq_mean_token_sum_norm"):  # fmt: skip
        warnings.warn(
            f"ratio_level='sequence' (GSPO) with aggregation={a.aggregation!r}: the sequence ratio "
            "is one number per sequence, and token-sum style aggregation weights it by length; "
            "GSPO uses seq_mean_token_mean",
            stacklevel=2,
        )
    if getattr(a, "kl_weighting", "none") == "importance" and (
        a.kl_mode != "loss" or a.kl_coef == 0 or a.ratio_level == "geometric"
    ):
        raise ValueError(
            "algorithm.kl_weighting='importance' weights the KL loss term by pi_theta/pi_old; it "
            "needs kl_mode='loss', kl_coef > 0 and ratio_level 'token' or 'sequence' (got "
            f"{a.kl_mode!r}, {a.kl_coef}, {a.ratio_level!r})"
        )
    if a.surrogate == "sapo" and a.aggregation != "seq_mean_token_mean":
        warnings.warn("SAPO is defined with seq_mean_token_mean aggregation", stacklevel=2)
    if a.reward_aggregation == "normalize_then_sum" and (a.advantage, a.scale) != ("grpo", "group"):
        raise ValueError(
            "reward_aggregation='normalize_then_sum' (GDPO) defines the whole advantage; it needs "
            f"advantage='grpo' and scale='group', got {a.advantage!r} / {a.scale!r}"
        )
    from grouprl.workloads import refuse_unsupported, workload_of  # imports the modalities

    refuse_unsupported(workload_of(cfg), cfg)  # options the workload cannot honour (one process)
    if a.advantage == "dr_grpo" and a.scale != "none":
        warnings.warn(
            "advantage='dr_grpo' never divides by the std; `scale` is ignored", stacklevel=2
        )
    if (cfg.agent.tools or cfg.agent.tool_format != "auto") and cfg.task.name != "env":
        raise ValueError(
            "agent.tools / agent.tool_format apply to multi-turn episodes (task.name: env); "
            f"task {cfg.task.name!r} samples single completions and would ignore them"
        )


# ---- loading ----------------------------------------------------------------------------------


# A config expanded (every alias replaced by a copy of its anchor) has at most this many nodes.
# Real configs have hundreds; a "billion laughs" alias bomb of 1 KB expands to ~10^9 and would
# hang whatever walks it (validation, overrides), so it is refused before anything walks it.
MAX_YAML_NODES = 100_000


class _YAML12Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans: only true/false, so option values such as `off` or
    `on` stay strings (PyYAML follows YAML 1.1, where off/on/yes/no are booleans); and a limit on
    the size of the document with its aliases expanded (MAX_YAML_NODES)."""

    def compose_document(self) -> Any:
        node = super().compose_document()
        _check_expanded_size(node)
        return node


def _check_expanded_size(root: Any) -> None:
    """Count the nodes of `root` as if every alias were expanded (shared nodes counted once per
    reference, computed once each: linear in the document's size); raise past MAX_YAML_NODES."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: Any) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise ConfigError("the YAML refers to itself through an alias (a recursive anchor)")
        open_nodes.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        open_nodes.discard(key)
        if total > MAX_YAML_NODES:
            raise ConfigError(
                f"the YAML expands to more than {MAX_YAML_NODES} values once its aliases (*name) "
                "are replaced by their anchors (&name): an alias bomb, or a config far larger "
                "than any real one; refused"
            )
        sizes[key] = total
        return total

    if root is not None:
        size(root)


_YAML12Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YAML12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _load_yaml(text: str, where: str = "the YAML text") -> Any:
    try:
        return yaml.load(text, Loader=_YAML12Loader)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except (yaml.YAMLError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        detail = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ConfigError(f"{where} is not valid YAML: {detail}") from None


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like dotted.key=value")
    key, value = item.split("=", 1)
    return key.strip().split("."), _load_yaml(value, f"override {item!r}") if value != "" else ""


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Set dotted keys (e.g. algorithm.preset=dapo, train.lr=1e-4) in the raw YAML mapping."""
    for item in overrides:
        path, value = _parse_override(item)
        node = raw
        for part in path[:-1]:
            if not isinstance(node.setdefault(part, {}), dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = node[part]
        node[path[-1]] = value
    return raw


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that owns the field at `loc` (to suggest the nearest valid key)."""
    model: Any = Config
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            return None
        ann = field.annotation
        args = [a for a in getattr(ann, "__args__", ()) if isinstance(a, type)]
        candidates = [ann, *args]
        model = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
        if model is None:
            return None
    return model


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        where = ".".join(str(p) for p in loc) or "<config>"
        if e["type"] == "extra_forbidden":
            owner = _model_at(loc)
            valid = list(owner.model_fields) if owner else []
            near = difflib.get_close_matches(str(loc[-1]), valid, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            lines.append(f"unknown key {where!r}{hint} (valid keys here: {', '.join(valid)})")
        elif e["type"] == "missing":
            lines.append(f"missing required key {where!r}")
        elif e["type"] == "value_error":  # our own validators: the message says it all
            lines.append(f"{where}: {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"{where}: {e['msg']} (got {e.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def validate(raw: dict) -> Config:
    """Raw mapping -> Config, turning pydantic's errors into one readable ConfigError. The mapping
    is remembered as what the user wrote (`user_settings`)."""
    written = copy.deepcopy(raw) if isinstance(raw, dict) else None
    try:
        cfg = Config.model_validate(raw)
        if written is not None:
            _USER_SETTINGS[id(cfg)] = written
            weakref.finalize(cfg, _USER_SETTINGS.pop, id(cfg), None)
        return cfg
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None
    except ValueError as err:  # a preset name or a combination check
        raise ConfigError(f"invalid config: {err}") from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a YAML config (or start empty with path None) and apply dotted overrides."""
    return validate(read_config(path, overrides))


def read_config(path: str | Path | None, overrides: list[str] = ()) -> dict:
    """The mapping a YAML config (or {} for path None) plus dotted overrides hold, not validated
    (the Python API completes it with the parts it was given as objects)."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({exc})") from None
        raw = _load_yaml(text, f"config file {str(path)!r}") or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return apply_overrides(raw, list(overrides))


def save_resolved(cfg: Config, path: Path, header: str = "") -> None:
    """Write the fully resolved config (every default and preset value spelled out)."""
    _write_yaml(path, config_json(cfg), header)


def config_json(cfg: Config, **kw: Any) -> dict:
    """cfg as JSON-able values; a Dataset object given from Python becomes its summary."""
    from grouprl.envs.tasks.records import dataset_summary

    return cfg.model_dump(mode="json", fallback=dataset_summary, **kw)


def _plain_value(value: Any) -> Any:
    from grouprl.envs.tasks.records import dataset_summary

    try:
        return dataset_summary(value)
    except TypeError:
        return str(value)


def _write_yaml(path: Path, data: dict, header: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(header + yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    tmp.replace(path)


# ---- what the user wrote, apart from what defaults and presets filled in ----------------------

_USER_SETTINGS: dict[int, dict] = {}  # id(Config) -> the mapping validate() was given
# per-invocation actions, not settings of the run: never written into a run's config.yaml
ACTION_KEYS = ("run.resume", "run.overwrite", "run.allow_config_change")


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}, "c": [1]} -> {"a.b": 1, "c": [1]} (lists are values, mappings are walked)."""
    if not isinstance(data, Mapping) or (prefix and not data):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _set_dotted(data: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        if not isinstance(data.get(part), dict):
            data[part] = {}
        data = data[part]
    data[last] = value


def user_settings(cfg: Config) -> dict:
    """What the user set: the mapping validate() was given, plus any field changed on the Config
    since (attribute assignment). A Config built another way: its explicitly set fields."""
    written = _USER_SETTINGS.get(id(cfg))
    if written is None:
        return config_json(cfg, exclude_unset=True)
    out = copy.deepcopy(written)
    with warnings.catch_warnings():  # the preset warnings were given when cfg was made
        warnings.simplefilter("ignore")
        baseline = flatten(config_json(Config.model_validate(copy.deepcopy(written))))
    for key, value in flatten(config_json(cfg)).items():
        if baseline.get(key, object()) != value:
            _set_dotted(out, key, value)
    # plain YAML types (tuples, paths from code; a Dataset object as its summary)
    return json.loads(json.dumps(out, default=_plain_value))


def save_run_config(cfg: Config, run_dir: Path) -> None:
    """config.yaml: what the user set (re-usable, e.g. with another preset); config.resolved.yaml:
    every value the run used (defaults and preset values spelled out); config.schema.json: the
    config's JSON schema (pydantic `model_json_schema()`)."""
    mine = user_settings(cfg)
    for key in ACTION_KEYS:
        section, field = key.split(".")
        if isinstance(mine.get(section), dict):
            mine[section].pop(field, None)
    _write_yaml(run_dir / "config.yaml", mine, "# the settings this run was started with (what "
                "the config file and overrides set; defaults and preset values are in "
                "config.resolved.yaml)\n")  # fmt: skip
    save_resolved(cfg, run_dir / "config.resolved.yaml", "# every value this run used\n")
    # the options' types, defaults, allowed values and descriptions, next to the values (editors
    # validate a YAML config against it; `grouprl config show` prints the same models as text)
    schema = run_dir / "config.schema.json"
    tmp = schema.with_suffix(".tmp")
    tmp.write_text(json.dumps(type(cfg).model_json_schema(), indent=2) + "\n", encoding="utf-8")
    tmp.replace(schema)
