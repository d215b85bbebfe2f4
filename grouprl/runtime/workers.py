"""The one forked-worker primitive: a process that serves requests over a pipe, each with a deadline.

`ForkedWorker(handler)` forks (start method "fork": the handler and everything it closes over are
the parent's objects, never pickled) a child that runs `handler(request)` for each request and
sends back the return value. Used by the reward isolation (runtime/reward_guard.py), the env
isolation (runtime/env_guard.py) and the rollout worker process (runtime/async_worker.py).

    worker = ForkedWorker(handler, name="grouprl-reward")
    outcome = worker.call(request, timeout_s=5.0)       # or submit(...) now, collect() later
    match outcome: Ok(value) | Raised(error, traceback) | TimedOut(after_s) | Died(exitcode)
    worker.close()                                       # nothing of it is left running

- The child starts with `become_subreaper()` (runtime/process_tree.py), so processes the handler
  starts, setsid daemons included, stay in its tree.
- A request past its deadline, a reply the parent refuses, or a child that dies (segfault,
  os._exit, a signal): the child and its whole tree are SIGKILLed (`kill_tree`) and the outcome
  says which. The next `submit` forks a fresh child (lazy restart); `start()` forks one now.
- `close()` asks the child to stop (it kills its own descendants and exits), waits `grace_s`, then
  kills whatever is left of the tree; a child whose pipe closes (the parent ended) does the same.
  Workers still open when the interpreter exits are closed by an atexit hook.

What travels (the messages are what the three users sent before, in the same pickle format):
- parent -> child: the request, pickled by the parent and loaded by the child. The child is a
  copy of the parent: what the parent sends is as trusted as the child's own memory.
- child -> parent: the reply, written by the handler, which runs code we do not trust (a reward
  function, an env, a dataset's columns). The parent loads it with `safe_loads`: a restricted
  unpickler that builds only plain data (None, bool, int, float, complex, str, bytes, list,
  tuple, dict, set, OrderedDict), torch tensors / dtypes / sizes / devices (storages through
  `torch.load(weights_only=True)`), numpy arrays and scalars without object dtype, and the
  dataclasses the worker's owner names in `allowed` (e.g. grouprl.types.Rollout). Any other
  global is refused: the worker is killed and the outcome is Raised("the worker's reply was
  refused ..."). A reply can thus never run code in the parent.

Not used by the sandbox for model-written code (grouprl/envs/sandbox): a sandbox call is not a
forked copy of the trainer serving requests, it is a fresh interpreter exec'd per call (`python
-I -S`: no memory of the trainer, no secrets, no weights) inside new namespaces, a seccomp filter
and a cgroup of its own, set up by keeper.py between fork and exec; its deadline starts when the
runner reports ready (set-up excluded), its outputs are capped byte streams, and it is ended by
killing the cgroup (cgroup.kill / freezer), which, unlike the /proc walk of kill_tree, also holds
processes that left the tree before the kill and survives the trainer's SIGKILL (the keeper's
parent-death signal). Forking the trainer for it would put the trainer's memory within reach of
untrusted code, and walking /proc would weaken the kill.
"""

from __future__ import annotations

import atexit
import builtins
import collections
import importlib
import io
import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

from grouprl.runtime.process_tree import become_subreaper, kill_tree

_STOP = b""  # the parent's "stop" message (a pickle is never empty)


def describe(exc: BaseException) -> str:
    """'Type: message', at most 500 characters (a str() that raises gives the type only)."""
    try:
        return f"{type(exc).__name__}: {exc}"[:500]
    except Exception:
        return type(exc).__name__


# ---- outcomes of one request


@dataclass(frozen=True)
class Ok:
    """The handler returned `value`."""

    value: Any
    kind: Literal["ok"] = "ok"

    def describe(self) -> str:
        return "ok"


@dataclass(frozen=True)
class Raised:
    """The handler raised (`error`: 'Type: message', `traceback`: the child's traceback), or the
    request could not be sent, or the reply could not be sent back / was refused."""

    error: str
    traceback: str = ""
    kind: Literal["raised"] = "raised"

    def describe(self) -> str:
        return self.error


