"""The `rewards:` list: one entry per reward function, with weight, options and deadline."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from grouprl.config.section import Section


class RewardConfig(Section):
    name: str = Field(
        ...,
        description="Built-in reward name or 'module:function' / 'file.py:fn'; a name of one of "
        "the task's rewards (e.g. accuracy) without options means the task's own function.",
    )
    weight: float = Field(1.0, description="Weight in the combined reward.")
    options: dict[str, Any] = Field(default_factory=dict, description="Reward factory options.")
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="Deadline of one sample's reward call; set, the function runs one sample at a "
        "time in a worker (grouprl.runtime.reward_guard) and a hanging / raising sample gets NaN.",
    )
    isolation: Literal["process", "thread"] = Field(
        "process",
        description="With timeout_s: 'process' (forked workers, killed at the deadline) or "
        "'thread' (for CUDA reward models; a late call is abandoned, not stopped).",
    )
    workers: int = Field(1, ge=1, description="With timeout_s: samples scored in parallel.")
    max_failed_steps: int = Field(
        3,
        ge=1,
        description="A step where this reward fails on every sample prints a warning with its "
        "first error; after this many such steps in a row the run stops with an error.",
    )
