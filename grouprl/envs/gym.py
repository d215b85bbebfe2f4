"""Gymnasium adapters for text agents: registration, `make_text_env`, `TextEnvWrapper`.

The conformance checks (`check_text_env`, `system_prompt_of`) are in envs/checks.py.

A *text env* is a `gymnasium.Env` whose observations and actions are `str`:
  reset(seed=None, options=None) -> (obs, info)
  step(action_text)              -> (obs, reward, terminated, truncated, info)
with `observation_space = spaces.Text(...)` and a `system_prompt: str` (task instructions shown once).
Info keys the multi-turn rollout reads:
  "valid_action" (bool, every step): False when the text held no usable action; the env then does
                 not move and returns reward 0 (the rollout adds the invalid-action penalty);
  "anchor"       (hashable): exact state key for GiGPO step groups (arXiv 2505.10978);
  "success"      (bool, every step): True once the task is solved.
Same seed -> same start state, so a group of G episodes reset with one seed share their start.

Facts from the gymnasium 1.x source that shape this module:
  - `spaces.Text` defaults to an alphanumeric charset, so text spaces here use `string.printable`;
  - wrappers no longer forward unknown attributes, so our ids are registered without the
    order-enforcing wrapper and `make_text_env` skips the passive checker: it returns the env
    itself, whose `system_prompt` / `action_names` can be read directly. `gymnasium.make` on the
    same ids still works (with the passive checker).
"""

from __future__ import annotations

import importlib
import inspect
import string
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import gymnasium
from gymnasium import spaces

from grouprl.envs.checks import check_text_env, system_prompt_of  # noqa: F401  (re-exported)
from grouprl.envs.tools.calls import parse_action

TEXT_CHARSET = string.printable
MAX_ACTION_CHARS = (
    8192  # bound of the action Text space (sampling/contains only; step takes any str)
)
ENV_IDS: dict[str, str] = {
    "grouprl/FrozenLake-v0": "grouprl.envs.frozenlake:TextFrozenLakeEnv",
    "grouprl/Sokoban-v0": "grouprl.envs.sokoban:TextSokobanEnv",
    # a string entry point is imported only by gymnasium.make, so a missing file breaks nothing here
    "grouprl/ToolMath-v0": "grouprl.envs.toolmath:ToolMathEnv",
}


def register_envs() -> None:
    """Register the shipped text envs with gymnasium (idempotent; runs on import of this module)."""
    for env_id, entry_point in ENV_IDS.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(
                id=env_id, entry_point=entry_point, order_enforce=False, disable_env_checker=False
            )


def text_space(max_length: int, min_length: int = 0) -> spaces.Text:
    """A `spaces.Text` over printable ASCII (newlines included)."""
    return spaces.Text(max_length=max_length, min_length=min_length, charset=TEXT_CHARSET)


def _reached_reward(obs: Any, reward: float, terminated: bool, info: dict) -> bool:
    """Default success test: the episode ended with a positive reward."""
    return bool(terminated and reward > 0)


