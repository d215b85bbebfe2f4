"""The host side of one sandbox call: the keeper process and the set-up of the isolated child.

`run_python` starts this file as a script, `python -I -S keeper.py CONFIG` (CONFIG: JSON, see
run.py). It imports only the standard library (the parent also imports `kill_cgroup` from here).

keeper (host namespaces, root or not, outside the call's cgroup)
  - gets SIGTERM when the trainer dies (PR_SET_PDEATHSIG), and then kills the call's
    cgroup, removes it and exits: a SIGKILLed trainer leaves no process and no cgroup behind;
  - in "namespaces" mode unshares a PID namespace, so that its one child is pid 1 there;
  - forks the child, waits for it, reads the user code's wait status relayed by the sandbox's
    pid 1 (runner.py) on the status pipe, kills and removes the cgroup (and, in "trusted" mode, the
    private directory and every descendant: it is their subreaper), and writes one JSON result
    line {"status": wait status, "oom_kills": n} to the result fd for the parent.
child (joins the cgroup first, so everything it becomes is counted and killed there)
  - "namespaces": new mount, network, IPC, UTS and cgroup namespaces (pid 1 of the keeper's new
    PID namespace); a minimal read-only root on a fresh tmpfs (binds of the interpreter, its
    standard library, the system libraries, optionally site-packages; /dev with null, zero, random,
    urandom; one size-bounded tmpfs at /tmp, the only writable place; /proc of the new PID
    namespace with /proc/sys read-only), pivot_root into it and detach the old root; then the
    capability bounding set and the ambient set emptied, the call's own uid / gid when root, all
    capabilities gone, no_new_privs, the seccomp filter; then exec of `python -I -S -c RUNNER`.
  - "bwrap": the same uid drop (when root: bwrap then builds an unprivileged user namespace, so
    host root files and sysctls are not the sandbox's), then exec of bwrap with the same root,
    --unshare-all, --cap-drop ALL, --die-with-parent, --new-session, --as-pid-1 (our runner is
    pid 1: the code cannot kill it), the seccomp filter (--seccomp FD) and the tmpfs (--size).
  - "trusted": no isolation; exec of the runner in a private host directory.
A failure before the user code runs exits 70 with a message on stderr (the parent raises
SandboxSetupError).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

# mount(2) / umount2(2) / unshare(2) / prctl(2) constants (linux/mount.h, sched.h, prctl.h)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_PRIVATE, MNT_DETACH = 16384, 1 << 18, 2
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER = (
    1,
    4,
    24,
    22,
    36,
)
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
SECCOMP_MODE_FILTER = 2
SETUP_FAILED = 70


class _OwnerGone(Exception):
    """SIGTERM: the trainer died (parent-death signal) or the parent asks us to stop."""


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def call(name: str, *args) -> int:
        if (rc := getattr(libc, name)(*args)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{name}{args!r:.160}: {os.strerror(err)}")
        return rc

    return call, ctypes


# ------------------------------------------------------------------------------------ cgroups
def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def cgroup_pids(cg: dict) -> set[int]:
    return {int(p) for d in cg["dirs"] for p in _read(os.path.join(d, "cgroup.procs")).split()}


def oom_kills(cg: dict | None) -> int:
    """How often the kernel's OOM killer struck in the call's memory cgroup."""
    if cg is None:
        return 0
    name = "memory.events" if cg["v2"] else "memory.oom_control"
    for line in _read(os.path.join(cg["memory"], name)).splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def kill_cgroup(cg: dict | None, timeout_s: float = 10.0) -> None:
    """Kill every process of the call's cgroup and remove its directories (missing ones are fine).

    v2: cgroup.kill. v1: freeze (no fork can race the kill), SIGKILL every pid, thaw; without a
    freezer, kill until empty (pids.max bounds the race). Raises OSError if it cannot be emptied.
    """
    if cg is None:
        return
    deadline = time.monotonic() + timeout_s
    kill_file = os.path.join(cg["dirs"][0], "cgroup.kill")
    while any(os.path.isdir(d) for d in cg["dirs"]):
        pids = cgroup_pids(cg)
        if pids:
            if cg["v2"] and os.path.exists(kill_file):
                _write(kill_file, "1")
            else:
                freezer = cg.get("freezer")
                try:
                    if freezer:
                        _write(os.path.join(freezer, "freezer.state"), "FROZEN")
                    for pid in cgroup_pids(cg):
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                finally:
                    if freezer and os.path.isdir(freezer):
                        _write(os.path.join(freezer, "freezer.state"), "THAWED")
        else:
            for d in cg["dirs"]:
                try:
                    os.rmdir(d)
                except FileNotFoundError:
                    pass
                except OSError:  # EBUSY: a process still exiting; try again
                    pass
        if time.monotonic() > deadline:
            raise OSError(f"could not empty and remove the sandbox cgroup {cg['dirs']}")
        if any(os.path.isdir(d) for d in cg["dirs"]):
            time.sleep(0.005)


def _join_cgroup(cg: dict | None) -> None:
    for d in cg["dirs"] if cg else ():
        _write(os.path.join(d, "cgroup.procs"), "0")


# ------------------------------------------------------------------------- private directory
def remove_tree(path: str) -> None:
    """rm -rf without recursion and without long paths: each subdirectory is first renamed to the
    top of the tree (under a name the code cannot guess), so a tree of any depth is removed with
    two open fds. Symlinks are removed, never followed."""
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    hoisted = f".grouprl-rm-{os.urandom(8).hex()}-"
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        todo: list[str | None] = [None]  # None: the top; else a hoisted name at the top
        n = 0
        while todo:
            name = todo[-1]
            fd = top if name is None else os.open(name, flags, dir_fd=top)
            try:
                found = None
                for entry in list(os.scandir(fd)):
                    if name is None and entry.name.startswith(hoisted):
                        continue  # already hoisted: on the stack, or emptied
                    if entry.is_dir(follow_symlinks=False):
                        n += 1
                        found = f"{hoisted}{n}"
                        os.rename(entry.name, found, src_dir_fd=fd, dst_dir_fd=top)
                        break
                    os.unlink(entry.name, dir_fd=fd)
            finally:
                if fd != top:
                    os.close(fd)
            if found is not None:
                todo.append(found)
            else:
                todo.pop()
        for i in range(1, n + 1):  # every directory now sits at the top, empty
            os.rmdir(f"{hoisted}{i}", dir_fd=top)
    finally:
        os.close(top)
    os.rmdir(path)


def _descendants(root: int) -> list[int]:
    """Pids whose parent chain reaches `root` (we are their subreaper, so orphans stay in it)."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _read(f"/proc/{name}/stat")
            if stat:
                parent[int(name)] = int(stat.rpartition(")")[2].split()[1])
    out, frontier = [], {root}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier}
        out.extend(frontier)
    return out


