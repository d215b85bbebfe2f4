"""The `task:` section: a registered task by name (grouprl.envs.tasks.TASKS) with typed options.

Each task's options are a pydantic model read off its factory's signature (names, types, defaults)
and docstring (a line `name: text` or `name, other: text` describes them), so the factory stays the
one source. The options are validated with the config: an unknown option is an error naming the
allowed ones, a value of the wrong type an error naming the option; the validated values are the
ones written (strict types: no silent conversion, the factory gets what the config said).
"""

from __future__ import annotations

import difflib
import inspect
import re
import typing
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from grouprl.config.section import Section


class TaskConfig(Section):
    name: str = Field(
        ...,
        description="Task registry name (grouprl.envs.tasks.TASKS: arithmetic, countdown, math, "
        "code, prompts, image_prompts, env).",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="The task factory's options, typed per task (`grouprl config show task` lists "
        "them; each factory's docstring explains them).",
    )

    @model_validator(mode="after")
    def _typed_options(self) -> TaskConfig:
        check_task_options(self.name, self.options)
        return self


def _described(doc: str) -> dict[str, str]:
    """`name: text` / `name, other: text` lines of a factory docstring -> {name: text}."""
    out: dict[str, str] = {}
    for line in inspect.cleandoc(doc or "").splitlines():
        m = re.match(r"^\s*([a-z_][a-z0-9_]*(?:\s*,\s*[a-z_][a-z0-9_]*)*)\s*:\s+(.+)$", line)
        if m:
            for name in re.split(r"\s*,\s*", m.group(1)):
                out.setdefault(name, m.group(2).strip())
    return out


@cache
def task_options_model(name: str) -> type[BaseModel]:
    """The options model of task `name` (unknown names raise, naming the registered tasks)."""
    from grouprl.envs.tasks import TASKS

    if name not in TASKS:
        close = difflib.get_close_matches(str(name), list(TASKS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown task {name!r}: registered tasks are {', '.join(TASKS)}{hint}")
    factory = TASKS[name]
    hints = typing.get_type_hints(factory)
    described = _described(factory.__doc__ or "")
    fields: dict[str, Any] = {}
    for p in inspect.signature(factory).parameters.values():
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            continue
        default = ... if p.default is p.empty else p.default
        text = described.get(p.name, f"see {factory.__module__}.{factory.__name__}")
        fields[p.name] = (hints.get(p.name, Any), Field(default, description=text))
    return create_model(
        f"{name.title().replace('_', '')}TaskOptions",
        __config__=ConfigDict(extra="forbid", strict=True, arbitrary_types_allowed=True),
        __doc__=f"Options of task {name!r} ({factory.__module__}.{factory.__name__}).",
        **fields,
    )


def check_task_options(name: str, options: dict[str, Any]) -> None:
    """Validate `options` against task `name`'s model; errors name the option and the allowed."""
    model = task_options_model(name)
    try:
        model.model_validate(options)
    except ValidationError as err:
        allowed = ", ".join(model.model_fields)
        problems = []
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"])
            if e["type"] == "extra_forbidden":
                near = difflib.get_close_matches(where, list(model.model_fields), n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                problems.append(f"unknown option {where!r}{hint}")
            elif e["type"] == "missing":
                problems.append(f"missing required option {where!r}")
            else:
                problems.append(f"option {where!r}: {e['msg']} (got {e.get('input')!r})")
        raise ValueError(
            f"task {name!r}: " + "; ".join(problems) + f"; the options of {name!r} are: {allowed}"
        ) from None