@dataclass(frozen=True)
class TimedOut:
    """No reply within the deadline: the worker and its tree were killed."""

    after_s: float
    kind: Literal["timed_out"] = "timed_out"

    def describe(self) -> str:
        return f"no reply within {self.after_s:g} s"


@dataclass(frozen=True)
class Died:
    """The worker ended without replying; `exitcode` as multiprocessing gives it (-N: signal N,
    None: unknown)."""

    exitcode: int | None
    kind: Literal["died"] = "died"

    @property
    def signal(self) -> int | None:
        return -self.exitcode if self.exitcode is not None and self.exitcode < 0 else None

    def describe(self) -> str:
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = str(self.signal)
            return f"the worker process died (exit code {self.exitcode}, signal {name})"
        return f"the worker process died (exit code {self.exitcode})"


Outcome = Ok | Raised | TimedOut | Died


# ---- the restricted loader of replies


def _torch_globals() -> dict[tuple[str, str], Any]:
    import torch
    import torch._utils

    def storage(data: bytes) -> Any:  # torch.storage._load_from_bytes, with weights_only
        return torch.load(io.BytesIO(data), weights_only=True)

    def tensor(storage, offset, size, stride, requires_grad, hooks, metadata=None):
        if hooks:  # backward hooks are callables: never from a reply
            raise pickle.UnpicklingError("a tensor with backward hooks")
        return torch._utils._rebuild_tensor_v2(
            storage, offset, size, stride, requires_grad, collections.OrderedDict(), metadata
        )

    out: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): tensor,
        ("torch.storage", "_load_from_bytes"): storage,
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
    }
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            out[("torch", name)] = getattr(torch, name)
    return out


def _numpy_globals() -> dict[tuple[str, str], Any]:
    try:
        import numpy as np
    except ImportError:
        return {}

    def plain(dtype: Any) -> Any:
        if isinstance(dtype, np.dtype) and dtype.hasobject:  # raw bytes read as object pointers
            raise pickle.UnpicklingError("a numpy object dtype")
        return dtype

    out: dict[tuple[str, str], Any] = {
        ("numpy", "dtype"): np.dtype,
        ("numpy", "ndarray"): np.ndarray,
    }
    for core in ("numpy._core", "numpy.core"):  # numpy 2 / numpy 1: the first that exists
        try:
            numeric = importlib.import_module(f"{core}.numeric")
            multiarray = importlib.import_module(f"{core}.multiarray")
        except ImportError:
            continue
        out[(f"{core}.numeric", "_frombuffer")] = (
            lambda buf, dtype, shape, order, f=numeric._frombuffer: f(
                buf, plain(dtype), shape, order
            )
        )
        out[(f"{core}.multiarray", "scalar")] = lambda dtype, *data, f=multiarray.scalar: f(
            plain(dtype), *data
        )

        def reconstruct(cls, shape, dtype_code, f=multiarray._reconstruct):
            if cls is not np.ndarray:  # its state (BUILD) is checked by ndarray.__setstate__
                raise pickle.UnpicklingError(f"numpy _reconstruct of {cls!r}")
            return f(cls, shape, dtype_code)

        out[(f"{core}.multiarray", "_reconstruct")] = reconstruct
        break
    return out


_SAFE: dict[tuple[str, str], Any] = {}


def _safe_globals() -> dict[tuple[str, str], Any]:
    if not _SAFE:
        _SAFE.update({("builtins", n): getattr(builtins, n)
                      for n in ("set", "frozenset", "complex", "slice", "bytearray")})  # fmt: skip
        _SAFE[("collections", "OrderedDict")] = collections.OrderedDict
        _SAFE.update(_torch_globals())
        _SAFE.update(_numpy_globals())
    return _SAFE


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name)) or _safe_globals().get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a reply")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in a reply")


def safe_loads(data: bytes, allowed: Iterable[type] = ()) -> Any:
    """Unpickle `data` building only plain data, tensors, numpy arrays and the classes in
    `allowed` (see the module docstring); anything else raises pickle.UnpicklingError."""
    names = {(cls.__module__, cls.__qualname__): cls for cls in allowed}
    return _RestrictedUnpickler(data, names).load()


