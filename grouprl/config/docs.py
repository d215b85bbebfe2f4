"""The config explains itself: every option read from the pydantic models, as text and as tables.

`options(model)` walks a model's fields (nested sections, lists of sections, discriminated unions
with each variant's own fields) into flat `Option` rows: dotted key, type, allowed values, default,
description. `grouprl config show [SECTION]` prints them (`show_text`), `grouprl train --help`
lists them (`help_listing`), and README.md's option tables are generated from them between marker
comments:

    <!-- options-overview -->  ...  <!-- /options -->     one row per section
    <!-- options:SECTION -->    ...  <!-- /options -->     every field of SECTION (dotted: rollout.vllm)
    <!-- options-rest -->      ...  <!-- /options -->     a collapsed table per other section
A block may also name the own section of a registered workload that is not a field of Config
(`<!-- options:gateway -->`): its table comes from that workload's settings model.

`python -m grouprl.config.docs --write README.md` rewrites those blocks; `--check README.md` exits
1 when they differ from the models (tests/test_config_docs.py runs the same comparison).
"""

from __future__ import annotations

import argparse
import enum
import json
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


@dataclass(frozen=True)
class Option:
    """One config field, flattened. `key` is dotted ("rollout.vllm.sleep"; a list of sections:
    "rewards[].name"); `when` names the variant a field belongs to ("algorithm.surrogate.type=clip")
    or is empty; `allowed` holds the choices of a Literal / enum / discriminated union."""

    key: str
    type: str
    default: str
    allowed: tuple[str, ...]
    description: str
    when: str = ""
    section: bool = False  # a nested model (its fields follow as their own rows)


# ---- reading the models ------------------------------------------------------------------------


def _strip_none(ann: Any) -> tuple[Any, bool]:
    """(annotation without None, whether None was allowed)."""
    if typing.get_origin(ann) in (Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        optional = len(args) < len(typing.get_args(ann))
        if len(args) == 1:
            return args[0], optional
        return Union[tuple(args)], optional  # noqa: UP007  (a runtime-built union)
    return ann, False


def _unwrap_annotated(ann: Any) -> Any:
    while typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    return ann


def _is_model(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def _model_variants(ann: Any) -> list[type[BaseModel]]:
    """The models of a union of models (empty when `ann` is not one)."""
    ann = _unwrap_annotated(ann)
    if typing.get_origin(ann) not in (Union, types.UnionType):
        return []
    args = [_unwrap_annotated(a) for a in typing.get_args(ann) if a is not type(None)]
    return args if args and all(_is_model(a) for a in args) else []


def _literal_values(ann: Any) -> tuple[str, ...]:
    ann = _unwrap_annotated(ann)
    if typing.get_origin(ann) is Literal:
        return tuple(str(v) for v in typing.get_args(ann))
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return tuple(str(m.value) for m in ann)
    return ()


def _type_name(ann: Any) -> str:
    ann = _unwrap_annotated(ann)
    if ann is Any:
        return "any"
    if ann is type(None):
        return "null"
    if _literal_values(ann):
        return "choice"
    if _is_model(ann):
        return "section"
    origin = typing.get_origin(ann)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(ann))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(ann))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(ann, "__name__", str(ann))


_BOUNDS = {
    annotated_types.Ge: (">=", "ge"),
    annotated_types.Gt: (">", "gt"),
    annotated_types.Le: ("<=", "le"),
    annotated_types.Lt: ("<", "lt"),
}


def _bounds(field: FieldInfo) -> str:
    parts = []
    for meta in field.metadata:
        for kind, (sign, attr) in _BOUNDS.items():
            if isinstance(meta, kind):
                parts.append(f"{sign} {getattr(meta, attr)}")
    return ", ".join(parts)


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    try:
        return json.dumps(_plain(value))
    except TypeError:
        return str(value)


def _section_default(field: FieldInfo, discriminator: str | None = None) -> str:
    """A nested section's default, short: its fields' own defaults follow as rows."""
    if field.default_factory is None and field.default is PydanticUndefined:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        tag = _variant_tag(type(value), discriminator)
        return f"{{{discriminator}: {tag}}}" if discriminator else "{...}"
    return json.dumps(_plain(value))


def _discriminator(field: FieldInfo, ann: Any, variants: list[type[BaseModel]]) -> str | None:
    """The field naming a union's variant: the Field's discriminator (on the field or inside an
    Annotated union), else a Literal field every variant has ("type")."""
    if isinstance(field.discriminator, str):
        return field.discriminator
    for meta in typing.get_args(ann)[1:] if typing.get_origin(ann) is typing.Annotated else ():
        if isinstance(getattr(meta, "discriminator", None), str):
            return meta.discriminator
    for name in variants[0].model_fields if variants else ():
        if all(name in v.model_fields and _literal_values(v.model_fields[name].annotation)
               for v in variants):  # fmt: skip
            return name
    return None


