"""The rollout worker as a separate process (train.async_worker = "process"), for grouprl.runtime.async_rollout.

Why a process: the threads of one Python process share the GIL, and on some machines (this
repository's CPU test machine among them: benchmarks/README.md) two threads of one process never
compute at the same time, while two processes do. A forked child then samples while the parent
trains.

How: the child is forked once, when one_step_off starts, so it inherits everything the rollouts
need (the snapshot policy, the sampler, the reward functions, the rollout function) without
pickling any of it. The snapshot's weights live in shared memory (`share_memory()` before the
fork): the parent copies its weights in while the child is idle, the child reads them. The child
is a runtime/workers.ForkedWorker: each job is an argument tuple over its pipe; the child answers
with the result (the batch, the sampler position, the RNG state: loaded by the worker's
restricted unpickler, which admits the Rollout / TokenBatch dataclasses besides plain data and
tensors) or the traceback of its error, raised in the parent. Jobs have no deadline; close()
waits up to 60 s for a batch in progress, then kills the child's tree. CPU only: a CUDA context
does not survive a fork.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from grouprl.runtime.workers import Died, ForkedWorker, Ok, Raised, TimedOut
from grouprl.types import Rollout, TokenBatch

# the classes a reply carries besides plain data, tensors and numpy arrays (the RNG state)
REPLY_CLASSES = (Rollout, TokenBatch)


class ProcessRunner:
    """One forked worker process running `target(*args)` for each `submit(*args)`, in order."""

    def __init__(self, target: Callable[..., Any]) -> None:
        threads = torch.get_num_threads()
        self.worker = ForkedWorker(
            lambda args: target(*args), name="grouprl-rollout", allowed=REPLY_CLASSES,
            on_start=functools.partial(torch.set_num_threads, threads), daemon=False,
            grace_s=60.0,  # shutdown lets a batch in progress finish
        )  # fmt: skip
        self.worker.start()  # now: the child inherits the state the rollouts need as it is

    def submit(self, *args: Any) -> Reply:
        failed = self.worker.submit(args)  # no deadline: a batch takes what it takes
        return Reply(self.worker, failed)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the worker (it finishes the batch in progress first when `wait`)."""
        if not wait:
            self.worker.kill()
        self.worker.close()


class Reply:
    """The answer to one job (Future-like: result(), cancel())."""

    def __init__(self, worker: ForkedWorker, failed: Any = None) -> None:
        self.worker, self.outcome = worker, failed

    def result(self) -> Any:
        if self.outcome is None:
            self.outcome = self.worker.collect()
        if isinstance(self.outcome, Ok):
            return self.outcome.value
        if isinstance(self.outcome, Died | TimedOut):
            raise RuntimeError(f"the rollout worker process died ({self.outcome.describe()})")
        assert isinstance(self.outcome, Raised)
        detail = self.outcome.traceback or self.outcome.error
        raise RuntimeError(f"the rollout worker process failed:\n{detail}")

    def cancel(self) -> bool:
        return False
