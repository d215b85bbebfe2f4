"""Typed run configuration: YAML file + dotted CLI overrides -> validated `Config`.

One pydantic model per component, a docstring (description) per field; unknown keys fail with the
nearest valid key, wrong values with the allowed ones; incompatible settings fail or warn with why.
The sections and their assembly are in this package, one module per section (root.py: `Config`);
older spellings are migrated with a warning first (migration.py). The `algorithm.preset` named in
config.presets fills every algorithm field the user left unset (and the fields of other sections
it names, when the config leaves them unset: a preset blocked by the config's own values warns,
naming the keys).

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
import typing
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from grouprl.config.migration import MigrationError, migrate
from grouprl.config.root import Config


class ConfigError(ValueError):
    """A config problem, with a message a person can act on."""


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


def load_yaml(text: str, where: str = "the YAML text") -> Any:
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
    return key.strip().split("."), load_yaml(value, f"override {item!r}") if value != "" else ""


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


def _model_at(loc: tuple) -> tuple[type[BaseModel] | None, tuple]:
    """The pydantic model that owns the field at `loc` (to suggest the nearest valid key), and
    `loc` without the tags pydantic inserts for discriminated unions (`surrogate.sapo.x`)."""
    model: Any = Config
    shown: list = []
    parts = list(loc[:-1])
    while parts:
        part = parts.pop(0)
        shown.append(part)
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            return None, loc
        ann = field.annotation
        args = [a for a in getattr(ann, "__args__", ()) if isinstance(a, type)]
        models = [c for c in [ann, *args] if isinstance(c, type) and issubclass(c, BaseModel)]
        tagged = {  # discriminated union: each member's `type` values
            tag: m
            for m in models
            if "type" in m.model_fields
            for tag in typing.get_args(m.model_fields["type"].annotation)
        }
        if len(models) > 1 and parts and parts[0] in tagged:  # discriminated union: the tag
            model = tagged[parts.pop(0)]
            continue
        model = models[0] if models else None
        if model is None:
            return None, loc
    return model, (*shown, loc[-1])


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        owner, shown = _model_at(loc) if loc else (None, loc)
        where = ".".join(str(p) for p in shown) or "<config>"
        if e["type"] == "extra_forbidden":
            valid = list(owner.model_fields) if owner else []
            if owner is not None and "type" in owner.model_fields and shown != loc:
                valid_for = f" of type {loc[len(shown) - 1]!r}"  # the tag pydantic inserted
            else:
                valid_for = ""
            near = difflib.get_close_matches(str(loc[-1]), valid, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            lines.append(
                f"unknown key {where!r}{hint} (valid keys here{valid_for}: {', '.join(valid)})"
            )
        elif e["type"] == "missing":
            lines.append(f"missing required key {where!r}")
        elif e["type"] == "value_error":  # our own validators: the message says it all
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(msg if not loc else f"{where}: {msg}")
        else:
            lines.append(f"{where}: {e['msg']} (got {e.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def validate(raw: dict) -> Config:
    """Raw mapping -> Config, turning pydantic's errors into one readable ConfigError. The mapping
    is remembered as what the user wrote (`user_settings`)."""
    try:
        raw = migrate(raw)  # older spellings, each with a warning naming the new one
        written = copy.deepcopy(raw) if isinstance(raw, dict) else None
        cfg = Config.model_validate(raw)
        if written is not None:
            _USER_SETTINGS[id(cfg)] = written
            weakref.finalize(cfg, _USER_SETTINGS.pop, id(cfg), None)
        return cfg
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None
    except (ValueError, MigrationError) as err:  # a preset name or a combination check
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
        raw = load_yaml(text, f"config file {str(path)!r}") or {}
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
