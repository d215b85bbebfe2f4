"""Environments that raise or hang: an env step's failure ends that episode, not the run.

`EnvGuard(timeout_s, fail_fast)` wraps the env factory of one batch of episodes
(`guard.wrap(make_env)`); every env it makes is a `GuardedEnv`:

- without a timeout the env lives in this process; a step() that raises ends the episode;
- with `timeout_s` (config agent.env_step_timeout_s) the env, made here, is served by its own
  forked process, a runtime/workers.ForkedWorker (also without a deadline when `own_process`:
  agent.env_execution "processes", envs/vector.py), and a reset / step / attribute read that
  misses the deadline gets that process and its tree SIGKILLed (the copy left in this process is
  never used again; the worker is not restarted: the env's state is gone with it). Replies (an
  observation, an info dict, an attribute) are loaded by the worker's restricted unpickler.

A failed step returns (observation "[environment error: ...]", reward 0.0, terminated False,
truncated True, info {"env_error": message, ...}): the rollout ends the episode as truncated, its
transcript shows the error, and `guard.errors()` gives one entry per env made (the message, or
None), in the order the envs were made (which is the episode order of collect_episodes). A reset
that fails raises EnvFailure: an episode that cannot start has nothing to score. With fail_fast,
any failure raises EnvFailure. The step's reward is 0 and the episode stays in the batch (like an
episode cut by the turn limit); a later attribute read or close() of a dead env is harmless.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from grouprl.runtime.workers import Died, ForkedWorker, Ok, Raised, TimedOut, describe

_log = logging.getLogger(__name__)


class EnvFailure(RuntimeError):
    """An env reset failed, or (fail_fast) a step raised or hung."""


class _RemoteError(RuntimeError):
    """A failure reported by (or of) the env process; its message is already the description."""


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, _RemoteError) else describe(exc)


_MISSING = "missing attribute"  # the handler's answer to a read of an attribute the env lacks


def _env_handler(env: Any) -> Callable[[tuple[str, Any]], Any]:
    """The env process's handler: (command, argument) -> the env's answer."""

    def handle(request: tuple[str, Any]) -> Any:
        command, arg = request
        if command == "reset":
            return env.reset(**arg)
        if command == "step":
            return env.step(arg)
        if command == "close":
            return getattr(env, "close", lambda: None)()
        try:  # "attr": a read through gymnasium's wrappers
            return ("ok", _read_attr(env, arg))
        except AttributeError as exc:
            return (_MISSING, describe(exc))

    return handle


def _read_attr(env: Any, name: str) -> Any:
    """env.name, or the attribute of the env under gymnasium wrappers (get_wrapper_attr)."""
    if hasattr(env, name):
        return getattr(env, name)
    getter = getattr(env, "get_wrapper_attr", None)
    if getter is None:
        raise AttributeError(f"{type(env).__name__} has no attribute {name!r}")
    return getter(name)


class _EnvProcess:
    """The env in a forked worker; `call` raises TimeoutError / _RemoteError / AttributeError."""

    def __init__(self, env: Any, timeout_s: float | None) -> None:
        self.worker = ForkedWorker(_env_handler(env), name="grouprl-env")
        self.worker.start()  # now: the env copy left in this process is never used again
        self.timeout_s, self.dead = timeout_s, False

    def call(self, command: str, arg: Any = None) -> Any:
        if self.dead:
            raise _RemoteError("the env process was stopped after an earlier failure")
        outcome = self.worker.call((command, arg), self.timeout_s)
        if isinstance(outcome, Ok):
            if command != "attr":
                return outcome.value
            status, value = outcome.value
            if status == _MISSING:
                raise AttributeError(value)
            return value
        self.kill()  # a failed env process is never restarted: its env state is lost
        if isinstance(outcome, TimedOut):
            raise TimeoutError(f"env {command} did not answer within {self.timeout_s:g} s")
        if isinstance(outcome, Died):
            raise _RemoteError(f"the env process died (exit code {outcome.exitcode})")
        assert isinstance(outcome, Raised)
        raise _RemoteError(outcome.error)

    def kill(self) -> None:
        """End the env process and every process it started (setsid daemons included)."""
        self.dead = True
        self.worker.kill()

    def close(self) -> None:
        """The env's own close() has run: the worker stops and its tree is killed."""
        self.dead = True
        self.worker.close()


