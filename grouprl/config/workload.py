"""The `workload:` section: which workload (modality) runs, and where its own config section is.

`workload: {type: NAME}` names a class of grouprl.workloads.base.WORKLOADS (a workload registered
from outside grouprl counts as well). The workload's `settings` model, when it has one, validates
its own top-level section: `agent:` for agent, `diffusion:` for images (the names older configs
used), `NAME:` for any other workload. A config carries only its workload's section; another
workload's section is an error naming it. The registry is imported when a config is validated
(importing grouprl.workloads registers text / agent / images).
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any

from pydantic import BaseModel, Field

from grouprl.config.section import Section

# the sections whose name is not the workload's (kept from older configs)
SECTION_NAMES = {"images": "diffusion"}
# sections of built-in workloads that are fields of Config (None when another workload runs)
BUILTIN_SECTIONS = ("agent", "diffusion")


class WorkloadConfig(Section):
    type: str = Field(
        "text",
        description="The workload (grouprl.workloads.WORKLOADS): text (single completions), agent "
        "(multi-turn episodes; section agent:), gateway (agent programs through an OpenAI-compatible "
        "server; section gateway:), images (diffusion / flow policies; section "
        "diffusion:), or a workload registered by the user (section named after it).",
    )


def registered_workloads() -> dict[str, type]:
    """WORKLOADS, imported on first use (importing grouprl.workloads registers the built-ins)."""
    importlib.import_module("grouprl.workloads")
    from grouprl.workloads.base import WORKLOADS

    return WORKLOADS


def section_name(workload: str) -> str:
    return SECTION_NAMES.get(workload, workload)


def workload_settings_model(workload: str) -> type[BaseModel] | None:
    """The settings model of a workload (None: it has no section); unknown names raise, naming
    the known ones."""
    registry = registered_workloads()
    if workload in registry:
        return registry[workload].settings
    known = sorted(registry)
    close = difflib.get_close_matches(str(workload), known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown workload {workload!r}: known are {', '.join(known)}{hint}")


def split_sections(data: dict) -> tuple[dict, str | None, Any]:
    """The raw config without the workload's own section when that is not a Config field, that
    section's key and its raw value; another workload's section is an error naming it."""
    workload = data.get("workload")
    name = workload.get("type", "text") if isinstance(workload, dict) else "text"
    if not isinstance(name, str):
        raise ValueError(f"workload.type must be a workload name, got {name!r}")
    model = workload_settings_model(name)
    own = section_name(name) if model is not None else None
    for key in BUILTIN_SECTIONS:
        if key in data and key != own and data[key] is not None:
            owner = next(w for w in (*SECTION_NAMES, "agent") if section_name(w) == key)
            keys = list(data[key]) if isinstance(data[key], dict) else []
            named = f" ({', '.join(f'{key}.{k}' for k in keys)})" if keys else ""
            raise ValueError(
                f"section {key!r}{named} applies to workload {owner!r} only; this config's "
                f"workload is {name!r} (remove `{key}:`, or set workload: {{type: {owner}}})"
            )
    if own is None or own in BUILTIN_SECTIONS:
        data = dict(data)
        if own is not None:
            if data.get(own) is None:
                data[own] = {}
        return data, None, None
    data = dict(data)
    return data, own, data.pop(own, {})
