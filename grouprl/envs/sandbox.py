"""Run untrusted Python (model-written code, tool calls) in a contained child process.

`run_python(code, *, timeout_s, memory_mb, stdin) -> SandboxResult`. Every call: a fresh
`python -I` (no PYTHON* variables, no user site, no script dir on sys.path) in its own session and
process group; a private temporary working directory, deleted afterwards; an environment of a few
fixed variables (nothing inherited: no secrets, no PATH); stdout and stderr read as they come and
capped; a wall-clock timeout that SIGKILLs the whole group; rlimits (RLIMIT_AS = memory_mb,
RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_NPROC, no core files). OS isolation, by mode:

- "namespaces" (root; what "auto" picks first): a new network namespace (no interface up: no
  network), a mount namespace where every mount is remounted read-only except the private
  directory, a new PID namespace with its own /proc (the parent is invisible; whatever the code
  leaves running dies with the namespace's init), a pids cgroup where /sys/fs/cgroup/pids is
  writable (RLIMIT_NPROC does not bind root), then all capabilities dropped and no_new_privs, so
  the code cannot undo any of it.
- "bwrap" (bubblewrap installed, e.g. non-root): read-only bind of /, a writable private directory,
  --unshare-net, --unshare-pid, --die-with-parent. (Not exercised on the machine this was written on.)
- "hooks" (neither available): rlimits and audit hooks only. Code that gets past the hooks can then
  write wherever this user may write and reach the network. "auto" warns when it lands here.
In every mode, PEP 578 audit hooks refuse (PermissionError): process creation (fork, exec, spawn,
subprocess, _posixsubprocess), signals to other processes, sockets, loading C libraries through
ctypes, rlimit changes, writes and file-system changes outside the private directory, and reads of
other processes' /proc entries or of the home directory. Audit hooks are no security boundary on
their own (CPython says so): ctypes, which gets past them, can only be imported under "namespaces"
and "bwrap" (sympy needs it), never under "hooks".

reason: "ok" (exit 0), "error" (non-zero exit), "timeout" (wall clock or CPU limit), "memory"
(MemoryError under RLIMIT_AS), "killed" (any other signal). A failure of the sandbox itself (not of
the code it runs) raises SandboxSetupError: our bug or the machine's, never a silent 0 reward.
Linux only (namespaces, /proc, waitid). This is the parent side; the child side (isolation set-up,
rlimits, audit hooks, then the user's code) is _sandbox_child.py, run as a script.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

Isolation = Literal["auto", "namespaces", "bwrap", "hooks"]
Reason = Literal["ok", "timeout", "memory", "killed", "error"]
OUTPUT_CAP = 64 * 1024  # bytes kept of stdout and of stderr each
SETUP_TIMEOUT_S = 30.0  # interpreter start + isolation set-up, before the user's clock starts
EXTRA_TASKS = 32  # processes + threads the user code may add (RLIMIT_NPROC / pids.max)
FSIZE_MB = 16  # largest file the code may write
_MEMORY_EXIT = 86  # exit code of the child when the user code ran out of memory
_PIDS_CGROUP = "/sys/fs/cgroup/pids"
# run by path, not imported: this module must also load from its file alone (as the tests do)
_CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")


class SandboxSetupError(RuntimeError):
    """The sandbox could not be set up (not a failure of the code it was asked to run)."""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one `run_python` call; stdout/stderr are decoded (utf-8, replace) and capped."""

    ok: bool
    returncode: int | None
    stdout: str
    stderr: str
    reason: Reason
    isolation: str = "hooks"
    duration_s: float = 0.0


def _bwrap_prefix(work: str) -> list[str]:
    exe = shutil.which("bwrap")
    if exe is None:
        raise SandboxSetupError("isolation='bwrap' needs bubblewrap (`bwrap` on PATH)")
    return [exe, "--die-with-parent", "--unshare-net", "--unshare-pid", "--ro-bind", "/", "/"] + [
        "--dev", "/dev", "--proc", "/proc", "--bind", work, work, "--chdir", work, "--",
    ]  # fmt: skip


