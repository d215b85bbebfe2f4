"""Per-sample deadlines and isolation for reward functions and reward models.

`IsolatedReward(fn, name, timeout_s=..., isolation=...)` is itself a batched reward function
(the protocol of envs/rewards/loading.py). It calls `fn` ONE SAMPLE AT A TIME, each call with a
deadline of `timeout_s` seconds, so a sample that makes the function hang or raise costs that
sample only: it gets None (NaN: excluded from the advantage statistics), the others keep their
values. Counts since the last `pop_metrics()`: `reward_errors/<name>` (calls that raised, or a
worker that died) and `reward_timeouts/<name>`. With fail_fast the first failure raises
RewardFailure (naming the reward and the sample) instead. Isolation modes (option strings):

  "process"  `workers` forked worker processes, each holding a copy of `fn` (fork start method:
             closures and functions loaded from files work, nothing is pickled but the samples
             and the results). A call past its deadline gets its worker SIGKILLed and replaced.
             A worker that dies (segfault, os._exit) costs one sample and is replaced too.
             Processes the function starts, daemons included, end with their worker
             (grouprl.runtime.process_tree: the worker is their subreaper; close() kills the tree).
             Needs Linux/macOS fork; a CUDA reward model cannot run in a forked child.
  "thread"   each call in a daemon thread of this process (for reward models on a GPU). A call
             past its deadline is abandoned, not stopped (Python threads cannot be killed): its
             thread keeps running in the background and is counted in `abandoned_threads`.

Deviation from calling the function on the whole batch (score_completions): batching is given up
for isolation, so wrap only rewards that may hang or crash, not a fast batched reward model.
The arguments of one call are the batch columns sliced to that sample (`loading.sample_kwargs`).
`drain_reward_metrics(reward_fns)` collects `pop_metrics()` of every reward that has one. Config:
rewards[i].timeout_s / isolation / workers (`isolation_settings` reads them).
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

from grouprl.envs.rewards.loading import (
    RewardFn,
    check_reward_values,
    keywords_for,
    sample_kwargs,
)
from grouprl.runtime.process_tree import become_subreaper, kill_tree

_log = logging.getLogger(__name__)
Isolation = Literal["process", "thread"]


class RewardFailure(RuntimeError):
    """fail_fast: a reward call raised or missed its deadline (message names reward and sample)."""


def _describe(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"[:500]
    except Exception:  # a str() that raises
        return type(exc).__name__


def _serve(fn: RewardFn, conn: Connection, parent_end: Connection) -> None:
    """Worker process loop: (args, kwargs) in, ("ok", value) or ("error", text) out."""
    parent_end.close()
    become_subreaper()  # processes the reward starts (daemons too) stay in this tree: kill()
    while True:
        try:
            args, kwargs = conn.recv()
        except (EOFError, OSError):  # the parent closed the pipe or went away
            kill_tree(os.getpid(), include_root=False)  # what the reward started ends with us
            return
        try:
            reply: tuple = ("ok", fn(*args, **kwargs))
        except BaseException as exc:
            reply = ("error", _describe(exc))
        pop = getattr(fn, "pop_metrics", None)  # the function's own counts live in this process
        if callable(pop):
            try:
                reply += (pop(),)
            except Exception as exc:
                reply = ("error", f"pop_metrics raised {_describe(exc)}")
        try:
            conn.send(reply)
        except Exception as exc:  # an unpicklable result
            conn.send(("error", f"the result cannot be sent back: {_describe(exc)}"))


class _Worker:
    """One forked worker process holding `fn`."""

    def __init__(self, fn: RewardFn) -> None:
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(fn, child, self.conn), daemon=True)
        self.proc.start()
        child.close()

    def send(self, call: tuple) -> str | None:
        try:
            self.conn.send(call)
            return None
        except Exception as exc:  # unpicklable sample or a dead worker
            return f"cannot send the sample to the worker: {_describe(exc)}"

    def recv(self) -> tuple:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(timeout=1)
            return "error", f"the worker process died (exit code {self.proc.exitcode})"

    def kill(self) -> None:
        """End the worker and every process it started (setsid daemons included)."""
        if self.proc.pid is not None and self.proc.exitcode is None:  # not reaped: pid is ours
            kill_tree(self.proc.pid)
        self.proc.join(timeout=5)
        self.conn.close()


class IsolatedReward:
    """A reward function called per sample with a deadline (see the module docstring)."""

    def __init__(self, fn: RewardFn, name: str, *, timeout_s: float, isolation: Isolation =
                 "process", workers: int = 1, fail_fast: bool = False) -> None:  # fmt: skip
        if not callable(fn):
            raise TypeError(f"reward {name!r}: {type(fn).__name__} is not callable")
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"reward {name!r}: timeout_s must be a number > 0, got {timeout_s!r}")
        if isolation not in ISOLATIONS:
            raise ValueError(
                f"reward {name!r}: isolation={isolation!r}; allowed: {list(ISOLATIONS)}"
            )
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"reward {name!r}: workers must be an integer >= 1, got {workers!r}")
        self.fn, self.name, self.timeout_s, self.isolation = fn, name, float(timeout_s), isolation
        self.workers, self.fail_fast = workers, fail_fast
        self.errors = self.timeouts = self.abandoned_threads = 0
        self.first_error: str | None = None  # since the last pop_metrics()
        self.inner_metrics: dict[str, float] = {}  # pop_metrics() of fn, sent back by workers
        self._pool: list[_Worker] = []
        self._lock = threading.Lock()

    def __call__(self, completions: list[str], **columns: Any) -> list[float | None]:
        n = len(completions)
        # keyword calls (the protocol of loading.py): TRL's f(prompts, completions, **kw) works too
        calls = [((), keywords_for(self.fn, {"completions": list(completions[i : i + 1]),
                                              **sample_kwargs(columns, i, n)})) for i in range(n)]  # fmt: skip
        outcomes = ISOLATIONS[self.isolation](self, calls)
        values: list[float | None] = []
        for i, (status, payload) in enumerate(outcomes):
            if status == "ok":  # a contract violation (wrong length, inf) is a bug: it raises
                values += check_reward_values(self.name, payload, 1, offset=i)
                continue
            what = f"timed out after {self.timeout_s:g} s" if status == "timeout" else payload
            if self.first_error is None:  # quoted by the trainer's all-samples-failed warning
                self.first_error = f"sample {i}: {what}"
            if self.fail_fast:
                raise RewardFailure(f"reward function {self.name!r} on sample {i}: {what}")
            self.timeouts += status == "timeout"
            self.errors += status == "error"
            _log.warning("reward %r, sample %d: %s; its reward is NaN", self.name, i, what)
            values.append(None)
        return values

    # ---- the two isolation modes: calls -> [(status, payload)] with status ok / error / timeout

    def _run_processes(self, calls: list[tuple]) -> list[tuple[str, Any]]:
        """A small event loop: idle workers take the next sample, deadlines are checked in wait()."""
        results: list[tuple[str, Any]] = [("error", "not run")] * len(calls)
        pending, running = deque(range(len(calls))), {}  # worker -> (sample, deadline)
        while len(self._pool) < min(self.workers, len(calls)):
            self._pool.append(_Worker(self.fn))
        idle = list(self._pool)
        while pending or running:
            while pending and idle:
                worker, i = idle.pop(), pending.popleft()
                problem = worker.send(calls[i])
                if problem is None:
                    running[worker] = (i, time.monotonic() + self.timeout_s)
                else:
                    results[i] = ("error", problem)
                    idle.append(self._replace(worker))
            if not running:
                continue
            soonest = min(deadline for _, deadline in running.values())
            ready = wait([w.conn for w in running], max(0.0, soonest - time.monotonic()))
            for worker, (i, deadline) in list(running.items()):
                if worker.conn in ready:
                    reply = worker.recv()
                    results[i] = reply[:2]
                    for key, value in (reply[2] if len(reply) > 2 else {}).items():
                        self.inner_metrics[key] = self.inner_metrics.get(key, 0.0) + value
                    del running[worker]
                    idle.append(worker if worker.proc.is_alive() else self._replace(worker))
                elif time.monotonic() >= deadline:
                    results[i] = ("timeout", None)
                    del running[worker]
                    idle.append(self._replace(worker))
        return results

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self.fn)
        self._pool[self._pool.index(worker)] = fresh
        return fresh

    def _run_threads(self, calls: list[tuple]) -> list[tuple[str, Any]]:
        results: list[tuple[str, Any]] = [("error", "not run")] * len(calls)
        for start in range(0, len(calls), self.workers):
            batch = []
            for i in range(start, min(start + self.workers, len(calls))):
                t = threading.Thread(target=self._thread_call, args=(calls[i], results, i),
                                     daemon=True, name=f"reward-{self.name}-{i}")  # fmt: skip
                t.start()
                batch.append((i, t, time.monotonic() + self.timeout_s))
            for i, t, deadline in batch:
                t.join(max(0.0, deadline - time.monotonic()))
                with self._lock:
                    if results[i] == ("error", "not run"):
                        results[i] = ("timeout", None)
                        self.abandoned_threads += 1
        return results

    def _thread_call(self, call: tuple, results: list, i: int) -> None:
        try:
            value = ("ok", self.fn(*call[0], **call[1]))
        except BaseException as exc:
            value = ("error", _describe(exc))
        with self._lock:
            if results[i] == ("error", "not run"):  # a late result of an abandoned call is dropped
                results[i] = value

    # ---- bookkeeping

    def pop_metrics(self) -> dict[str, float]:
        """reward_errors/<name> and reward_timeouts/<name> since the last call (plus the wrapped
        function's own pop_metrics, if it has one), then reset."""
        out = {f"reward_errors/{self.name}": float(self.errors),
               f"reward_timeouts/{self.name}": float(self.timeouts)}  # fmt: skip
        inner = getattr(self.fn, "pop_metrics", None)
        if self.isolation == "thread" and callable(inner):
            self.inner_metrics = {k: self.inner_metrics.get(k, 0.0) + v for k, v in inner().items()}
        out.update(self.inner_metrics)
        self.errors = self.timeouts = 0
        self.inner_metrics = {}
        return out

    def pop_first_error(self) -> str | None:
        """The first failure's text since the last call, then reset."""
        first, self.first_error = self.first_error, None
        return first

    def close(self) -> None:
        """Stop the worker processes (they are daemons: they also end with this process)."""
        for worker in self._pool:
            worker.kill()
        self._pool = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


ISOLATIONS: dict[str, Callable[[IsolatedReward, list[tuple]], list[tuple[str, Any]]]] = {
    "process": IsolatedReward._run_processes,
    "thread": IsolatedReward._run_threads,
}


def isolation_settings(rewards: list[Any]) -> dict[str, dict[str, Any]]:
    """Config `rewards` entries -> {reward key: {timeout_s, isolation, workers}} for those with a
    timeout_s (keys as build.build_rewards names them: the function name of "module:function")."""
    out = {}
    for i, r in enumerate(rewards):
        key = r.name.rsplit(":", 1)[-1] if ":" in r.name else r.name
        if r.timeout_s is None:
            if r.isolation != "process" or r.workers != 1:
                raise ValueError(
                    f"rewards[{i}] ({r.name!r}): isolation / workers apply only with a timeout_s"
                )
            continue
        out[key] = {"timeout_s": r.timeout_s, "isolation": r.isolation, "workers": r.workers}
    return out


def isolate_rewards(reward_fns: dict[str, RewardFn], settings: Mapping[str, dict[str, Any]], *,
                    fail_fast: bool = False) -> dict[str, RewardFn]:  # fmt: skip
    """Wrap the rewards named in `settings` (name -> {timeout_s, isolation, workers}) in
    IsolatedReward; the others are returned unchanged. An unknown name is an error."""
    unknown = sorted(set(settings) - set(reward_fns))
    if unknown:
        raise ValueError(
            f"isolation settings for unknown rewards {unknown}; have {list(reward_fns)}"
        )
    out = dict(reward_fns)
    for name, options in settings.items():
        out[name] = IsolatedReward(reward_fns[name], name, fail_fast=fail_fast, **options)
    return out


def drain_reward_metrics(reward_fns: Mapping[str, Any]) -> dict[str, float]:
    """The `pop_metrics()` of every reward function that has one, merged (counts summed)."""
    out: dict[str, float] = {}
    for fn in reward_fns.values():
        pop = getattr(fn, "pop_metrics", None)
        if callable(pop):
            for key, value in pop().items():
                out[key] = out.get(key, 0.0) + float(value)
    return out