class TextEnvWrapper(gymnasium.Env):
    """Turns a gymnasium env with a Discrete action space into a text env.

    env:          the inner env (Discrete(n) actions, any observation type)
    render_obs:   `render_obs(obs, env) -> str`, the text view of an inner observation
    action_names: one name per discrete action (in action-index order); the agent writes
                  `<action>name</action>` (case-insensitive, surrounding space ignored)
    system_prompt: the task instructions (shown once by the rollout)
    anchor_fn:    `anchor_fn(obs, env) -> hashable` exact state key; default: the observation text
    success_fn:   `success_fn(obs, reward, terminated, info) -> bool`; default: terminated with reward > 0
    max_steps:    truncate after this many `step` calls, invalid ones included (None: never here)
    max_obs_chars: length bound of the observation Text space; a longer view is an error

    The inner env is reset with a seed drawn from this env's own RNG, so `reset(seed=s)` fixes the
    whole episode (including slippery dynamics) and `reset()` continues deterministically after it.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(
        self,
        env: gymnasium.Env,
        render_obs: Callable[[Any, gymnasium.Env], str],
        action_names: Sequence[str],
        *,
        system_prompt: str,
        anchor_fn: Callable[[Any, gymnasium.Env], Hashable] | None = None,
        success_fn: Callable[[Any, float, bool, dict], bool] | None = None,
        max_steps: int | None = None,
        max_obs_chars: int = 2048,
        render_mode: str | None = None,
    ) -> None:
        if not isinstance(env.action_space, spaces.Discrete):
            raise TypeError(
                f"TextEnvWrapper needs a Discrete action space, got {env.action_space}; "
                "write a text env (str actions) directly for other spaces"
            )
        names = [str(n).strip().lower() for n in action_names]
        if len(names) != int(env.action_space.n) or len(set(names)) != len(names) or "" in names:
            raise ValueError(
                f"action_names must be {int(env.action_space.n)} distinct non-empty names "
                f"(one per discrete action), got {list(action_names)}"
            )
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")
        if render_mode not in (None, *self.metadata["render_modes"]):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.env = env
        self.render_obs = render_obs
        self.action_names = names
        self.system_prompt = system_prompt
        self.anchor_fn = anchor_fn
        self.success_fn = success_fn or _reached_reward
        self.max_steps = max_steps
        self.render_mode = render_mode
        self.observation_space = text_space(max_obs_chars, min_length=1)
        self.action_space = text_space(MAX_ACTION_CHARS)
        self._text: str | None = None  # current observation text; None before the first reset
        self._anchor: Hashable = None
        self._steps = 0
        self._done = True  # stepping is allowed only between reset() and the episode's end

    # -- hooks a subclass may override -------------------------------------------------------
    def _reset_inner(self, seed: int, options: dict | None) -> tuple[Any, dict]:
        """Reset the inner env (a subclass may rebuild it first, e.g. a new random map)."""
        return self.env.reset(seed=seed, options=options)

    # -- gymnasium API -------------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        inner_seed = int(self.np_random.integers(2**31 - 1))
        obs, inner_info = self._reset_inner(inner_seed, options)
        self._steps, self._done = 0, False
        self._observe(obs)
        return self._text, {**inner_info, "anchor": self._anchor, "success": False}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done:
            raise RuntimeError("step() called before reset() or after the episode ended")
        if not isinstance(action, str):
            raise TypeError(f"a text env takes the assistant text (str), got {type(action)}")
        self._steps += 1
        truncated = self.max_steps is not None and self._steps >= self.max_steps
        parsed = parse_action(action, fmt="action")
        name = parsed.raw.lower() if parsed.ok else None
        if name not in self.action_names:
            error = parsed.error or f"unknown action {parsed.raw!r}; use one of {self.action_names}"
            info = {"valid_action": False, "error": error, "anchor": self._anchor, "success": False}
            self._done = bool(truncated)
            return self._text, 0.0, False, bool(truncated), info
        obs, reward, terminated, inner_trunc, inner_info = self.env.step(
            self.action_names.index(name) + int(self.env.action_space.start)
        )
        reward, terminated = float(reward), bool(terminated)
        truncated = bool((truncated or inner_trunc) and not terminated)
        success = bool(self.success_fn(obs, reward, terminated, inner_info))
        self._observe(obs)
        self._done = terminated or truncated
        info = {**inner_info, "valid_action": True, "anchor": self._anchor, "success": success}
        return self._text, reward, terminated, truncated, info

    def render(self) -> str | None:
        return self._text if self.render_mode == "ansi" else None

    def _observe(self, obs: Any) -> None:
        text = self.render_obs(obs, self.env)
        if not isinstance(text, str) or not self.observation_space.contains(text):
            raise ValueError(
                f"render_obs must give a non-empty printable str of <= "
                f"{self.observation_space.max_length} chars, got {text!r:.200}"
            )
        self._text = text
        self._anchor = text if self.anchor_fn is None else self.anchor_fn(obs, self.env)


class PlainTextEnv(gymnasium.Env):
    """Adapts a plain Python class with text `reset`/`step` (not a gymnasium.Env) to gymnasium.

    The inner object must define `system_prompt` and return gymnasium's tuples:
    `reset(seed=..., [options=...]) -> (obs, info)`, `step(text) -> (obs, r, term, trunc, info)`.
    """

    metadata = {"render_modes": []}

    def __init__(self, inner: Any, max_obs_chars: int = MAX_ACTION_CHARS) -> None:
        for attr in ("reset", "step"):
            if not callable(getattr(inner, attr, None)):
                raise TypeError(f"{type(inner).__name__} has no {attr}() method")
        if not isinstance(getattr(inner, "system_prompt", None), str):
            raise AttributeError(
                f"{type(inner).__name__} must define `system_prompt` (str): the task instructions"
            )
        self.inner = inner
        self.system_prompt = inner.system_prompt
        self.observation_space = text_space(max_obs_chars)
        self.action_space = text_space(MAX_ACTION_CHARS)
        self._takes_options = "options" in inspect.signature(inner.reset).parameters

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        kw = {"options": options} if self._takes_options else {}
        out = self.inner.reset(seed=seed, **kw)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"{type(self.inner).__name__}.reset must return (obs, info), got {out!r:.200}"
            )
        return out

    def step(self, action: str):
        out = self.inner.step(action)
        if not (isinstance(out, tuple) and len(out) == 5):
            raise TypeError(
                f"{type(self.inner).__name__}.step must return (obs, reward, terminated, "
                f"truncated, info), got {out!r:.200}"
            )
        return out


def make_text_env(env_id: str | Callable[..., Any], **kwargs: Any) -> gymnasium.Env:
    """Build a text env from a registered id ("grouprl/FrozenLake-v0", ...), "module:Class", or
    an env factory passed from Python (a callable, e.g. a class or a function; the Python API's
    `env=`).

    "module:Class" and a factory: called with **kwargs; a result that is not a gymnasium.Env
    (a plain object with reset/step) is wrapped in `PlainTextEnv`. Any other string goes to
    `gymnasium.make(env_id, **kwargs)`. The result must have a Text observation space and a
    `system_prompt`; anything else is an error naming the fix.
    """
    register_envs()
    if callable(env_id):
        return _checked(_made_by(env_id, kwargs), env_name(env_id))
    if not isinstance(env_id, str):
        raise TypeError(
            f"an env is a registered id, 'module:Class' or a callable returning a text env, got "
            f"{type(env_id).__name__}: {str(env_id)[:80]!r}"
        )
    module_name, _, attr = env_id.partition(":")
    target = None
    if attr and attr.isidentifier():
        target = getattr(importlib.import_module(module_name), attr, None)
        if target is None and attr not in gymnasium.registry:
            raise ValueError(f"{env_id}: module {module_name!r} has no {attr!r} and no such env id")
    if target is not None:
        env = _made_by(target, kwargs)
    else:
        env = gymnasium.make(env_id, disable_env_checker=True, **kwargs)
    return _checked(env, env_id)


def env_name(env_id: str | Callable[..., Any]) -> str:
    """How messages and records name an env: the id, or a factory's qualified name."""
    if isinstance(env_id, str):
        return env_id
    name = getattr(env_id, "__qualname__", None) or type(env_id).__name__
    return f"{getattr(env_id, '__module__', None) or '?'}.{name}"


def _made_by(factory: Callable[..., Any], kwargs: dict[str, Any]) -> gymnasium.Env:
    env = factory(**kwargs)
    return env if isinstance(env, gymnasium.Env) else PlainTextEnv(env)


def _checked(env: gymnasium.Env, name: str) -> gymnasium.Env:
    """`env` if it is a text env (Text observations, a system_prompt), else an error naming it."""
    if not isinstance(env.observation_space, spaces.Text):
        raise TypeError(
            f"{name} is not a text env (observation_space={env.observation_space}); wrap it with "
            "grouprl.envs.gym.TextEnvWrapper(env, render_obs, action_names, system_prompt=...)"
        )
    system_prompt_of(env)
    return env


register_envs()