def _root_required(work: str) -> list[str]:
    if os.geteuid() != 0:
        raise SandboxSetupError("isolation='namespaces' needs root; use 'bwrap' or 'hooks'")
    return []


# isolation mode -> prefix before `python -I _sandbox_child.py CONFIG` (may raise when unavailable)
_LAUNCHERS: dict[str, Callable[[str], list[str]]] = {
    "namespaces": _root_required,
    "bwrap": _bwrap_prefix,
    "hooks": lambda work: [],
}


@lru_cache(maxsize=1)
def _auto_mode() -> str:
    """The strongest mode that works here, probed once per process."""
    for mode in ("namespaces", "bwrap"):
        try:
            if run_python("print(6 * 7)", timeout_s=10, isolation=mode).stdout == "42\n":
                return mode
        except SandboxSetupError:
            continue
    warnings.warn(
        "grouprl sandbox: neither root namespaces nor bubblewrap work here; untrusted code runs "
        "with rlimits and audit hooks only (see grouprl/envs/sandbox.py)",
        stacklevel=3,
    )
    return "hooks"


def _make_cgroup(work: str, mode: str) -> str | None:
    if mode != "namespaces" or not os.access(_PIDS_CGROUP, os.W_OK):
        return None
    path = os.path.join(_PIDS_CGROUP, os.path.basename(work))
    os.mkdir(path)
    with open(os.path.join(path, "pids.max"), "w") as f:
        f.write(str(3 + EXTRA_TASKS))  # outer + init + runner + what the code may add
    return path


def _remove_cgroup(path: str | None) -> None:
    for _ in range(500):
        if path is None or not os.path.isdir(path):
            return
        try:
            os.rmdir(path)
            return
        except OSError:  # tasks left: they are ours (inside our cgroup), kill them
            with open(os.path.join(path, "cgroup.procs")) as f:
                for pid in f.read().split():
                    _signal(os.kill, int(pid), signal.SIGKILL)
            time.sleep(0.01)
    raise SandboxSetupError(f"could not remove the sandbox cgroup {path}")


def _signal(send: Callable[..., None], *args: int) -> None:
    try:
        send(*args)
    except (ProcessLookupError, PermissionError):
        pass


class _Capped:
    """Keeps the first `cap` bytes of a stream and counts the rest."""

    def __init__(self, cap: int) -> None:
        self.cap, self.data, self.dropped = cap, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        keep = max(0, self.cap - len(self.data))
        self.data += chunk[:keep]
        self.dropped += len(chunk) - min(keep, len(chunk))

    def text(self) -> str:
        out = self.data.decode("utf-8", errors="replace")
        return out + (f"\n[... {self.dropped} more bytes dropped]" if self.dropped else "")


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    stdin: str = "",
    isolation: Isolation = "auto",
    audit_hooks: Literal["on", "off"] = "on",
    output_cap: int = OUTPUT_CAP,
) -> SandboxResult:
    """Run `code` as a fresh `python -I` process in the sandbox (see the module docstring).

    timeout_s: wall-clock limit of the user code (CPU limit: the same, rounded up, + 1 s)
    memory_mb: address-space limit (RLIMIT_AS) of the user code
    stdin:     text fed to the code's standard input
    isolation: "auto" (strongest available), "namespaces", "bwrap" or "hooks"
    audit_hooks: "off" leaves the OS layers alone (for testing them; never for untrusted code)
    output_cap: bytes kept of stdout and of stderr each
    """
    if not isinstance(code, str) or not isinstance(stdin, str):
        raise TypeError("run_python takes code and stdin as str")
    if not (math.isfinite(timeout_s) and timeout_s > 0) or memory_mb < 32 or output_cap < 0:
        raise ValueError(
            f"need timeout_s > 0, memory_mb >= 32, output_cap >= 0; got {timeout_s}, {memory_mb}, "
            f"{output_cap}"
        )
    mode = _auto_mode() if isolation == "auto" else isolation
    if audit_hooks not in ("on", "off"):
        raise ValueError(f"audit_hooks must be 'on' or 'off', got {audit_hooks!r}")
    if mode not in _LAUNCHERS:
        raise ValueError(
            f"unknown isolation {isolation!r}: allowed are auto, {', '.join(_LAUNCHERS)}"
        )
    work = os.path.realpath(tempfile.mkdtemp(prefix="grouprl-sandbox-"))
    cgroup = None
    try:
        prefix = _LAUNCHERS[mode](work)
        for name, text in (("main.py", code), ("stdin.txt", stdin)):
            with open(os.path.join(work, name), "w", encoding="utf-8") as f:
                f.write(text)
        cgroup = _make_cgroup(work, mode)
        cfg = {"work": work, "mode": mode, "cgroup": cgroup, "hooks": audit_hooks == "on"}
        cfg |= {"cpu_s": math.ceil(timeout_s) + 1, "memory_mb": memory_mb}
        cfg |= {"extra_tasks": EXTRA_TASKS, "fsize_mb": FSIZE_MB, "memory_exit": _MEMORY_EXIT}
        return _supervise(prefix, cfg, timeout_s, output_cap)
    finally:
        _remove_cgroup(cgroup)
        shutil.rmtree(work, ignore_errors=True)


