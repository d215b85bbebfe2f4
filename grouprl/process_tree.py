"""Ending a worker process together with everything it started, daemons included.

A forked worker (an isolated reward, an env in its own process) runs user code, and user code may
start processes that leave its process tree the classic way: fork, setsid, fork again, and the
middle process exits. The grandchild, in a session of its own, is then re-parented to the nearest
"child subreaper" ancestor, or to init, where killing the worker never reaches it. So:

- `become_subreaper()` is called first thing in the worker (Linux prctl PR_SET_CHILD_SUBREAPER):
  orphans of the worker's descendants are re-parented to the worker, and stay in its tree; it
  also asks the kernel to SIGKILL the worker when its parent (the trainer) dies
  (PR_SET_PDEATHSIG);
- `kill_tree(pid)` stops the worker and every descendant (SIGSTOP, repeated until no new process
  appears, so nothing forks while it is collected), then SIGKILLs them all.

Limits: a process that escapes before kill_tree runs is in the tree as long as the worker lives;
if the trainer itself is SIGKILLed, the worker dies (parent-death signal) but its daemons are
re-parented to init and keep running (the sandbox, grouprl/envs/sandbox, uses cgroups for
model-written code). Elsewhere than Linux both are no-ops beyond killing `pid` itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the reaper of its descendants' orphans and die with its parent (Linux);
    returns whether it worked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        return ok
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


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and all its descendants (frozen first so that none forks meanwhile)."""
    frozen: list[int] = []
    for _ in range(20):  # each round stops what the previous one found; a stopped process
        new = [p for p in [pid, *descendants(pid)] if p not in frozen]  # cannot fork
        if not new:
            break
        for p in new:
            _signal(p, signal.SIGSTOP)
        frozen += new
    for p in frozen:
        _signal(p, signal.SIGKILL)