def _kill_descendants() -> None:
    for _ in range(1000):
        pids = _descendants(os.getpid())
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        time.sleep(0.002)


# --------------------------------------------------------------------------- the child's side
def _build_root(call, cfg: dict) -> None:
    """In a fresh mount namespace: the minimal read-only root, then pivot_root into it."""
    # every source is opened before anything is mounted over it (e.g. a venv under /tmp)
    sources = {}
    for kind, src, dst in cfg["layout"]:
        if kind in ("bind", "dev"):
            sources[dst] = os.open(src, os.O_PATH | os.O_CLOEXEC)
    call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
    stage = b"/tmp"
    call("mount", b"tmpfs", stage, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0755")
    dev_flags = b"size=64k,mode=0755"
    for kind, src, dst in cfg["layout"]:
        target = stage + dst.encode()
        if kind == "symlink":
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(src, target)
            continue
        if kind == "tmpfs":  # /dev, /tmp
            os.makedirs(target, exist_ok=True)
            opts = dev_flags if dst == "/dev" else src.encode()
            call("mount", b"tmpfs", target, b"tmpfs", MS_NOSUID | MS_NODEV, opts)
            continue
        if kind == "dir":
            os.makedirs(target, exist_ok=True)
            continue
        fd = sources[dst]
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        call("mount", f"/proc/self/fd/{fd}".encode(), target, None, MS_BIND, None)
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        flags |= MS_NOEXEC if kind == "dev" else MS_NODEV
        call("mount", None, target, None, flags, None)
        os.close(fd)
    call("mount", None, stage + b"/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC, None)
    os.chdir(stage)
    call("pivot_root", b".", b".")
    call("umount2", b".", MNT_DETACH)
    os.chdir("/")
    call("mount", None, b"/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    call("mount", b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    for path in (b"/proc/sys", b"/proc/sysrq-trigger", b"/proc/irq", b"/proc/bus"):
        if os.path.exists(path):
            call("mount", path, path, None, MS_BIND | MS_REC, None)
            call("mount", None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID, None)


def _drop_privileges(call, ctypes, cap_last: int, uid: int) -> None:
    """Bounding and ambient sets emptied, the call's own uid/gid when root, no capabilities,
    no_new_privs."""
    if os.geteuid() == 0:
        for cap in range(cap_last + 1):
            call("prctl", PR_CAPBSET_DROP, cap, 0, 0, 0)
        call("prctl", PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    call("capset", header, (ctypes.c_uint32 * 6)())  # effective, permitted, inheritable: none
    call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    # the credentials changed, which clears the parent-death signal: set it again
    call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def install_seccomp(call, ctypes, program: bytes) -> None:
    """prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &sock_fprog) with `program` (seccomp.py)."""

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(program, len(program))
    prog = SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    call("prctl", PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0)


def _runner_argv(cfg: dict) -> list[str]:
    with open(cfg["runner"], encoding="utf-8") as f:
        source = f.read()
    return [cfg["python"], "-I", "-S", "-c", source, json.dumps(cfg["runner_cfg"])]


def _keep_fds(keep: set[int]) -> None:
    for fd in keep:
        os.set_inheritable(fd, True)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _child_namespaces(cfg: dict) -> None:
    call, ctypes = _libc()
    cap_last = int(_read("/proc/sys/kernel/cap_last_cap") or 40)
    program = os.read(cfg["seccomp_fd"], 1 << 16)
    argv = _runner_argv(cfg)
    call("unshare", CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP)
    _build_root(call, cfg)
    call("sethostname", b"sandbox", 7)
    _drop_privileges(call, ctypes, cap_last, cfg["uid"])
    install_seccomp(call, ctypes, program)
    _keep_fds(set(cfg["keep_fds"]))
    os.chdir("/tmp")
    os.execve(argv[0], argv, cfg["env"])


def _stage_sources(call, binds: list[str]) -> list[str]:
    """As root, in a private mount namespace: bind each source at /tmp/<i> of a fresh tmpfs, so
    that bwrap, run as the call's uid, can reach sources below directories only root may walk (pyenv's
    interpreter under /root). Returns the staged paths."""
    call("unshare", CLONE_NEWNS)
    call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
    fds = [os.open(src, os.O_PATH | os.O_CLOEXEC) for src in binds]  # before /tmp is covered
    call("mount", b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, b"size=64k,mode=0755")
    staged = []
    for i, fd in enumerate(fds):
        target = f"/tmp/{i}"
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.mkdir(target)
        else:
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        call("mount", f"/proc/self/fd/{fd}".encode(), target.encode(), None, MS_BIND, None)
        os.close(fd)
        staged.append(target)
    return staged


def _child_bwrap(cfg: dict) -> None:
    call, ctypes = _libc()
    uid = cfg["uid"]
    as_root = os.geteuid() == 0
    runner_argv = _runner_argv(cfg)  # read before staging covers the host's /tmp (a CI clone)
    args = [cfg["bwrap"], "--unshare-all", "--die-with-parent", "--new-session", "--as-pid-1"]
    args += ["--cap-drop", "ALL", "--hostname", "sandbox", "--seccomp", str(cfg["seccomp_fd"])]
    binds = [src for kind, src, dst in cfg["layout"] if kind == "bind"]
    staged = dict(zip(binds, _stage_sources(call, binds) if as_root else binds))
    for kind, src, dst in cfg["layout"]:
        if dst.startswith("/dev/"):
            continue  # bwrap's --dev makes /dev's nodes and links
        if kind == "bind":
            args += ["--ro-bind", staged[src], dst]
        elif kind == "symlink":
            args += ["--symlink", src, dst]
        elif kind == "dir":
            args += ["--dir", dst]
        elif kind == "tmpfs" and dst == "/dev":
            args += ["--dev", "/dev"]
        elif kind == "tmpfs":
            size = int(src.split("size=")[1].split("k")[0]) * 1024
            args += ["--perms", "0700", "--size", str(size), "--tmpfs", dst]
    args += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys"]
    args += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--"]
    args += runner_argv
    if as_root:  # bwrap then makes an unprivileged user namespace: host root is not ours
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _keep_fds(set(cfg["keep_fds"]) | {cfg["seccomp_fd"]})
    os.execve(cfg["bwrap"], args, cfg["env"])


def _child_trusted(cfg: dict) -> None:
    argv = _runner_argv(cfg)
    _keep_fds(set(cfg["keep_fds"]))
    os.chdir(cfg["runner_cfg"]["work"])
    os.execve(argv[0], argv, cfg["env"])


_CHILDREN = {"namespaces": _child_namespaces, "bwrap": _child_bwrap, "trusted": _child_trusted}


def _child(cfg: dict) -> None:
    try:
        os.close(cfg["result_fd"])
        _join_cgroup(cfg["cgroup"])
        call, _ = _libc()
        call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        _CHILDREN[cfg["mode"]](cfg)
    except BaseException as e:  # noqa: BLE001  (anything here is a set-up failure)
        import traceback

        where = "".join(traceback.format_tb(e.__traceback__)[-2:])
        os.write(2, f"sandbox set-up failed ({cfg['mode']}): {e!r}\n{where}".encode())
    os._exit(SETUP_FAILED)


def _on_term(signum, frame):
    raise _OwnerGone


def main(cfg: dict) -> None:
    signal.signal(signal.SIGTERM, _on_term)
    call, _ = _libc()
    call("prctl", PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != cfg["owner_pid"]:  # the trainer died before the line above
        raise _OwnerGone
    if cfg["mode"] == "trusted":
        call("prctl", PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    if cfg["mode"] == "namespaces":
        call("unshare", CLONE_NEWPID)  # our next child is pid 1 of a new PID namespace
    status_r, status_w = os.pipe()
    cfg["runner_cfg"]["status_fd"] = status_w
    cfg["keep_fds"] = [status_w, cfg["ready_fd"], cfg["spec_fd"]]
    child = os.fork()
    if child == 0:
        os.close(status_r)
        _child(cfg)
    os.close(status_w)
    os.close(cfg["ready_fd"])
    os.close(cfg["spec_fd"])
    status = os.waitpid(child, 0)[1]
    relayed = os.read(status_r, 64)
    if relayed.isdigit() and len(relayed) < 12:  # a wait status; anything else is not the reaper's
        status = int(relayed)
    result = {"status": status, "oom_kills": oom_kills(cfg["cgroup"])}
    _cleanup(cfg)
    os.write(cfg["result_fd"], json.dumps(result).encode())


def _cleanup(cfg: dict) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    kill_cgroup(cfg["cgroup"])
    if cfg["mode"] == "trusted":
        _kill_descendants()
        remove_tree(cfg["runner_cfg"]["work"])


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    try:
        main(config)
    except _OwnerGone:
        _cleanup(config)
        os._exit(1)
