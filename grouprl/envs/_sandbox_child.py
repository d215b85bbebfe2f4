"""The child side of `grouprl.envs.sandbox.run_python`: what runs before the user's code.

`run_python` starts this file as a script, `python -I _sandbox_child.py CONFIG`. CONFIG is JSON
from the parent, which owns every limit: the private directory, the isolation mode, the pids
cgroup, whether to install the audit hooks, the limits (cpu_s, memory_mb, extra_tasks, fsize_mb),
the exit code that reports running out of memory (memory_exit) and the fd of the "ready" pipe.

In this order, the child: sets up the OS isolation of its mode (for "namespaces": joins the pids
cgroup, new mount / PID / network namespaces, its own /proc, every mount read-only except the
private directory, no capabilities, no_new_privs), sets the rlimits, installs the PEP 578 audit
hooks, writes one byte to the ready pipe (the user's wall clock starts there) and runs main.py.
A failure before the ready byte exits 70 (the parent raises SandboxSetupError); a MemoryError of
the user code exits with memory_exit so the parent can report reason "memory".

Only the standard library is imported here, nothing from grouprl: the child loads nothing it does
not need before the user's code, and sandbox.py runs this file by path without importing it. The
isolation design and its limits are described in grouprl/envs/sandbox.py.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import sys
import traceback
from collections.abc import Callable

# mount(2) and unshare(2) flags (linux/mount.h, linux/sched.h)
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
    tasks = (0 if os.getuid() == 0 else _tasks_of_uid(os.getuid())) + cfg["extra_tasks"]
    for limit, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU, then SIGKILL a second later
        (resource.RLIMIT_FSIZE, (cfg["fsize_mb"] << 20,) * 2),
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
    """PEP 578 audit hooks (see the docstring of grouprl/envs/sandbox.py). Everything the hook
    uses is captured here, immutable, so user code cannot loosen it by patching modules."""
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
        os._exit(cfg["memory_exit"])
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)


if __name__ == "__main__":
    _child_main(json.loads(sys.argv[1]))
