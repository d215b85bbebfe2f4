"""Inside the sandbox: pid 1 of the call, then the user's code (run as `python -I -S -c SOURCE`).

keeper.py execs this source with a JSON config (work dir, fds, limits, hooks on/off, extra
sys.path entries). It imports only the standard library. This process forks once:
- the parent stays as the reaper: in "namespaces" and "bwrap" mode it is pid 1 of the call's PID
  namespace, which its own namespace cannot signal (the kernel drops signals to pid 1 that it has
  no handler for), so the status it reports cannot be forged by killing it. It reaps every child,
  writes the user process's raw wait status on the status fd (the keeper relays it: a SIGSEGV is
  reported as a signal, not as the 128 + n exit code bwrap would give) and exits, which kills
  whatever is left in the namespace.
- the child reads the code from the spec fd, writes it to main.py in the private directory (so
  tracebacks show the source), sets the rlimits, installs the PEP 578 audit hooks (defence in
  depth only: the kernel layers are the boundary), writes one byte on the ready fd (the user's
  wall clock starts there) and runs the code. A MemoryError exits with `memory_exit`.
"""

import json
import os
import resource
import signal
import sys
import traceback


def _set_limits(cfg):
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = int(used.ru_utime + used.ru_stime) + 1 + cfg["cpu_s"]
    for limit, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU, then SIGKILL a second later
        (resource.RLIMIT_FSIZE, (cfg["fsize_mb"] << 20,) * 2),
        (resource.RLIMIT_NOFILE, (cfg["nofile"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_AS, (cfg["memory_mb"] << 20,) * 2),
    ):
        resource.setrlimit(limit, value)
    if cfg["nproc"]:  # per uid: binds only where that uid is the sandbox's own (not root)
        resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"],) * 2)


def _install_hooks(work, kernel_boundary):
    """PEP 578 audit hooks. The hook reads no module global and no attribute of a module the code
    can reach: everything it uses is bound here, as default arguments, to immutable values or to
    C functions, so rebinding names in any module does not loosen it. Path checks still call
    os.path.realpath (Python code, patchable): they are defence in depth, not a boundary."""
    import _posixsubprocess  # imported by subprocess: keep it, disarmed

    def refuse(*args, **kwargs):
        raise PermissionError("sandbox: process creation is not allowed")

    _posixsubprocess.fork_exec = refuse  # raises no audit event; a re-import is refused below
    if kernel_boundary:  # ctypes gets past audit hooks, not past the kernel; numpy/sympy use it
        import ctypes  # noqa: F401  (imported now: importing it later needs ctypes.dlopen)
    else:
        for name in [m for m in sys.modules if m.partition(".")[0] in ("ctypes", "_ctypes")]:
            del sys.modules[name]
    forbidden = frozenset(
        {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn"}
        | {"os.setns", "os.unshare", "subprocess.Popen", "os.killpg", "resource.setrlimit"}
        | {"resource.prlimit", "socket.__new__", "socket.connect", "socket.bind"}
        | {"socket.getaddrinfo", "socket.sendto", "gc.get_objects", "gc.get_referrers"}
        | {"gc.get_referents", "sys._current_frames", "sys.addaudithook", "os.link"}
        | {"os.symlink", "sqlite3.connect", "sqlite3.enable_load_extension"}
    )
    path_events = frozenset(
        {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown"}
        | {"os.truncate", "os.utime", "shutil.rmtree", "os.mkfifo", "os.mknod", "os.setxattr"}
        | {"os.removexattr", "os.chflags", "os.lchflags"}
    )
    no_import = frozenset({"_posixsubprocess", "_sqlite3", "sqlite3"}) | (
        frozenset() if kernel_boundary else frozenset({"ctypes", "_ctypes"})
    )
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    mine, me = work + os.sep, str(os.getpid())

    def hook(
        event, args, *, forbidden=forbidden, path_events=path_events, no_import=no_import,
        write_flags=write_flags, mine=mine, devnull=os.devnull + os.sep, sep=os.sep,
        realpath=os.path.realpath, fsdecode=os.fsdecode, getpid=os.getpid, me=me,
        isinstance=isinstance, str_bytes=(str, bytes), any=any, int=int, PermissionError=PermissionError,
        ImportError=ImportError,
    ):  # fmt: skip
        if event in forbidden or event.startswith("ctypes."):
            raise PermissionError("sandbox: " + event + " is not allowed")
        if event == "os.kill" and args[0] != getpid():
            raise PermissionError("sandbox: signals to other processes are not allowed")
        if event == "import" and args[0].partition(".")[0] in no_import:
            raise ImportError("sandbox: importing " + args[0] + " is not allowed")
        if event == "object.__setattr__" and args[1] in (
            "__code__",
            "__closure__",
            "__kwdefaults__",
        ):
            raise PermissionError("sandbox: setting " + args[1] + " is not allowed")
        if event == "open" and args[0] is not None and not isinstance(args[0], int):
            mode, flags = args[1] or "", args[2] or 0
            if any(c in mode for c in "wax+") or flags & write_flags:
                real = realpath(fsdecode(args[0])) + sep
                if not (real.startswith(mine) or real == devnull):
                    raise PermissionError("sandbox: writing outside " + mine)
            elif fsdecode(args[0]).startswith("/proc/"):
                part = realpath(fsdecode(args[0])).split(sep)[2:3]
                if part and part[0].isdigit() and part[0] != me:
                    raise PermissionError("sandbox: reading another process's /proc entry")
        if event in path_events:
            for a in args[:2]:
                if isinstance(a, str_bytes) and not (realpath(fsdecode(a)) + sep).startswith(mine):
                    raise PermissionError("sandbox: " + event + " outside " + mine)

    sys.addaudithook(hook)


def _user(cfg):
    _set_dumpable(1)
    os.close(cfg["status_fd"])
    os.setsid()  # kill(0, ...) then reaches this process group only
    try:  # the OOM killer's first choice is the user's code, not the reaper
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    with os.fdopen(cfg["spec_fd"], "rb") as f:
        code = json.loads(f.read())["code"]
    os.chdir(cfg["work"])
    with open("main.py", "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(code)
    sys.path[:0] = [os.getcwd()]
    sys.path.extend(cfg["extra_path"])
    _set_limits(cfg)
    if cfg["hooks"]:
        _install_hooks(cfg["work"], cfg["kernel_boundary"])
    os.write(cfg["ready_fd"], b"R")
    os.close(cfg["ready_fd"])
    try:
        exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py"})
    except SystemExit:
        raise
    except MemoryError:
        sys.stdout.flush()
        sys.stderr.write(f"MemoryError: the sandbox memory limit ({cfg['memory_mb']} MB) was hit\n")
        sys.stderr.flush()
        os._exit(cfg["memory_exit"])
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)


def _reaper(cfg, child):
    os.close(cfg["ready_fd"])
    os.close(cfg["spec_fd"])
    status = None
    while True:
        try:
            pid, st = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == child:
            status = st
            os.write(cfg["status_fd"], str(st).encode())
            break
    os._exit(0 if status is not None else 1)


def _set_dumpable(flag):
    """prctl(PR_SET_DUMPABLE, flag). 0 makes this process's /proc entries root's: the code, which
    runs as the same uid, can then neither open /proc/1/mem (write the reaper's memory and forge
    the status it reports) nor reach its fds through /proc/1/fd."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, flag, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")


def _main(cfg):
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    # before the fork, so that no instant exists in which the code runs beside a dumpable reaper;
    # the user process sets it back for itself (its own /proc/self stays usable)
    _set_dumpable(0)
    child = os.fork()
    if child == 0:
        _user(cfg)
    else:
        _reaper(cfg, child)


_main(json.loads(sys.argv[1]))