def _variant_tag(model: type[BaseModel], discriminator: str | None) -> str:
    """The value that selects `model` in its union (its discriminator's Literal), else its name."""
    if discriminator and discriminator in model.model_fields:
        values = _literal_values(model.model_fields[discriminator].annotation)
        if values:
            return "/".join(values)
    return model.__name__


def options(model: type[BaseModel], prefix: str = "", when: str = "") -> list[Option]:
    """Every field of `model` and of its nested sections, in declaration order."""
    rows: list[Option] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        description = " ".join((field.description or "").split())
        ann, optional = _strip_none(field.annotation)
        variants = _model_variants(ann)
        inner = _unwrap_annotated(ann)
        item = typing.get_args(inner)[0] if typing.get_origin(inner) is list else None
        if item is not None and _model_variants(item):  # a list of a union of sections
            variants, ann, key = _model_variants(item), item, key + "[]"
        discriminator = _discriminator(field, ann, variants)
        if variants:
            tags = tuple(_variant_tag(v, discriminator) for v in variants)
            choices = tuple(value for tag in tags for value in tag.split("/"))
            by = f", chosen by {key}.{discriminator}" if discriminator else ""
            rows.append(
                Option(
                    key,
                    "one of the variants below" + by + (" or null" if optional else ""),
                    _section_default(field, discriminator),
                    choices,
                    description,
                    when,
                    section=True,
                )
            )
            for variant, tag in zip(variants, tags, strict=True):
                sub = f"{key}.{discriminator}={tag}" if discriminator else f"{key}={tag}"
                rows += options(variant, key, sub)
        elif _is_model(inner):
            kind = "section" + (" or null" if optional else "")
            description = description or _doc_line(inner)
            rows.append(
                Option(key, kind, _section_default(field), (), description, when, section=True)
            )
            rows += options(inner, key, when)
        elif item is not None and _is_model(_unwrap_annotated(item)):
            rows.append(
                Option(
                    key, "list of sections", _default(field), (), description, when, section=True
                )
            )
            rows += options(_unwrap_annotated(item), key + "[]", when)
        else:
            allowed = _literal_values(inner)
            if typing.get_origin(inner) is list and not allowed:
                allowed = _literal_values(typing.get_args(inner)[0])
            kind = _type_name(inner) + (" | null" if optional else "")
            if allowed and kind.startswith("list["):
                kind = "list[choice]" + (" | null" if optional else "")
            bounds = _bounds(field)
            if bounds:
                kind += f" ({bounds})"
            rows.append(Option(key, kind, _default(field), allowed, description, when))
    return rows


def _doc_line(obj: Any) -> str:
    """First line of an object's own docstring ("" without one)."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    return (doc or "").strip().splitlines()[0].strip() if (doc or "").strip() else ""


def config_model() -> type[BaseModel]:
    from grouprl.config.loading import Config

    return Config


def section_names(model: type[BaseModel] | None = None) -> list[str]:
    """Dotted names `config show` accepts as a section: the top-level fields and every nested
    section (model, list of models, union of models)."""
    rows = options(model or config_model())
    top = [r.key for r in rows if "." not in r.key and "[]" not in r.key]
    nested = [r.key for r in rows if r.section and r.key not in top]
    return list(dict.fromkeys(top + nested))  # variants may share a nested section's key


def select(section: str | None, model: type[BaseModel] | None = None) -> list[Option]:
    """The rows of one section (dotted), all rows for None; ValueError naming the valid ones."""
    rows = options(model or config_model())
    if not section:
        return rows
    section = section.strip().rstrip(".")
    inside = (section + ".", section + "[]")
    picked = [r for r in rows if r.key == section or r.key.startswith(inside)]
    if not picked:
        raise ValueError(
            f"unknown config section {section!r}; valid sections: "
            + ", ".join(section_names(model))
        )
    return picked


# ---- text for the terminal -----------------------------------------------------------------------


def _kind(row: Option, sep: str = " | ", quote: str = "") -> str:
    """A row's type in words: its choices where it has them ("a | b | null"), else its type."""
    if not row.allowed:
        return row.type
    choices = sep.join(f"{quote}{a}{quote}" for a in row.allowed)
    if row.section:  # a union of sections: its variants
        return f"{row.type}: {choices}"
    nullable = f"{sep}null" if "| null" in row.type else ""
    if row.type.startswith("list["):
        return f"list of ({choices}){nullable}"
    return choices + nullable


def _header(row: Option) -> str:
    when = f"  [{row.when}]" if row.when else ""
    return f"{row.key}: {_kind(row)} = {row.default}{when}"


def show_text(section: str | None = None, width: int = 100) -> str:
    """`grouprl config show [SECTION]`: one header line per field (key: type = default), its
    description indented under it. SECTION may be a registered workload's own section (gateway)."""
    out = []
    outside = workload_section_model(section.strip().rstrip(".")) if section else None
    for row in select(section, outside):
        out.append(_header(row))
        if row.description:
            out += textwrap.wrap(
                row.description, width, initial_indent="    ", subsequent_indent="    "
            )
    return "\n".join(out) + "\n"


