"""The forked-worker primitive (grouprl/runtime/workers.py): deadlines, crashes, process trees,
restarts, close() and the restricted loading of replies."""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from daemons import spawn_daemon

from grouprl.runtime.process_tree import descendants
from grouprl.runtime.workers import (
    Died,
    ForkedWorker,
    Ok,
    Raised,
    TimedOut,
    safe_loads,
    wait_ready,
)

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


def handler(request):
    """The test handler: request (what, argument)."""
    what, arg = request
    if what == "echo":
        return arg
    if what == "pid":
        return os.getpid()
    if what == "loop":
        while True:  # stuck in a loop, never sleeping
            pass
    if what == "exit":
        os._exit(arg)
    if what == "signal":
        faulthandler.disable()  # pytest's crash report of the child is noise here
        os.kill(os.getpid(), arg)
        time.sleep(10)
    if what == "raise":
        raise KeyError(arg)
    if what == "daemon":
        return spawn_daemon(Path(arg))
    if what == "evil":  # a reply that would run code when unpickled by plain pickle
        return _Evil()
    if what == "unpicklable":
        return lambda: None
    raise AssertionError(what)


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


@pytest.fixture
def worker():
    w = ForkedWorker(handler, name="grouprl-test-worker")
    yield w
    w.close()


def test_ok_and_an_exceptions_text_reaches_the_parent(worker):
    assert worker.call(("echo", {"a": [1, 2.5, None, "x"]})) == Ok({"a": [1, 2.5, None, "x"]})
    out = worker.call(("raise", "missing state"))
    assert isinstance(out, Raised) and out.error == "KeyError: 'missing state'"
    assert "KeyError: 'missing state'" in out.traceback and "def handler" not in out.error
    assert "in handler" in out.traceback  # the child's own traceback
    assert worker.call(("echo", 3)) == Ok(3)  # a raising handler leaves the worker usable


def test_a_worker_stuck_in_a_loop_is_killed_at_its_deadline(worker):
    pid = worker.call(("pid", None)).value
    start = time.monotonic()
    out = worker.call(("loop", None), timeout_s=0.5)
    assert out == TimedOut(0.5)
    assert 0.5 <= time.monotonic() - start < 5
    assert not _alive(pid) and worker.pid is None


@pytest.mark.parametrize(
    ("request_", "exitcode"),
    [(("exit", 9), 9), (("signal", signal.SIGSEGV), -signal.SIGSEGV)],
)
def test_a_crash_is_reported_with_its_exit_code_or_signal(worker, request_, exitcode):
    out = worker.call(request_, timeout_s=20)
    assert out == Died(exitcode)
    if exitcode < 0:
        assert out.signal == signal.SIGSEGV and "SIGSEGV" in out.describe()
    else:
        assert out.signal is None and "exit code 9" in out.describe()


def test_restart_after_each_kind_of_failure(worker):
    pids = [worker.call(("pid", None)).value]
    for failing in (("loop", None), ("exit", 3), ("signal", signal.SIGKILL), ("evil", None)):
        assert not isinstance(worker.call(failing, timeout_s=1.0), Ok)
        assert worker.pid is None  # no child until the next request
        out = worker.call(("pid", None))
        assert isinstance(out, Ok) and out.value not in pids  # a fresh child
        assert not any(_alive(p) for p in pids)
        pids.append(out.value)


def test_a_daemonised_grandchild_is_killed_with_the_tree(worker, tmp_path):
    daemon = worker.call(("daemon", str(tmp_path / "d1.pid"))).value
    assert _alive(daemon) and daemon in descendants(worker.pid)  # the worker is its subreaper
    assert isinstance(worker.call(("loop", None), timeout_s=0.3), TimedOut)
    assert not _alive(daemon)


