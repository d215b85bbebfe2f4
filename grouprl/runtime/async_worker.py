"""The rollout worker as a separate process (train.async_worker = "process"), for grouprl.runtime.async_rollout.

Why a process: the threads of one Python process share the GIL, and on some machines (this
repository's CPU test machine among them: benchmarks/README.md) two threads of one process never
compute at the same time, while two processes do. A forked child then samples while the parent
trains.

How: the child is forked once, when one_step_off starts, so it inherits everything the rollouts
need (the snapshot policy, the sampler, the reward functions, the rollout function) without
pickling any of it. The snapshot's weights live in shared memory (`share_memory()` before the
fork): the parent copies its weights in while the child is idle, the child reads them. Each job is
a pickled argument tuple over a pipe; the child answers with the pickled result (or the traceback
of its error, raised in the parent). CPU only: a CUDA context does not survive a fork.
"""

from __future__ import annotations

import atexit
import pickle
import traceback
from collections.abc import Callable
from typing import Any

import torch


class ProcessRunner:
    """One forked worker process running `target(*args)` for each `submit(*args)`, in order."""

    def __init__(self, target: Callable[..., Any]) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve, args=(child, target, torch.get_num_threads()), name="grouprl-rollout"
        )
        self.proc.start()
        child.close()
        self.closed = False
        atexit.register(self.shutdown)  # runs before multiprocessing joins its children

    def submit(self, *args: Any) -> Reply:
        self.conn.send_bytes(pickle.dumps(args))
        return Reply(self.conn)

    def shutdown(self, wait: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.conn.send_bytes(pickle.dumps(None))
        except OSError:
            pass
        self.proc.join(timeout=60 if wait else 0)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()
        self.conn.close()


class Reply:
    """The answer to one job (Future-like: result(), cancel())."""

    def __init__(self, conn: Any) -> None:
        self.conn, self.value = conn, None

    def result(self) -> Any:
        if self.value is None:
            try:
                self.value = pickle.loads(self.conn.recv_bytes())
            except EOFError:
                raise RuntimeError("the rollout worker process died") from None
        kind, payload = self.value
        if kind == "error":
            raise RuntimeError(f"the rollout worker process failed:\n{payload}")
        return payload

    def cancel(self) -> bool:
        return False


def _serve(conn: Any, target: Callable[..., Any], threads: int) -> None:
    torch.set_num_threads(threads)
    while True:
        try:
            job = pickle.loads(conn.recv_bytes())
        except EOFError:  # the parent went away
            return
        if job is None:
            return
        try:
            answer = ("ok", target(*job))
        except BaseException:  # noqa: BLE001 - every failure goes back to the parent
            answer = ("error", traceback.format_exc())
        conn.send_bytes(pickle.dumps(answer))
