"""Reward functions: the built-in registry, user functions ("module:function") and batched scoring.

`build_reward(name, **options)` returns a batched reward function
`fn(completions, **columns) -> list[float | None]`; see `loading` for the calling protocol.
Image rewards take the images in place of the completions: `fn(images, prompts=None, **columns)`
(`image.py` for the accepted image forms). Several rewards combine with per-reward weights; with
`algorithm.reward_aggregation: normalize_then_sum` (GDPO) each reward is z-scored within its group
before the weighted sum, which puts rewards of different scales (JPEG kB, CLIP x100, aesthetic 1..10)
on one footing, for images as for text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grouprl.envs.rewards.code import code_reward
from grouprl.envs.rewards.http_reward import http_reward
from grouprl.envs.rewards.image import color_target, jpeg_compressibility, jpeg_incompressibility
from grouprl.envs.rewards.image_models import aesthetic, clip_score, hpsv2, pickscore
from grouprl.envs.rewards.image_reward import image_reward
from grouprl.envs.rewards.llm_judge import llm_judge
from grouprl.envs.rewards.loading import (
    RewardFn,
    call_with_options,
    load_reward_fn,
    score_completions,
)
from grouprl.envs.rewards.reward_model import reward_model
from grouprl.envs.rewards.shapes import color_area
from grouprl.envs.rewards.text import accuracy_reward, format_reward, length_reward, overlong_reward

REWARDS: dict[str, Callable[..., RewardFn]] = {
    "accuracy": accuracy_reward,
    "format": format_reward,
    "overlong": overlong_reward,
    "length": length_reward,
    "code": code_reward,  # runs completions against tests in the sandbox
    # image rewards: fn(images, prompts=None, **columns); see envs/rewards/image.py
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
    "color_target": color_target,
    "clip_score": clip_score,
    "pickscore": pickscore,
    "aesthetic": aesthetic,
    "hpsv2": hpsv2,  # from the folder `grouprl convert hpsv2` writes
    "image_reward": image_reward,  # from the folder `grouprl convert image_reward` writes
    "color_area": color_area,  # the shapes demo's prompt-colour area (envs/rewards/shapes.py)
    # model-based text rewards (reward_model.py, llm_judge.py, http_reward.py)
    "reward_model": reward_model,
    "llm_judge": llm_judge,
    "http": http_reward,  # remote: scored while the next rollout chunk generates
}


def register_reward(name: str, factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
    """Add a built-in reward factory under `name` (taken once): for rewards built on modules
    envs/ may not import, e.g. vlm_judge on the VLM policy class (grouprl/policies/vision/judge.py,
    registered when grouprl.workloads is imported)."""
    if name in REWARDS and REWARDS[name] is not factory:
        raise ValueError(f"reward {name!r} is registered already ({REWARDS[name].__module__})")
    REWARDS[name] = factory
    return factory


def build_reward(name: str, **options: Any) -> RewardFn:
    """A built-in reward by registry name, or a user function given as "module:function"."""
    if name in REWARDS:
        return call_with_options(REWARDS[name], options, f"reward {name!r}")
    if ":" in name:
        if options:
            raise ValueError(
                f"user reward function {name!r} takes no options, got {sorted(options)}"
            )
        return load_reward_fn(name)
    raise ValueError(
        f"unknown reward {name!r}; built-ins: {list(REWARDS)}, or a user function "
        "'package.module:function' / 'path/to/file.py:function'"
    )


__all__ = [
    "REWARDS",
    "RewardFn",
    "accuracy_reward",
    "aesthetic",
    "clip_score",
    "color_target",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "pickscore",
    "build_reward",
    "register_reward",
    "code_reward",
    "format_reward",
    "length_reward",
    "load_reward_fn",
    "overlong_reward",
    "score_completions",
]
