"""The `env` task: multi-turn episodes in a text environment; its examples are environment seeds.

A group = G episodes started from the same seed. Train and held-out seeds never overlap: train seeds
are seed * 1_000_000 + i, held-out seeds seed * 1_000_000 + 900_000 + i.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grouprl.envs.tasks.base import TaskData, check_int


def build_env_task(
    env_id: str | Callable[..., Any],
    *,
    env_kwargs: dict[str, Any] | None = None,
    seed: int = 0,
    n_train: int = 10_000,
    n_eval: int = 64,
) -> TaskData:
    """Options: env_id (a registered id such as grouprl/FrozenLake-v0, "module:Class", or from
    Python an env factory: a callable returning a text env, envs/gym.make_text_env), env_kwargs (passed to the env constructor), seed, n_train / n_eval (numbers of start seeds)."""
    from grouprl.envs.gym import make_text_env

    check_int("n_train", n_train, minimum=1)
    check_int("n_eval", n_eval, minimum=0)
    if n_train > 900_000:
        raise ValueError("n_train must be <= 900000 (held-out seeds start after it)")
    kwargs = dict(env_kwargs or {})
    make_text_env(env_id, **kwargs).close()  # fail now, with the env's own message, if it is wrong
    base = seed * 1_000_000
    meta = {"env_id": env_id, "env_kwargs": kwargs}
    return TaskData(
        train=[{"seed": base + i, **meta} for i in range(n_train)],
        eval=[{"seed": base + 900_000 + i, **meta} for i in range(n_eval)],
        reward_fns={},  # rewards come from the environment
    )