def test_a_dead_worker_is_seen_even_when_its_daemon_holds_the_pipe(worker, tmp_path):
    """The daemon inherited the worker's end of the pipe: no EOF comes when the worker dies, the
    child's sentinel tells. (Its daemon, re-parented away from the dead worker, is out of reach:
    process_tree's documented limit; the test ends it by pid.)"""
    daemon = worker.call(("daemon", str(tmp_path / "d.pid"))).value
    try:
        start = time.monotonic()
        assert worker.call(("exit", 1), timeout_s=None) == Died(1)  # no deadline: it would hang
        assert time.monotonic() - start < 10
        assert worker.call(("echo", 2)) == Ok(2)
    finally:
        os.kill(daemon, signal.SIGKILL)


def test_close_leaves_no_process(tmp_path):
    worker = ForkedWorker(handler, grace_s=2.0)
    pid = worker.call(("pid", None)).value
    daemon = worker.call(("daemon", str(tmp_path / "d.pid"))).value
    worker.close()
    assert not _alive(pid) and not _alive(daemon) and worker.pid is None
    assert pid not in descendants(os.getpid())
    # a busy worker (stuck) is closed too: its tree is killed after the grace period
    worker.submit(("loop", None))
    busy = worker.pid
    worker.close()
    assert not _alive(busy) and descendants(os.getpid()) == []


def test_a_reply_that_would_run_code_is_refused_and_the_worker_killed(worker):
    pid = worker.call(("pid", None)).value
    out = worker.call(("evil", None))
    assert isinstance(out, Raised) and "refused" in out.error and "system" in out.error
    assert not _alive(pid)
    out = worker.call(("unpicklable", None))
    assert isinstance(out, Raised) and out.error.startswith("the reply cannot be sent back")
    assert worker.call(("echo", 1)) == Ok(1)


def test_an_unsendable_request_fails_without_touching_the_worker(worker):
    pid = worker.call(("pid", None)).value
    out = worker.submit(("echo", lambda: 1))
    assert isinstance(out, Raised) and "cannot be sent" in out.error and not worker.busy
    assert worker.call(("pid", None)) == Ok(pid)


def test_replies_carry_tensors_and_numpy_and_allowed_classes_only():
    value = {"t": torch.arange(6.0).view(2, 3)[:, 1:], "np": np.random.get_state(),
             "s": np.float32(1.5), "dtype": torch.bfloat16, "set": {1, 2}}  # fmt: skip
    out = safe_loads(pickle.dumps(value, protocol=5))
    assert torch.equal(out["t"], value["t"]) and out["dtype"] is torch.bfloat16
    assert type(out["s"]) is np.float32 and np.array_equal(out["np"][1], value["np"][1])
    assert out["set"] == {1, 2}
    with pytest.raises(pickle.UnpicklingError, match="Ok is not allowed"):
        safe_loads(pickle.dumps(Ok(1)))
    assert safe_loads(pickle.dumps(Ok(1)), allowed=[Ok]) == Ok(1)
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        safe_loads(pickle.dumps(np.random.default_rng(0)))


def test_several_workers_with_their_own_deadlines():
    workers = [ForkedWorker(handler) for _ in range(3)]
    try:
        workers[0].submit(("loop", None), timeout_s=0.5)
        workers[1].submit(("echo", "b"), timeout_s=20)
        workers[2].submit(("raise", "c"), timeout_s=20)
        ready = []
        while len(ready) < 2:
            ready += [w for w in wait_ready(workers, 5.0) if w not in ready]
        assert set(ready) == {workers[1], workers[2]}
        assert workers[1].collect() == Ok("b")
        assert isinstance(workers[2].collect(), Raised)
        assert workers[0].busy and workers[0].collect() == TimedOut(0.5)
    finally:
        for w in workers:
            w.close()


def test_a_forked_copy_of_a_worker_never_kills_the_real_one(worker):
    pid = worker.call(("pid", None)).value
    other = ForkedWorker(lambda _: worker.kill())  # runs in another child, on its copy
    try:
        assert other.call(None, timeout_s=20) == Ok(None)
        assert _alive(pid) and worker.call(("pid", None)) == Ok(pid)
    finally:
        other.close()