def help_listing() -> str:
    """`grouprl train --help` epilog: every dotted key with its type and default, one per line."""
    rows = [r for r in options(config_model()) if not r.section]
    width = max(len(r.key) for r in rows) + 2
    lines = ["options (dotted.key=value overrides; `grouprl config show SECTION` describes each):"]
    for r in rows:
        when = f"  [{r.when}]" if r.when else ""
        lines.append(f"  {r.key.ljust(width)}{_kind(r)} = {r.default}{when}")
    return "\n".join(lines)


# ---- README tables -------------------------------------------------------------------------------

_BLOCK = re.compile(
    r"(<!-- options(?::(?P<section>[\w.\[\]]+)|-(?P<kind>overview|rest)) -->\n)(?P<body>.*?)"
    r"(<!-- /options -->)",
    re.S,
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _md_type(row: Option) -> str:
    return _cell(_kind(row, " / ", "`")) if row.allowed else f"`{_cell(row.type)}`"


def table(section: str, model: type[BaseModel] | None = None) -> str:
    """Markdown table of one section's fields (keys relative to the section)."""
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for row in select(section, model):
        if row.key == section and row.type.startswith("section"):
            continue  # the table is the section: its own row would say only "section"
        key = row.key[len(section) :].removeprefix(".") or row.key  # rewards[].name -> [].name
        where = f" (with `{row.when}`)" if row.when else ""
        lines.append(
            f"| `{_cell(key)}`{where} | {_md_type(row)} | `{_cell(row.default)}` | "
            f"{_cell(row.description)} |"
        )
    return "\n".join(lines) + "\n"


def overview(model: type[BaseModel] | None = None) -> str:
    """Markdown table: one row per top-level section with its description and field names."""
    model = model or config_model()
    lines = ["| section | description | fields |", "|---|---|---|"]
    for name in model.model_fields:
        own = select(name, model)
        rows = [r for r in own if r.key != name and not r.when]
        rel = [r.key[len(name) :].removeprefix("[]").removeprefix(".") for r in rows]
        names = ", ".join(f"`{k}`" for k in rel if "." not in k)
        if own[0].allowed and own[0].section:  # a union: its variants, each with its own fields
            names = "variants " + ", ".join(f"`{a}`" for a in own[0].allowed)
        lines.append(f"| `{name}` | {_cell(own[0].description)} | {names} |")
    return "\n".join(lines) + "\n"


def rest(skip: set[str], model: type[BaseModel] | None = None) -> str:
    """One collapsed table per top-level section not in `skip` (those with a block of their own),
    so a section added to the config gets its table from the regeneration alone."""
    model = model or config_model()
    out = []
    for name in model.model_fields:
        if name not in skip:
            out.append(f"<details><summary><code>{name}</code></summary>\n\n{table(name, model)}"
                       "\n</details>\n")  # fmt: skip
    return "".join(out)


def workload_section_model(section: str) -> type[BaseModel] | None:
    """A model whose one field is `section`, when `section` is the own section of a registered
    workload that is not a field of Config (`gateway:`), so its table renders like the others;
    None otherwise."""
    from pydantic import create_model

    from grouprl.config.workload import registered_workloads
    from grouprl.config.workload import section_name as workload_section

    if section in config_model().model_fields:
        return None
    for name, cls in registered_workloads().items():
        if workload_section(name) == section and cls.settings is not None:
            return create_model(f"{name}_section", **{section: (cls.settings, ...)})
    return None


def render(text: str, model: type[BaseModel] | None = None) -> str:
    """`text` with every options block regenerated from the models (a block naming a registered
    workload's own section, as options:gateway, from that workload's settings)."""
    own = {m.group("section") for m in _BLOCK.finditer(text) if m.group("section")}

    def block(m: re.Match) -> str:
        if m.group("kind") == "overview":
            body = overview(model)
        elif m.group("kind") == "rest":
            body = rest(own, model)
        else:
            section = m.group("section")
            outside = workload_section_model(section) if model is None else None
            body = table(section, outside or model)
        return m.group(1) + body + m.group(5)

    return _BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m grouprl.config.docs",
        description="Regenerate (--write) or check (--check) the option tables of a Markdown file.",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="FILE", help="rewrite FILE's options blocks in place")
    mode.add_argument("--check", metavar="FILE", help="exit 1 when FILE's tables are out of date")
    args = parser.parse_args(argv)
    path = Path(args.write or args.check)
    text = path.read_text(encoding="utf-8")
    new = render(text)
    if args.check:
        if new != text:
            print(
                f"{path}: option tables are out of date; run python -m grouprl.config.docs "
                f"--write {path}",
                file=sys.stderr,
            )
            return 1
        return 0
    if new != text:
        path.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