# ---- the worker


def _serve(handler: Callable[[Any], Any], conn: Connection, parent_end: Connection,
           on_start: Callable[[], None] | None) -> None:  # fmt: skip
    """The child's loop: request in, ("ok", value) or ("raised", error, traceback) out."""
    parent_end.close()
    become_subreaper()  # processes the handler starts (daemons too) stay in this tree
    if on_start is not None:
        on_start()
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):  # the parent closed the pipe or went away
            break
        if data == _STOP:
            break
        try:
            reply: tuple = ("ok", handler(pickle.loads(data)))  # from the parent: trusted
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
            reply = ("raised", describe(exc), traceback.format_exc())
        try:
            payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:  # noqa: BLE001 - an unpicklable value
            error = f"the reply cannot be sent back: {describe(exc)}"
            payload = pickle.dumps(("raised", error, traceback.format_exc()))
        try:
            conn.send_bytes(payload)
        except OSError:
            break
    kill_tree(os.getpid(), include_root=False)  # what the handler started ends with us


def _end_watch(proc: Any) -> Any:
    """Something multiprocessing.connection.wait sees readable once `proc` has ended: a pidfd
    (Linux >= 5.3). multiprocessing's own sentinel is a pipe whose write end every process the
    child forks inherits, so a daemon the child started would hide its end; it is the fallback."""
    try:
        return os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return proc.sentinel


_OPEN: weakref.WeakSet[ForkedWorker] = weakref.WeakSet()


@atexit.register
def _close_open_workers() -> None:
    """Runs before multiprocessing's own exit hook (registered earlier) joins its children."""
    for worker in list(_OPEN):
        worker.close()


