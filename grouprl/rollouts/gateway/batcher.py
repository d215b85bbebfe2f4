"""Concurrent gateway calls gathered into batched engine calls.

Every call's generation is queued; one thread takes the first waiting call, gathers the calls
that arrive within `window_s` (at most `max_batch`), and runs each set of calls with equal
sampling parameters (and all seeded, or none) as one `engine.generate`, so that G episodes of
a group sample together as the single-turn and multi-turn rollouts do. A call waits at most
`timeout_s` for its result, then fails with a 503 (the batch it is in still runs; its result is
dropped and nothing is recorded). An engine error fails every call of its batch.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from grouprl.policies.text.engines.base import SamplingParams
from grouprl.rollouts.gateway.record import GatewayError


@dataclass
class _Job:
    ids: list[int]
    params: SamplingParams
    seed: int | None
    done: Future = field(default_factory=Future)

    def key(self) -> tuple:
        p = self.params
        return (p.temperature, p.top_p, p.top_k, p.max_new_tokens, tuple(p.stop), self.seed is None)


class EngineBatcher:
    """See the module docstring. policy: anything with `engine`; largest: the largest batch run
    so far (a number the tests read)."""

    def __init__(
        self, policy: Any, *, max_batch: int = 64, window_s: float = 0.005, timeout_s: float = 60.0
    ) -> None:
        self.policy, self.max_batch, self.window_s = policy, max_batch, window_s
        self.timeout_s = timeout_s
        self.largest = 0
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="gateway-batcher", daemon=True)
        self._thread.start()

    def generate(
        self, ids: list[int], params: SamplingParams, seed: int | None
    ) -> tuple[list[int], list[float], bool]:
        """(completion ids, their sampling log-probs, truncated) of one call."""
        job = _Job(ids, params, seed)
        self._queue.put(job)
        try:
            return job.done.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise GatewayError(
                503,
                f"no result within gateway.request_timeout_s={self.timeout_s}s (engine busy)",
                "server_error",
            ) from None

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            jobs, stopping = [first], False
            while len(jobs) < self.max_batch:
                try:
                    job = self._queue.get(timeout=self.window_s)
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                    break
                jobs.append(job)
            groups: dict[tuple, list[_Job]] = {}
            for job in jobs:
                groups.setdefault(job.key(), []).append(job)
            for group in groups.values():
                self._run(group)
            if stopping:
                return

    def _run(self, jobs: list[_Job]) -> None:
        self.largest = max(self.largest, len(jobs))
        seeds = None if jobs[0].seed is None else {"seeds": [j.seed for j in jobs]}
        try:
            out = self.policy.engine.generate(
                [j.ids for j in jobs], jobs[0].params, **(seeds or {})
            )
        except BaseException as exc:  # every call of the batch reports it
            for j in jobs:
                j.done.set_exception(exc)
            return
        for j, ids, logp, cut in zip(jobs, out.completion_ids, out.logprobs, out.truncated):
            if not ids:
                j.done.set_exception(RuntimeError("the engine returned an empty completion"))
            else:
                j.done.set_result((list(ids), list(logp), bool(cut)))
