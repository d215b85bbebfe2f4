"""Tasks (single-turn datasets, and `env` for multi-turn episodes): a registry of factories, `build_task(name, **options) -> TaskData`.

A task is examples (dicts with "prompt" and the task's columns) plus reward functions. Options come
from the config's `task:` section; each factory's docstring lists them. A new task is a factory
function plus one line in TASKS.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grouprl.envs.rewards.loading import call_with_options
from grouprl.envs.tasks.arithmetic import build_arithmetic
from grouprl.envs.tasks.base import RewardFn, TaskData
from grouprl.envs.tasks.code import build_code
from grouprl.envs.tasks.countdown import build_countdown
from grouprl.envs.tasks.env_seeds import build_env_task
from grouprl.envs.tasks.images import build_image_prompts
from grouprl.envs.tasks.math import build_math
from grouprl.envs.tasks.prompts import build_prompts
from grouprl.envs.tasks.visual_shapes import build_visual_shapes
from grouprl.envs.tasks.vqa import build_vqa

TASKS: dict[str, Callable[..., TaskData]] = {
    "arithmetic": build_arithmetic,
    "countdown": build_countdown,
    "math": build_math,
    "env": build_env_task,
    "image_prompts": build_image_prompts,
    "code": build_code,
    "prompts": build_prompts,  # prompt-only datasets for model-based / user rewards
    "visual_shapes": build_visual_shapes,  # questions about rendered shapes (images in prompts)
    "vqa": build_vqa,  # visual question answering from datasets with image columns
}


def build_task(name: str, **options: Any) -> TaskData:
    """Build the registered task `name` with `options` (unknown names / options fail clearly)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; registered tasks: {list(TASKS)}")
    return call_with_options(TASKS[name], options, f"task {name!r}")


__all__ = ["TASKS", "RewardFn", "TaskData", "build_task"]
