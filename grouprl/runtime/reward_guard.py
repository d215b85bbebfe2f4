"""Per-sample deadlines and isolation for reward functions and reward models.

`IsolatedReward(fn, name, timeout_s=..., isolation=...)` is itself a batched reward function
(the protocol of envs/rewards/loading.py). It calls `fn` ONE SAMPLE AT A TIME, each call with a
deadline of `timeout_s` seconds, so a sample that makes the function hang or raise costs that
sample only: it gets None (NaN: excluded from the advantage statistics), the others keep their
values. Counts since the last `pop_metrics()`: `reward_errors/<name>` (calls that raised, or a
worker that died) and `reward_timeouts/<name>`. With fail_fast the first failure raises
RewardFailure (naming the reward and the sample) instead. Isolation modes (option strings):

  "process"  `workers` forked worker processes (runtime/workers.ForkedWorker), each holding a
             copy of `fn` (fork start method: closures and functions loaded from files work,
             nothing is pickled but the samples and the results; results are loaded by the
             worker's restricted unpickler). A call past its deadline gets its worker SIGKILLed
             with its tree and replaced (forked afresh for its next sample). A worker that dies
             (segfault, os._exit) costs one sample and is replaced too.
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
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Literal

from grouprl.envs.rewards.loading import (
    RewardFn,
    check_reward_values,
    keywords_for,
    sample_kwargs,
)
from grouprl.runtime.workers import Died, ForkedWorker, Ok, Raised, TimedOut, describe, wait_ready

_log = logging.getLogger(__name__)
Isolation = Literal["process", "thread"]


class RewardFailure(RuntimeError):
    """fail_fast: a reward call raised or missed its deadline (message names reward and sample)."""


def _reward_handler(fn: RewardFn) -> Callable[[tuple], tuple]:
    """The worker's handler: one call (args, kwargs) -> (status, value or error text, the
    function's own pop_metrics() since the last call, {} if it has none)."""

    def handle(call: tuple) -> tuple:
        args, kwargs = call
        try:
            reply: tuple = ("ok", fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - the sample's failure, with its metrics
            reply = ("error", describe(exc))
        pop = getattr(fn, "pop_metrics", None)  # the function's own counts live in this process
        if callable(pop):
            try:
                return (*reply, pop())
            except Exception as exc:
                return "error", f"pop_metrics raised {describe(exc)}", {}
        return (*reply, {})

    return handle


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
        self._pool: list[ForkedWorker] = []
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
        """A small event loop: idle workers take the next sample; each worker's deadline is its
        own (a worker past it is killed with its tree and forks afresh for its next sample)."""
        results: list[tuple[str, Any]] = [("error", "not run")] * len(calls)
        pending, running = deque(range(len(calls))), {}  # worker -> sample
        while len(self._pool) < min(self.workers, len(calls)):
            self._pool.append(ForkedWorker(_reward_handler(self.fn), name="grouprl-reward"))
        idle = list(self._pool)
        while pending or running:
            while pending and idle:
                worker, i = idle.pop(), pending.popleft()
                failed = worker.submit(calls[i], self.timeout_s)
                if failed is None:
                    running[worker] = i
                else:
                    results[i] = self._result(failed)
                    idle.append(worker)
            if not running:
                continue
            soonest = min(w.deadline for w in running)
            ready = wait_ready(running, max(0.0, soonest - time.monotonic()))
            for worker in list(running):
                if worker in ready or time.monotonic() >= worker.deadline:
                    results[running.pop(worker)] = self._result(worker.collect())
                    idle.append(worker)
        return results

    def _result(self, outcome: Any) -> tuple[str, Any]:
        """A worker's outcome as (status, payload); the function's metrics are added up."""
        if isinstance(outcome, Ok):
            status, payload, metrics = outcome.value
            for key, value in metrics.items():
                self.inner_metrics[key] = self.inner_metrics.get(key, 0.0) + value
            return status, payload
        if isinstance(outcome, TimedOut):
            return "timeout", None
        if isinstance(outcome, Died):
            return "error", f"the worker process died (exit code {outcome.exitcode})"
        assert isinstance(outcome, Raised)
        return "error", outcome.error

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
            value = ("error", describe(exc))
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
            worker.close()
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