def _supervise(prefix: list[str], cfg: dict, timeout_s: float, cap: int) -> SandboxResult:
    """Start the child, read its output (capped), enforce the wall clock, kill its whole group."""
    import subprocess

    work, mode = cfg["work"], cfg["mode"]
    ready_r, ready_w = os.pipe()
    cfg["ready_fd"] = ready_w
    env = {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": work, "TMPDIR": work}
    env |= {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    start = time.monotonic()
    with open(os.path.join(work, "stdin.txt"), "rb") as stdin_file:
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-I", _CHILD_SCRIPT, json.dumps(cfg)],
            stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=work, env=env,
            start_new_session=True, pass_fds=(ready_w,),
        )  # fmt: skip
    os.close(ready_w)
    out, err, ready, timed_out = _Capped(cap), _Capped(cap), False, False
    sel = selectors.DefaultSelector()
    for stream, sink in ((proc.stdout, out), (proc.stderr, err)):
        sel.register(stream, selectors.EVENT_READ, sink)
    sel.register(ready_r, selectors.EVENT_READ, None)
    deadline, drain_until = start + SETUP_TIMEOUT_S, None
    try:
        while True:
            now = time.monotonic()
            if drain_until is None and now > deadline:
                timed_out = True
                break
            if drain_until is not None and (now > drain_until or not sel.get_map()):
                break
            for key, _ in sel.select(timeout=0.05):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.data is not None:
                    key.data.add(chunk)
                elif not ready:  # the child's set-up is done: the user's clock starts now
                    ready, deadline = True, time.monotonic() + timeout_s
            # exited (not reaped, so its pid still names the group): kill what it left behind
            waited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if drain_until is None and waited is not None:
                _signal(os.killpg, proc.pid, signal.SIGKILL)
                drain_until = time.monotonic() + 1.0
    finally:
        _signal(os.killpg, proc.pid, signal.SIGKILL)
        rc = proc.wait()
        sel.close()
        for f in (proc.stdout, proc.stderr):
            f.close()
        os.close(ready_r)
    if not ready:
        raise SandboxSetupError(
            f"sandbox ({mode}) failed before running the code "
            f"({'set-up timed out' if timed_out else f'exit {rc}'}): {err.text()[-2000:]}"
        )
    reason = _reason(rc, timed_out, err.data)
    return SandboxResult(
        ok=reason == "ok", returncode=None if timed_out else rc, stdout=out.text(),
        stderr=err.text(), reason=reason, isolation=mode, duration_s=time.monotonic() - start,
    )  # fmt: skip


def _reason(rc: int, timed_out: bool, stderr: bytes) -> Reason:
    if timed_out or rc == -signal.SIGXCPU:
        return "timeout"
    if rc == _MEMORY_EXIT or (rc < 0 and b"MemoryError" in stderr):
        return "memory"
    return "killed" if rc < 0 else ("error" if rc else "ok")


def __getattr__(name: str) -> int:
    """The child's mount / unshare flags (MS_*, CLONE_*) lived here: still importable from here."""
    if name.startswith(("MS_", "CLONE_")):
        from grouprl.envs import _sandbox_child

        return getattr(_sandbox_child, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
