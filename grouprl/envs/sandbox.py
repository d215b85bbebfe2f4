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
Linux only (namespaces, /proc, waitid). The child side is this same file run as a script.
"""

from __future__ import annotations

import json
import math
import os
import resource
import selectors
import shutil
import signal
import sys
import tempfile
import time
import traceback
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


# ------------------------------------------------------------------------------- parent side
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


# isolation mode -> command prefix before `python -I sandbox.py CONFIG` (may raise when unavailable)
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
            [*prefix, sys.executable, "-I", os.path.abspath(__file__), json.dumps(cfg)],
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


# -------------------------------------------------------------------------------- child side
# Everything below runs in the child (`python -I sandbox.py CONFIG`), before the user's code.
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_NOATIME, MS_NODIRATIME, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 16384, 1 << 18, 1 << 21
_MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
_MOUNT_FLAGS |= {"noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def call(name: str, *args) -> int:
        if (rc := getattr(libc, name)(*args)) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{name}{args!r:.120}: {os.strerror(errno)}")
        return rc

    return call, ctypes


def _exit_like(status: int) -> None:
    """Leave this process the way a child with wait status `status` left (same code or signal)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _read_only_world(call, work: bytes) -> None:
    """In a fresh mount namespace: own /proc, then every mount read-only except `work`."""
    call("mount", b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    call("mount", work, work, None, MS_BIND, None)
    with open("/proc/self/mountinfo", "rb") as f:
        mounts = [line.split() for line in f]
    for m in mounts:  # m[4]: mount point ("\\040" escapes a space), m[5]: per-mount options
        point = m[4].decode("unicode_escape").encode("latin-1")
        flags = sum(_MOUNT_FLAGS.get(o, 0) for o in m[5].decode().split(","))
        if point != work:
            call("mount", None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags, None)


def _enter_namespaces(cfg: dict) -> None:
    """outer -> init (pid 1 of new PID/mount/net namespaces) -> runner; only the runner returns.

    init relays the runner's wait status through a pipe (pid 1 cannot die of its own signal), and
    the outer process leaves the same way, so the parent sees the runner's exit code or signal.
    """
    call, ctypes = _libc()
    if cfg["cgroup"]:  # join first: init and runner inherit it
        with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    call("unshare", CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET)
    call("mount", b"none", b"/", None, MS_REC | MS_PRIVATE, None)
    status_r, status_w = os.pipe()
    if init := os.fork():  # outer
        os.close(cfg["ready_fd"])
        os.close(status_w)
        status = os.waitpid(init, 0)[1]
        relayed = os.read(status_r, 32)
        _exit_like(int(relayed) if relayed else status)
    os.close(status_r)
    _read_only_world(call, cfg["work"].encode())
    if runner := os.fork():  # init
        os.close(cfg["ready_fd"])
        os.write(status_w, str(os.waitpid(runner, 0)[1]).encode())
        os._exit(0)
    os.close(status_w)
    call("prctl", 38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    for cap in range(64):  # PR_CAPBSET_DROP; past the kernel's last capability it fails: stop
        try:
            call("prctl", 24, cap, 0, 0, 0)
        except OSError:
            break
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    call("capset", header, (ctypes.c_uint32 * 6)())  # no effective/permitted/inheritable caps


# isolation mode -> what the child does before limits and hooks
_CHILD_SETUP: dict[str, Callable[[dict], None]] = {
    "namespaces": _enter_namespaces,
    "bwrap": lambda cfg: None,
    "hooks": lambda cfg: None,
}


def _tasks_of_uid(uid: int) -> int:
    """Processes + threads this uid runs now (RLIMIT_NPROC counts them all, machine-wide)."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return n


def _set_limits(cfg: dict) -> None:
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = math.ceil(used.ru_utime + used.ru_stime) + cfg["cpu_s"]
    tasks = (0 if os.getuid() == 0 else _tasks_of_uid(os.getuid())) + EXTRA_TASKS
    for limit, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU, then SIGKILL a second later
        (resource.RLIMIT_FSIZE, (FSIZE_MB << 20,) * 2),
        (resource.RLIMIT_NOFILE, (64, 64)),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_NPROC, (tasks, tasks)),  # not enforced for root: see the pids cgroup
        (resource.RLIMIT_AS, (cfg["memory_mb"] << 20,) * 2),
    ):
        resource.setrlimit(limit, value)


_FORBIDDEN = frozenset(
    {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.setns"}
    | {"subprocess.Popen", "os.killpg", "resource.setrlimit", "resource.prlimit", "os.symlink"}
    | {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto"}
    | {"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames"}
)
_PATH_EVENTS = frozenset(
    {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.link", "os.chmod", "os.chown"}
    | {"os.truncate", "os.utime", "shutil.rmtree", "os.mkfifo", "os.mknod", "os.setxattr"}
    | {"os.removexattr", "os.chflags", "os.lchflags"}
)
_NO_IMPORT = frozenset({"_posixsubprocess"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _install_hooks(work: str, os_boundary: bool) -> None:
    """PEP 578 audit hooks (see the module docstring). Everything the hook uses is captured here,
    immutable, so user code cannot loosen it by patching modules."""
    import _posixsubprocess  # imported by subprocess (so by sympy ...): keep it, disarmed

    def refuse(*args, **kwargs):
        raise PermissionError("sandbox: process creation is not allowed")

    _posixsubprocess.fork_exec = refuse  # it raises no audit event; a re-import is refused below
    if os_boundary:  # ctypes can get past audit hooks, not past the OS layers; sympy needs it
        import ctypes  # noqa: F401  (imported now: importing it later would need ctypes.dlopen)
    else:  # hooks alone: ctypes (and so sympy) cannot be imported at all
        for name in [m for m in sys.modules if m.partition(".")[0] in ("ctypes", "_ctypes")]:
            del sys.modules[name]
    no_import = _NO_IMPORT if os_boundary else _NO_IMPORT | {"ctypes", "_ctypes"}
    realpath, fsdecode, getpid, sep = os.path.realpath, os.fsdecode, os.getpid, os.sep
    me = str(getpid())
    home = realpath(os.path.expanduser("~root" if os.getuid() == 0 else "~")) + sep
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, *filter(None, sys.path)}
    code_dirs = tuple(realpath(p) + sep for p in roots)
    mine, devnull = work + sep, os.devnull

    def hook(event: str, args: tuple) -> None:
        if event in _FORBIDDEN or event.startswith("ctypes."):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "os.kill" and args[0] != getpid():
            raise PermissionError("sandbox: signals to other processes are not allowed")
        if event == "import" and args[0].partition(".")[0] in no_import:  # ImportError: numpy
            raise ImportError(f"sandbox: importing {args[0]} is not allowed")  # copes without
        if event == "object.__setattr__" and args[1] in ("__code__", "__closure__"):
            raise PermissionError(f"sandbox: setting {args[1]} is not allowed")
        if event == "open" and args[0] is not None and not isinstance(args[0], int):
            real = realpath(fsdecode(args[0])) + sep
            mode, flags = args[1] or "", args[2] or 0
            if any(c in mode for c in "wax+") or flags & _WRITE_FLAGS:
                if not (real.startswith(mine) or real == devnull + sep):
                    raise PermissionError(f"sandbox: writing {args[0]!r} outside {work}")
            elif real.startswith(home) and not real.startswith(code_dirs):
                raise PermissionError(f"sandbox: reading {args[0]!r} is not allowed")
            elif real.startswith("/proc/") and real.split(sep)[2] not in (me, "self"):
                if real.split(sep)[2].isdigit():  # another process's environ, memory ...
                    raise PermissionError(f"sandbox: reading {args[0]!r} is not allowed")
        if event in _PATH_EVENTS and any(
            isinstance(a, str | bytes) and not (realpath(fsdecode(a)) + sep).startswith(mine)
            for a in args[:2]
        ):
            raise PermissionError(f"sandbox: {event} outside {work}")

    sys.addaudithook(hook)


def _child_main(cfg: dict) -> None:
    ready_fd = cfg["ready_fd"]
    try:
        _CHILD_SETUP[cfg["mode"]](cfg)
        os.chdir(cfg["work"])
        with open("main.py", encoding="utf-8") as f:
            source = f.read()
        _set_limits(cfg)
        if cfg["hooks"]:
            _install_hooks(cfg["work"], os_boundary=cfg["mode"] != "hooks")
    except BaseException as e:
        os.write(2, f"sandbox set-up failed: {e!r}\n".encode())
        os._exit(70)
    os.write(ready_fd, b"R")
    os.close(ready_fd)
    try:
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py"})
    except SystemExit:
        raise
    except MemoryError:
        sys.stdout.flush()
        print(
            f"MemoryError: the sandbox memory limit ({cfg['memory_mb']} MB) was hit",
            file=sys.stderr,
        )
        sys.stderr.flush()
        os._exit(_MEMORY_EXIT)
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)


if __name__ == "__main__":
    _child_main(json.loads(sys.argv[1]))
