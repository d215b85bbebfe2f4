"""Conformance checks for text envs (the contract in the docstring of envs/gym.py).

`system_prompt_of(env)` reads the env's system_prompt through gymnasium wrappers and fails loudly
when there is none or it is not a str (make_text_env calls it on every env it builds).
`check_text_env` raises AssertionError naming the first broken rule. It checks a Text observation
space and a non-empty system_prompt; str observations inside the space; reset determinism per seed
(same observation and anchor after resetting with another seed in between); that an invalid text
gives valid_action False, reward 0 and no move; the step contract (types, a hashable info["anchor"],
a bool info["success"] at the end, valid_action matching the text) on seeded episodes mixing valid
and invalid texts, each replayed twice for determinism; then gymnasium's own `check_env`.
GiGPO (arXiv 2505.10978) needs the exact, hashable anchors and the shared start states checked here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces
from gymnasium.utils.env_checker import check_env


def system_prompt_of(env: gymnasium.Env) -> str:
    """The env's `system_prompt`, looked up through gymnasium wrappers; fails loudly when absent."""
    try:
        prompt = env.get_wrapper_attr("system_prompt")
    except AttributeError as e:
        raise AttributeError(
            f"text env {type(env.unwrapped).__name__} has no `system_prompt` (str): define the task "
            "instructions shown to the agent once at the start"
        ) from e
    if not isinstance(prompt, str):
        raise TypeError(f"system_prompt must be str, got {type(prompt).__name__}")
    return prompt


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(f"text env check failed: {msg}")


def _check_info(info: Any, where: str) -> None:
    _require(isinstance(info, dict), f"{where}: info must be a dict, got {type(info).__name__}")
    if "anchor" in info:
        try:
            hash(info["anchor"])
        except TypeError:
            _require(
                False, f"{where}: info['anchor'] must be hashable, got {info['anchor']!r:.100}"
            )


def _episode(
    env: gymnasium.Env, seed: int, texts: Sequence[str], n_valid: int, max_steps: int
) -> list[tuple]:
    """Play `texts` (the first `n_valid` valid) in a seeded random order from reset(seed)."""
    rng = np.random.default_rng(seed)
    obs, info = env.reset(seed=seed)
    log: list[tuple] = [(obs, info.get("anchor"))]
    for t in range(max_steps):
        where = f"seed {seed} step {t}"
        i = int(rng.integers(len(texts)))
        obs, reward, term, trunc, info = env.step(texts[i])
        _require(
            isinstance(obs, str) and obs in env.observation_space, f"{where}: obs {obs!r:.100}"
        )
        _require(
            isinstance(reward, int | float) and math.isfinite(reward), f"{where}: reward {reward!r}"
        )
        _require(type(term) is bool and type(trunc) is bool, f"{where}: flags must be bool")
        _check_info(info, where)
        _require(
            info.get("valid_action") is (i < n_valid),
            f"{where}: {texts[i]!r} gave valid_action={info.get('valid_action')!r}",
        )
        if term or trunc:
            _require(type(info.get("success")) is bool, f"{where}: info['success'] missing at end")
        log.append((obs, float(reward), term, trunc, info["valid_action"], info.get("anchor")))
        if term or trunc:
            break
    return log


def check_text_env(
    env: gymnasium.Env,
    seeds: Sequence[int] = (0, 1, 2),
    *,
    actions: Sequence[str] | None = None,
    invalid_actions: Sequence[str] = ("I am not sure what to do.", "<action>fly</action>"),
    max_steps: int = 30,
    gymnasium_check: bool = True,
) -> None:
    """Conformance checks for a text env; raises AssertionError naming the first broken rule.

    actions: valid action texts (default: `<action>name</action>` for each `env.action_names`).
    Checks: Text observation space and a system_prompt; str observations inside the space; reset
    determinism per seed (same obs and anchor after resetting with another seed in between); an
    invalid text gives valid_action False, reward 0, no move (same obs and anchor); the step
    contract (types, info keys, success at the end) on seeded episodes that mix valid and invalid
    texts, replayed twice for determinism; then gymnasium's own `check_env` on the unwrapped env.
    """
    _require(isinstance(env.observation_space, spaces.Text), "observation_space must be Text")
    _require(bool(system_prompt_of(env).strip()), "system_prompt is empty")
    if actions is None:
        try:
            names = env.get_wrapper_attr("action_names")
        except AttributeError:
            names = []
        actions = [f"<action>{n}</action>" for n in names]
    for seed in seeds:
        obs, info = env.reset(seed=seed)
        _require(isinstance(obs, str) and obs in env.observation_space, f"reset obs {obs!r:.100}")
        _check_info(info, f"reset(seed={seed})")
        env.reset(seed=seed + 1)
        obs2, info2 = env.reset(seed=seed)
        _require(obs2 == obs, f"reset(seed={seed}) is not deterministic: {obs!r} vs {obs2!r}")
        _require(info2.get("anchor") == info.get("anchor"), f"seed {seed}: anchor differs")
        for bad in invalid_actions:
            obs3, reward, term, _, info3 = env.step(bad)
            _require(info3.get("valid_action") is False, f"{bad!r} must give valid_action False")
            _require(reward == 0 and not term, f"{bad!r} must give reward 0 and not terminate")
            _require(obs3 == obs and info3.get("anchor") == info.get("anchor"), f"{bad!r} moved")
        texts = [*actions, *invalid_actions]
        first = _episode(env, seed, texts, len(actions), max_steps)
        again = _episode(env, seed, texts, len(actions), max_steps)
        _require(first == again, f"seed {seed}: the same seed and texts gave another episode")
    if gymnasium_check:
        check_env(env.unwrapped, skip_close_check=False)
