"""Per-call cgroups: the totals of one sandbox call (memory incl. tmpfs and memfds, tasks, CPU).

Where: the first of (1) cgroup v2 with the memory, pids and cpu controllers available (pure v2
machines), (2) cgroup v1 hierarchies with memory and pids (cpu and freezer used when mounted),
found from /proc/self/mountinfo. A hybrid machine whose v2 hierarchy has no controllers (the one
this was written on: v1 memory / pids / cpu / freezer, an empty v2 at /sys/fs/cgroup/unified) uses
v1. Each call gets `<hierarchy>/grouprl-sandbox/<owner pid>-<owner start time>-<n>`:
- v2: memory.max, memory.swap.max = 0, memory.oom.group = 1, pids.max, cpu.max;
- v1: memory.limit_in_bytes (+ memory.memsw.limit_in_bytes where swap accounting exists),
  pids.max, cpu.cfs_quota_us / cfs_period_us.
Shared memory (tmpfs files, memfds) is charged to the memory cgroup of the process that first
touches the page, so the code's /tmp and memfds count against memory.max.

Killing and removing (keeper.kill_cgroup) happens in the keeper process at the end of the call and
when the trainer dies; `reap_stale` removes the groups of owners that are gone (a keeper killed
too) at the next call.
"""

from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass
from functools import lru_cache

from grouprl.envs.sandbox.keeper import kill_cgroup

BASE = "grouprl-sandbox"
NEEDED = ("memory", "pids")
_counter = itertools.count()
_lock = threading.Lock()


class CgroupUnavailable(RuntimeError):
    """No writable cgroup hierarchy with the memory and pids controllers."""


@dataclass(frozen=True)
class Hierarchies:
    v2: str | None  # mount point of the v2 hierarchy, when it has memory, pids and cpu
    v1: dict[str, str]  # controller -> mount point (v1)


def _mountinfo() -> list[tuple[str, str, str]]:
    """(mount point, fs type, super options) of every cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _, opts = (right.split() + ["", "", ""])[:3]
            if fstype in ("cgroup", "cgroup2"):
                out.append((left.split()[4], fstype, opts))
    return out


@lru_cache(maxsize=1)
def hierarchies() -> Hierarchies:
    v2, v1 = None, {}
    for point, fstype, opts in _mountinfo():
        if fstype == "cgroup2":
            try:
                with open(os.path.join(point, "cgroup.controllers")) as f:
                    have = set(f.read().split())
            except OSError:
                continue
            if {"memory", "pids", "cpu"} <= have and os.access(point, os.W_OK):
                v2 = point
        else:
            for ctrl in ("memory", "pids", "cpu", "freezer"):
                if ctrl in opts.split(",") and os.access(point, os.W_OK):
                    v1.setdefault(ctrl, point)
    return Hierarchies(v2, v1)


def available() -> str | None:
    """'v2', 'v1', or None (then the reason is in `why_unavailable`)."""
    h = hierarchies()
    if h.v2:
        return "v2"
    return "v1" if all(c in h.v1 for c in NEEDED) else None


def why_unavailable() -> str:
    h = hierarchies()
    return (
        "no writable cgroup hierarchy with the memory and pids controllers (v2 with memory, pids, "
        f"cpu; or v1 memory + pids); found v2={h.v2!r}, v1={sorted(h.v1)} (running as uid "
        f"{os.geteuid()}: per-call cgroups need root or a delegated hierarchy)"
    )


def process_start_time(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks since boot, field 22 of /proc/PID/stat) as
    text, None when there is no such process. With the pid it names one process for good: a reused
    pid has another start time, so "pid-start" tags of cgroups and directories never match a
    stranger."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _base_dirs() -> list[str]:
    h = hierarchies()
    if h.v2:
        return [os.path.join(h.v2, BASE)]
    return [os.path.join(point, BASE) for point in dict.fromkeys(h.v1.values())]


def _ensure_v2_base(root: str) -> str:
    base = os.path.join(root, BASE)
    with _lock:
        want = {"memory", "pids", "cpu"}
        with open(os.path.join(root, "cgroup.subtree_control")) as f:
            on = set(f.read().split())
        if not want <= on:
            _write(os.path.join(root, "cgroup.subtree_control"), " ".join(f"+{c}" for c in want))
        os.makedirs(base, exist_ok=True)
        with open(os.path.join(base, "cgroup.subtree_control")) as f:
            on = set(f.read().split())
        if not want <= on:
            _write(os.path.join(base, "cgroup.subtree_control"), " ".join(f"+{c}" for c in want))
    return base


def create(memory_bytes: int, tasks: int, cpus: float) -> dict:
    """A fresh cgroup for one call, limits set; the dict is what keeper.kill_cgroup takes."""
    h = hierarchies()
    name = f"{os.getpid()}-{process_start_time(os.getpid())}-{next(_counter)}"
    period = 100_000
    quota = max(1000, int(cpus * period))
    if h.v2:
        d = os.path.join(_ensure_v2_base(h.v2), name)
        os.mkdir(d)
        cg = {"v2": True, "dirs": [d], "memory": d, "freezer": None}
        try:
            _write(os.path.join(d, "memory.max"), str(memory_bytes))
            if os.path.exists(os.path.join(d, "memory.swap.max")):
                _write(os.path.join(d, "memory.swap.max"), "0")
            _write(os.path.join(d, "memory.oom.group"), "1")
            _write(os.path.join(d, "pids.max"), str(tasks))
            _write(os.path.join(d, "cpu.max"), f"{quota} {period}")
        except BaseException:
            kill_cgroup(cg)
            raise
        return cg
    dirs: dict[str, str] = {}
    cg = {"v2": False, "dirs": [], "memory": "", "freezer": None}
    try:
        for ctrl in ("memory", "pids", "cpu", "freezer"):
            if ctrl not in h.v1:
                continue
            point = h.v1[ctrl]
            if point not in dirs:
                os.makedirs(os.path.join(point, BASE), exist_ok=True)
                dirs[point] = os.path.join(point, BASE, name)
                os.mkdir(dirs[point])
                cg["dirs"].append(dirs[point])
            d = dirs[point]
            if ctrl == "memory":
                cg["memory"] = d
                _write(os.path.join(d, "memory.limit_in_bytes"), str(memory_bytes))
                if os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(d, "memory.memsw.limit_in_bytes"), str(memory_bytes))
            elif ctrl == "pids":
                _write(os.path.join(d, "pids.max"), str(tasks))
            elif ctrl == "cpu":
                _write(os.path.join(d, "cpu.cfs_period_us"), str(period))
                _write(os.path.join(d, "cpu.cfs_quota_us"), str(quota))
            else:
                cg["freezer"] = d
    except BaseException:
        kill_cgroup(cg)
        raise
    return cg


def reap_stale() -> list[str]:
    """Kill and remove the call cgroups whose owner process is gone; returns their names."""
    gone = []
    for base in _base_dirs():
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            parts = name.split("-")
            if len(parts) != 3 or not parts[0].isdigit():
                continue
            if process_start_time(int(parts[0])) == parts[1]:
                continue  # the owner lives (its keeper cleans up)
            dirs = [os.path.join(b, name) for b in _base_dirs()]
            h = hierarchies()
            freezer = os.path.join(h.v1["freezer"], BASE, name) if "freezer" in h.v1 else None
            cg = {"v2": bool(h.v2), "dirs": [d for d in dirs if os.path.isdir(d)]}
            cg |= {"memory": dirs[0], "freezer": freezer if freezer in cg["dirs"] else None}
            try:
                kill_cgroup(cg)
                gone.append(name)
            except OSError:
                continue
    return gone
