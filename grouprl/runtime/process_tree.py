"""Ending a worker process together with everything it started, daemons included.

A forked worker (an isolated reward, an env in its own process) runs user code, and user code may
start processes that leave its process tree the classic way: fork, setsid, fork again, and the
middle process exits. The grandchild, in a session of its own, is then re-parented to the nearest
"child subreaper" ancestor, or to init, where killing the worker never reaches it. So:

- `become_subreaper()` is called first thing in the worker (Linux prctl PR_SET_CHILD_SUBREAPER):
  orphans of the worker's descendants are re-parented to the worker, and stay in its tree;
- `kill_tree(pid)` stops the worker and every descendant (SIGSTOP, repeated until no new process
  appears, so nothing forks while it is collected), then SIGKILLs them all; a worker that ends by
  itself (its pipe to the trainer closed: the trainer ended or was SIGKILLed; an env's close)
  first does the same to its own descendants (`kill_tree(os.getpid(), include_root=False)`).

Limits: a worker that dies abruptly (segfault, os._exit in user code) hands its daemons to the
trainer's nearest subreaper or init before anyone can kill them; a worker stuck in user code when
the trainer is SIGKILLed never sees its pipe close (no parent-death signal: Linux ties it to the
thread that forked, and workers are forked from rollout / env pool threads that come and go). The sandbox for
model-written code (grouprl/envs/sandbox) uses cgroups for that. Elsewhere than Linux both
functions do nothing beyond killing `pid` itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the reaper of its descendants' orphans (Linux); returns whether it
    worked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) ": state ppid ...
        if len(fields) > 1:
            out[int(entry)] = int(fields[1])
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children ...), from /proc."""
    if not os.path.isdir("/proc"):
        return []
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _gone(pid: int) -> bool:
    """Dead: no such process, or a zombie (killed, waiting for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2 :][:1] in (b"Z", b"X")


def kill_tree(pid: int, *, include_root: bool = True, wait_s: float = 2.0) -> None:
    """SIGKILL all descendants of `pid` (and `pid` itself unless include_root=False), frozen
    first so that none forks meanwhile; waits up to wait_s for them to be dead."""
    frozen: list[int] = []
    for _ in range(20):  # each round stops what the previous one found; a stopped process
        found = [pid, *descendants(pid)] if include_root else descendants(pid)  # cannot fork
        new = [p for p in found if p not in frozen]
        if not new:
            break
        for p in new:
            _signal(p, signal.SIGSTOP)
        frozen += new
    for p in frozen:
        _signal(p, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while os.path.isdir("/proc") and time.monotonic() < deadline:
        if all(_gone(p) for p in frozen):
            break
        time.sleep(0.01)
