"""Run untrusted Python (model-written code, tool calls) with the kernel as the boundary.

`run_python(code, *, timeout_s, memory_mb, stdin, isolation, ...) -> SandboxResult`. Modes
("auto" picks the first that works of "namespaces", "bwrap"; "trusted" is never picked):

- the code runs as a fresh `python -I -S` in new mount, PID, network, IPC, UTS and cgroup
  namespaces (plus a user namespace under bwrap); as a uid of its own (run.CALL_UIDS) with no
  capability, an empty bounding set and no_new_privs when the trainer is root;
- its root is a fresh read-only tmpfs holding only binds of the interpreter, its standard library,
  the system libraries (and site-packages with libraries="site-packages"), a minimal /dev (null,
  zero, random, urandom), the PID namespace's /proc (sys read-only) and one size-bounded tmpfs at
  /tmp (cwd, HOME, TMPDIR): the only writable place, gone with the mount namespace;
- a seccomp filter (seccomp.py) denies ptrace, mounts, namespaces, pidfds, bpf, keyrings,
  io_uring, perf, modules, non-unix sockets, ...;
- a per-call cgroup (cgroups.py, v1 or v2) bounds memory (tmpfs and memfds included), tasks and
  CPU, and is killed whole at the end; rlimits bound each process (CPU time, address space, file
  size, open files);
- the keeper process (keeper.py) kills the call when the trainer dies (parent-death signal) and
  removes its cgroup; the cgroups of dead owners are reaped at the next call;
- PEP 578 audit hooks (runner.py) stay as defence in depth only.
The threat model (what is promised, where, and what is not) is in the README's Reliability section;
tests/test_sandbox_hostile.py is the attack suite. A failure of the sandbox itself raises
SandboxSetupError: our bug or the machine's, never a silent 0 reward. Linux only.
"""

from grouprl.envs.sandbox.layout import Libraries
from grouprl.envs.sandbox.result import Isolation, Reason, SandboxResult, SandboxSetupError
from grouprl.envs.sandbox.run import (
    DISK_MB,
    EXTRA_TASKS,
    FSIZE_MB,
    OUTPUT_CAP,
    run_python,
)

__all__ = [
    "DISK_MB",
    "EXTRA_TASKS",
    "FSIZE_MB",
    "OUTPUT_CAP",
    "Isolation",
    "Libraries",
    "Reason",
    "SandboxResult",
    "SandboxSetupError",
    "run_python",
]