class GuardedEnv:
    """A text env whose step failures end the episode (see the module docstring). It offers the
    gymnasium Env surface the rollouts use: reset, step, close, the attributes below and
    get_wrapper_attr(name) for any other (no attribute forwarding)."""

    def __init__(
        self,
        make_env: Callable[[], Any],
        timeout_s: float | None,
        fail_fast: bool,
        own_process: bool = False,
    ):
        self.fail_fast, self.error, self._last_obs = fail_fast, None, ""
        if timeout_s is None and not own_process:
            self._env, self._remote = make_env(), None
        else:
            self._env, self._remote = None, _EnvProcess(make_env(), timeout_s)

    def _call(self, command: str, arg: Any = None) -> Any:
        if self._remote is not None:
            return self._remote.call(command, arg)
        if command == "reset":
            return self._env.reset(**arg)
        if command == "step":
            return self._env.step(arg)
        return _read_attr(self._env, arg)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        try:
            kwargs = {"seed": seed} if options is None else {"seed": seed, "options": options}
            obs, info = self._call("reset", kwargs)
        except Exception as exc:
            raise EnvFailure(f"env reset (seed {seed}) failed: {_describe(exc)}") from exc
        self._last_obs = obs
        return obs, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.error is not None:
            raise EnvFailure(f"step() after the episode ended with an env error ({self.error})")
        try:
            result = self._call("step", action)
        except Exception as exc:
            self.error = _describe(exc)
            if self.fail_fast:
                raise EnvFailure(f"env step failed: {self.error}") from exc
            _log.warning("env step failed, the episode ends: %s", self.error)
            if self._remote is not None:
                self._remote.kill()
            info = {"env_error": self.error, "valid_action": True, "success": False}
            return f"[environment error: {self.error}]", 0.0, False, True, info
        self._last_obs = result[0]
        return result

    def get_wrapper_attr(self, name: str) -> Any:
        """The env's attribute `name` (through gymnasium wrappers), read where the env lives;
        AttributeError if it has none or cannot be read (the env process failed)."""
        try:
            return self._call("attr", name)
        except AttributeError:
            raise
        except Exception as exc:
            raise AttributeError(f"env attribute {name!r} unavailable: {_describe(exc)}") from exc

    # the attributes of a text env the rollouts read (rollouts/multi_turn.py) and gymnasium's own
    system_prompt = property(lambda self: self.get_wrapper_attr("system_prompt"))
    tools = property(lambda self: self.get_wrapper_attr("tools"))
    metadata = property(lambda self: self.get_wrapper_attr("metadata"))
    spec = property(lambda self: self.get_wrapper_attr("spec"))
    render_mode = property(lambda self: self.get_wrapper_attr("render_mode"))
    action_space = property(lambda self: self.get_wrapper_attr("action_space"))
    observation_space = property(lambda self: self.get_wrapper_attr("observation_space"))

    def close(self) -> None:
        if self._remote is None:
            getattr(self._env, "close", lambda: None)()
            return
        if not self._remote.dead:
            try:
                self._remote.call("close")
            except Exception as exc:
                _log.warning("env close failed: %s", _describe(exc))
            self._remote.close()


class EnvGuard:
    """Makes GuardedEnvs for one batch and remembers them, in order, for `errors()`."""

    def __init__(
        self, timeout_s: float | None = None, fail_fast: bool = False, own_process: bool = False
    ) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"env step timeout_s must be > 0 or None, got {timeout_s!r}")
        self.timeout_s, self.fail_fast, self.own_process = timeout_s, fail_fast, own_process
        self.envs: list[GuardedEnv] = []

    def wrap(self, make_env: Callable[[], Any]) -> Callable[[], GuardedEnv]:
        def make() -> GuardedEnv:
            env = GuardedEnv(make_env, self.timeout_s, self.fail_fast, self.own_process)
            self.envs.append(env)
            return self.envs[-1]

        return make

    def errors(self) -> list[str | None]:
        """The error of each env made (None: no failure), in the order they were made."""
        return [env.error for env in self.envs]
