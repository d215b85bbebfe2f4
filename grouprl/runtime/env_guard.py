"""Environments that raise or hang: an env step's failure ends that episode, not the run.

`EnvGuard(timeout_s, fail_fast)` wraps the env factory of one batch of episodes
(`guard.wrap(make_env)`); every env it makes is a `GuardedEnv`:

- without a timeout the env lives in this process; a step() that raises ends the episode;
- with `timeout_s` (config agent.env_step_timeout_s) the env, made here, is served by its own
  forked process (also without a deadline when `own_process`: agent.env_execution "processes",
  envs/vector.py), and a reset / step / attribute read that misses the deadline gets that process
  SIGKILLed (the copy left in this process is never used again).

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
import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from grouprl.runtime.process_tree import become_subreaper, kill_tree

_log = logging.getLogger(__name__)


class EnvFailure(RuntimeError):
    """An env reset failed, or (fail_fast) a step raised or hung."""


class _RemoteError(RuntimeError):
    """A failure reported by (or of) the env process; its message is already the description."""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, _RemoteError):
        return str(exc)
    try:
        return f"{type(exc).__name__}: {exc}"[:500]
    except Exception:
        return type(exc).__name__


def _serve(env: Any, conn: Connection, parent_end: Connection) -> None:
    """Env process loop: (command, argument) in, ("ok", value) or ("error", text, is_attr) out."""
    parent_end.close()
    become_subreaper()  # processes the env starts (daemons too) stay in this tree: kill()
    while True:
        try:
            command, arg = conn.recv()
        except (EOFError, OSError):  # the parent closed the pipe or went away
            kill_tree(os.getpid(), include_root=False)  # what the env started ends with us
            return
        try:
            if command == "reset":
                value: Any = env.reset(**arg)
            elif command == "step":
                value = env.step(arg)
            elif command == "close":
                value = getattr(env, "close", lambda: None)()
            else:  # getattr
                value = getattr(env, arg)
            reply: tuple[str, Any] = ("ok", value)
        except BaseException as exc:
            reply = ("error", _describe(exc), isinstance(exc, AttributeError))
        try:
            conn.send(reply)
        except Exception as exc:
            conn.send(("error", f"the env's answer cannot be sent back: {_describe(exc)}", False))
        if command == "close":
            kill_tree(os.getpid(), include_root=False)
            return


class _EnvProcess:
    """The env in a forked child; `call` raises TimeoutError / _RemoteError / AttributeError."""

    def __init__(self, env: Any, timeout_s: float) -> None:
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(env, child, self.conn), daemon=True)
        self.proc.start()
        child.close()
        self.timeout_s, self.dead = timeout_s, False

    def call(self, command: str, arg: Any = None) -> Any:
        if self.dead:
            raise _RemoteError("the env process was stopped after an earlier failure")
        self.conn.send((command, arg))
        if not self.conn.poll(self.timeout_s):
            self.kill()
            raise TimeoutError(f"env {command} did not answer within {self.timeout_s:g} s")
        try:
            reply = self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise _RemoteError(f"the env process died (exit code {self.proc.exitcode})") from None
        if reply[0] == "ok":
            return reply[1]
        raise (AttributeError if reply[2] else _RemoteError)(reply[1])

    def kill(self) -> None:
        """End the env process and every process it started (setsid daemons included)."""
        self.dead = True
        if self.proc.pid is not None and self.proc.exitcode is None:  # not reaped: pid is ours
            kill_tree(self.proc.pid)
        self.proc.join(timeout=5)
        self.conn.close()


class GuardedEnv:
    """A text env whose step failures end the episode (see the module docstring)."""

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
        return getattr(self._env, arg)

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

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # private / dunder lookups (copy, pickle) never reach the env
            raise AttributeError(name)
        try:
            return self._call("getattr", name)
        except AttributeError:
            raise
        except Exception as exc:
            raise AttributeError(f"env attribute {name!r} unavailable: {_describe(exc)}") from exc

    def close(self) -> None:
        if self._remote is None:
            getattr(self._env, "close", lambda: None)()
            return
        if not self._remote.dead:
            try:
                self._remote.call("close")
            except Exception as exc:
                _log.warning("env close failed: %s", _describe(exc))
            self._remote.kill()


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