class ForkedWorker:
    """One forked process serving `handler(request)`, one request at a time, each with a deadline
    (see the module docstring). Not thread-safe: one caller at a time."""

    def __init__(self, handler: Callable[[Any], Any], *, name: str = "grouprl-worker",
                 allowed: Iterable[type] = (), on_start: Callable[[], None] | None = None,
                 daemon: bool = True, grace_s: float = 5.0) -> None:  # fmt: skip
        """allowed: classes a reply may contain besides plain data (safe_loads); on_start: run
        first in each child; daemon: multiprocessing's flag (a daemonic child cannot start
        multiprocessing children of its own); grace_s: how long close() waits for the child to
        stop by itself before killing its tree."""
        self.handler, self.name, self.on_start = handler, name, on_start
        self.allowed = {(cls.__module__, cls.__qualname__): cls for cls in allowed}
        self.daemon, self.grace_s = daemon, grace_s
        self._proc: Any = None
        self._conn: Connection | None = None
        self._pending: tuple[float | None, float | None] | None = None  # (deadline, timeout_s)
        self._ended: Any = None  # readable once the child has ended (_end_watch)
        self._owner = os.getpid()

    # ---- state

    @property
    def pid(self) -> int | None:
        """The running child's pid (None: no child now)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def busy(self) -> bool:
        """A request was submitted and its outcome not collected yet."""
        return self._pending is not None

    @property
    def connection(self) -> Connection:
        """The parent's end of the pipe, for multiprocessing.connection.wait (see wait_ready)."""
        if self._conn is None:
            raise RuntimeError(f"{self.name}: no child running")
        return self._conn

    @property
    def deadline(self) -> float | None:
        """time.monotonic() deadline of the request in flight (None: none, or no deadline)."""
        return self._pending[0] if self._pending is not None else None

    # ---- requests

    def start(self) -> None:
        """Fork the child now (submit does it when none is running)."""
        if self._proc is not None:
            return
        ctx = mp.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, name=self.name, daemon=self.daemon,
                                 args=(self.handler, child, self._conn, self.on_start))  # fmt: skip
        self._proc.start()
        child.close()
        self._ended = _end_watch(self._proc)
        self._owner = os.getpid()  # kill() / close() act here only, never in a forked copy
        _OPEN.add(self)

    def submit(self, request: Any, timeout_s: float | None = None) -> Outcome | None:
        """Send `request` (forking a child first if none runs); its outcome comes from collect().
        Returns the outcome at once (and nothing is in flight) if it cannot be sent."""
        if self._pending is not None:
            raise RuntimeError(f"{self.name}: a request is already in flight")
        try:
            data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # nothing was written: the child is still usable
            return Raised(f"the request cannot be sent to the worker: {describe(exc)}")
        self.start()
        try:
            self.connection.send_bytes(data)
        except OSError:  # the child is gone
            return Died(self._reap())
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._pending = (deadline, timeout_s)
        return None

    def collect(self) -> Outcome:
        """The outcome of the request in flight: waits for the reply up to its deadline (kills the
        tree past it), or returns at once if the reply is there or the deadline has passed."""
        if self._pending is None:
            raise RuntimeError(f"{self.name}: no request in flight")
        (deadline, timeout_s), self._pending = self._pending, None
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        # the pipe, or the child's end: a descendant of a dead child may hold its end of the pipe
        # open (no EOF), so the child's end is watched too
        ready = wait([self.connection, self._ended], remaining)
        if not ready:
            self.kill()
            return TimedOut(float(timeout_s))  # type: ignore[arg-type]
        if self.connection not in ready and not self.connection.poll():
            return Died(self._reap())
        try:
            data = self.connection.recv_bytes()
        except (EOFError, OSError):
            return Died(self._reap())
        try:
            reply = _RestrictedUnpickler(data, self.allowed).load()
            kind = reply[0]
            if kind == "ok" and len(reply) == 2:
                return Ok(reply[1])
            if kind == "raised" and len(reply) == 3:
                return Raised(str(reply[1]), str(reply[2]))
            raise ValueError(f"a reply of kind {kind!r} and length {len(reply)}")
        except Exception as exc:  # the child is not behaving: end it
            self.kill()
            return Raised(f"the worker's reply was refused: {describe(exc)}")

    def call(self, request: Any, timeout_s: float | None = None) -> Outcome:
        """submit + collect."""
        failed = self.submit(request, timeout_s)
        return failed if failed is not None else self.collect()

    # ---- ending

    def kill(self) -> None:
        """SIGKILL the child and every process it started; the next submit forks a new one."""
        proc, conn, self._proc, self._conn, self._pending = self._proc, self._conn, None, None, None
        ended, self._ended = self._ended, None
        _OPEN.discard(self)
        if proc is None or self._owner != os.getpid():  # a copy in a forked process: not ours
            return
        if proc.pid is not None and proc.exitcode is None:  # not reaped: the pid is still ours
            kill_tree(proc.pid)
        proc.join(timeout=5)
        conn.close()
        if isinstance(ended, int):
            os.close(ended)

    def close(self) -> None:
        """Ask the child to stop, wait up to grace_s, then kill what is left of its tree."""
        if self._proc is None or self._owner != os.getpid():
            return
        if self._pending is None:  # a busy child would read the stop after its request
            try:
                self.connection.send_bytes(_STOP)
                self._proc.join(timeout=self.grace_s)
            except OSError:
                pass
        self.kill()

    def _reap(self) -> int | None:
        """The child closed its pipe: wait for its exit code, kill its tree if it lingers."""
        proc = self._proc
        proc.join(timeout=1)
        code = proc.exitcode
        self.kill()
        return code if code is not None else proc.exitcode

    def __enter__(self) -> ForkedWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.kill()
        except Exception:
            pass


def wait_ready(workers: Iterable[ForkedWorker], timeout_s: float | None) -> list[ForkedWorker]:
    """The busy workers among `workers` whose reply (or end) can be collected without waiting,
    after waiting up to timeout_s for at least one."""
    busy = {}
    for w in workers:
        if w.busy:  # the pipe and the child's sentinel (see collect)
            busy[w.connection] = busy[w._ended] = w
    ready = wait(list(busy), timeout_s) if busy else []
    return list(dict.fromkeys(busy[r] for r in ready))
