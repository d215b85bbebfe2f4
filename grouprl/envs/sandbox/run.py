"""`run_python`: one call of untrusted Python in the sandbox, seen from the trainer's side.

Per call: stale cgroups of dead owners are reaped; a cgroup with the call's totals is made
(cgroups.py); the code goes into a sealed memfd (spec fd) and stdin into another, read-only; the
keeper process (keeper.py) is started in its own session with the config, and everything from
there on is the kernel's business (namespaces, pivot_root, seccomp, capabilities, cgroup). This
side reads stdout and stderr as they come (capped), starts the user's wall clock when the runner
writes its ready byte, kills the cgroup at the deadline, and turns the keeper's JSON result (the
user process's wait status, OOM kills) into a SandboxResult.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import secrets
import selectors
import signal
import stat
import subprocess
import sys
import tempfile
import time

from grouprl.envs.sandbox import cgroups, modes
from grouprl.envs.sandbox.keeper import kill_cgroup, remove_tree
from grouprl.envs.sandbox.layout import WORK, Libraries, root_layout, site_packages
from grouprl.envs.sandbox.result import Isolation, Reason, SandboxResult, SandboxSetupError
from grouprl.envs.sandbox.seccomp import filter_program

OUTPUT_CAP = 64 * 1024  # bytes kept of stdout and of stderr each
SETUP_TIMEOUT_S = 30.0  # interpreter start + isolation set-up, before the user's clock starts
EXTRA_TASKS = 32  # processes + threads the user code may add (pids.max / RLIMIT_NPROC)
BASE_TASKS = 4  # keeper-side child / bwrap, the runner's reaper, the user process, slack
FSIZE_MB = 16  # largest single file the code may write (RLIMIT_FSIZE)
DISK_MB = 16  # size of the private tmpfs (the only writable place)
NOFILE = 64  # open files per process (RLIMIT_NOFILE)
OVERHEAD_MB = 48  # interpreters of the reaper and the set-up, charged to the call's memory cgroup
MEMORY_EXIT = 86  # exit code of the runner when the user code ran out of memory
TRUSTED_PREFIX = "grouprl-sandbox-"
# As root, each call runs as a uid of its own from this range (first, count), held by a lock while
# the call lives. The kernel keeps per-uid counters across namespaces (inotify instances and
# watches, pending signals, message-queue bytes, pipe buffers, processes): with one uid for all
# calls, one call could exhaust them for every other call and for the host's `nobody`.
CALL_UIDS = (1_900_000_000, 1024)
_HERE = os.path.dirname(os.path.abspath(__file__))
_KEEPER, _RUNNER = os.path.join(_HERE, "keeper.py"), os.path.join(_HERE, "runner.py")


def _memfd(name: str, data: bytes, *, read_only: bool) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    seals = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    if not read_only:
        return fd
    ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    os.close(fd)
    return ro


class _Capped:
    """Keeps the first `cap` bytes of a stream and counts the rest."""

    def __init__(self, cap: int) -> None:
        self.cap, self.data, self.dropped = cap, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        keep = max(0, self.cap - len(self.data))
        self.data += chunk[:keep]
        self.dropped += len(chunk) - min(keep, len(chunk))

    def text(self) -> str:
        # invalid bytes and lone surrogates become U+FFFD: the result is always valid UTF-8
        out = self.data.decode("utf-8", errors="replace")
        return out + (f"\n[... {self.dropped} more bytes dropped]" if self.dropped else "")


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    stdin: str = "",
    isolation: Isolation = "auto",
    audit_hooks: str = "on",
    output_cap: int = OUTPUT_CAP,
    disk_mb: int = DISK_MB,
    libraries: Libraries = "stdlib",
) -> SandboxResult:
    """Run `code` as a fresh `python -I -S` process in the sandbox (grouprl.envs.sandbox).

    timeout_s: wall-clock limit of the user code (CPU: the same, rounded up, + 1 s per process)
    memory_mb: memory of the whole call (cgroup, incl. /tmp files and memfds; the sandbox's own
               interpreters get OVERHEAD_MB on top) and address space of each process (RLIMIT_AS)
    stdin:     text fed to the code's standard input
    isolation: "auto" (namespaces, else bwrap; never trusted), "namespaces", "bwrap", or
               "trusted" (no isolation: only for code you trust)
    audit_hooks: "on" (default) or "off" (the kernel layers alone, for testing them)
    output_cap: bytes kept of stdout and of stderr each
    disk_mb:   size of the private tmpfs /tmp (cwd, HOME, TMPDIR), the only writable place
    libraries: "stdlib" (default) or "site-packages" (the running environment's, read-only)
    """
    if not isinstance(code, str) or not isinstance(stdin, str):
        raise TypeError("run_python takes code and stdin as str")
    if not (math.isfinite(timeout_s) and timeout_s > 0) or memory_mb < 32 or output_cap < 0:
        raise ValueError(
            f"need timeout_s > 0, memory_mb >= 32, output_cap >= 0; got {timeout_s}, {memory_mb}, "
            f"{output_cap}"
        )
    if disk_mb < 1:
        raise ValueError(f"need disk_mb >= 1, got {disk_mb}")
    if audit_hooks not in ("on", "off"):
        raise ValueError(f"audit_hooks must be 'on' or 'off', got {audit_hooks!r}")
    if libraries not in ("stdlib", "site-packages"):
        raise ValueError(f"libraries must be 'stdlib' or 'site-packages', got {libraries!r}")
    mode = modes.resolve(isolation)
    cgroups.reap_stale()
    if mode == "trusted":
        _reap_stale_dirs()
    uid, uid_lock = (0, None) if mode == "trusted" or os.geteuid() != 0 else _claim_uid()
    cg, work = None, WORK
    try:
        if mode != "trusted" or cgroups.available():
            if not cgroups.available():
                raise SandboxSetupError(
                    f"isolation={mode!r} needs per-call cgroups: {cgroups.why_unavailable()}"
                )
            tasks = BASE_TASKS + EXTRA_TASKS + (1 if mode == "bwrap" else 0)
            cg = cgroups.create((memory_mb + OVERHEAD_MB) << 20, tasks, cpus=1.0)
        if mode == "trusted":
            work = os.path.realpath(tempfile.mkdtemp(prefix=f"{TRUSTED_PREFIX}{_owner_tag()}-"))
        return _launch(code, stdin, mode, cg, work, timeout_s, memory_mb, audit_hooks, output_cap,
                       disk_mb, libraries, uid, uid_lock)  # fmt: skip
    finally:
        try:
            kill_cgroup(cg)
        finally:
            if uid_lock is not None:
                os.close(uid_lock)  # the keeper holds it too, until its cleanup is done
            if mode == "trusted" and work != WORK:  # WORK is the sandbox's /tmp, not a host dir
                remove_tree(work)


def _claim_uid() -> tuple[int, int]:
    """A uid of CALL_UIDS that no live call holds: an exclusive flock on a file named after it
    (released by the kernel when its last holder, this process or the keeper, is gone).
    Returns (uid, the lock's fd)."""
    base = "/run" if os.access("/run", os.W_OK) else tempfile.gettempdir()
    folder = os.path.join(base, "grouprl-sandbox-uids")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    st = os.lstat(folder)  # not someone else's folder or a link planted in a shared /tmp
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise SandboxSetupError(f"{folder} is not a private folder of uid {os.geteuid()}")
    first, count = CALL_UIDS
    start = secrets.randbelow(count)
    for i in range(count):
        uid = first + (start + i) % count
        fd = os.open(os.path.join(folder, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return uid, fd
    raise SandboxSetupError(f"all {count} per-call uids are in use ({folder})")


def _owner_tag() -> str:
    return f"{os.getpid()}-{cgroups.process_start_time(os.getpid())}"


def _reap_stale_dirs() -> None:
    """Private directories of trusted-mode calls whose owner is gone (a SIGKILLed keeper too)."""
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        if not name.startswith(TRUSTED_PREFIX):
            continue
        parts = name[len(TRUSTED_PREFIX) :].split("-")
        if len(parts) >= 2 and parts[0].isdigit():
            if cgroups.process_start_time(int(parts[0])) != parts[1]:
                try:
                    remove_tree(os.path.join(tmp, name))
                except OSError:
                    pass


def _launch(
    code,
    stdin,
    mode,
    cg,
    work,
    timeout_s,
    memory_mb,
    audit_hooks,
    cap,
    disk_mb,
    libraries,
    uid,
    uid_lock,
):
    as_root = os.geteuid() == 0
    runner_cfg = {
        "work": work, "hooks": audit_hooks == "on", "kernel_boundary": mode != "trusted",
        "cpu_s": math.ceil(timeout_s) + 1, "memory_mb": memory_mb, "fsize_mb": min(FSIZE_MB, disk_mb),
        "nofile": NOFILE, "nproc": 0 if as_root and mode == "trusted" else BASE_TASKS + EXTRA_TASKS,
        "memory_exit": MEMORY_EXIT,
        "extra_path": site_packages() if libraries == "site-packages" else [],
    }  # fmt: skip
    if mode != "trusted":
        # the call's cgroup (pids.max) bounds its tasks. RLIMIT_NPROC would count every task of
        # the uid host-wide: were the uid shared with other calls (not root) or other host
        # processes, one call's forks would make fork() and threads fail there
        runner_cfg["nproc"] = 0
    env = {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": work, "TMPDIR": work}
    env |= {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    spec_fd = _memfd("grouprl-spec", json.dumps({"code": code}).encode("utf-8", "surrogatepass"),
                     read_only=True)  # fmt: skip
    stdin_fd = _memfd("grouprl-stdin", stdin.encode("utf-8", "surrogatepass"), read_only=True)
    seccomp_fd = _memfd("grouprl-seccomp", filter_program(os.uname().machine), read_only=True)
    ready_r, ready_w = os.pipe()
    result_r, result_w = os.pipe()
    runner_cfg |= {"ready_fd": ready_w, "spec_fd": spec_fd}
    cfg = {
        "mode": mode, "owner_pid": os.getpid(), "cgroup": cg, "env": env,
        "python": os.path.realpath(sys.executable), "runner": _RUNNER, "runner_cfg": runner_cfg,
        "layout": root_layout(libraries, disk_mb, uid) if mode != "trusted" else [],
        "ready_fd": ready_w, "spec_fd": spec_fd, "seccomp_fd": seccomp_fd, "result_fd": result_w,
        "bwrap": modes.bwrap_path() if mode == "bwrap" else None, "uid": uid, "uid_lock": uid_lock,
    }  # fmt: skip
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _KEEPER, json.dumps(cfg)],
            stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/", env=env,
            start_new_session=True, pass_fds=(ready_w, spec_fd, seccomp_fd, result_w, *([uid_lock] if uid_lock else [])),
        )  # fmt: skip
    finally:
        for fd in (ready_w, spec_fd, stdin_fd, seccomp_fd, result_w):
            os.close(fd)
    return _supervise(proc, mode, cg, ready_r, result_r, start, timeout_s, cap)


def _supervise(proc, mode, cg, ready_r, result_r, start, timeout_s, cap) -> SandboxResult:
    """Read output (capped), enforce the clocks, collect the keeper's result."""
    out, err, ready, timed_out, result = _Capped(cap), _Capped(cap), False, False, bytearray()
    sel = selectors.DefaultSelector()
    for stream, sink in ((proc.stdout, out), (proc.stderr, err)):
        sel.register(stream, selectors.EVENT_READ, sink)
    sel.register(ready_r, selectors.EVENT_READ, "ready")
    sel.register(result_r, selectors.EVENT_READ, "result")
    deadline = start + SETUP_TIMEOUT_S
    try:
        while sel.get_map():
            if time.monotonic() > deadline:
                timed_out = True
                break
            for key, _ in sel.select(timeout=0.05):
                # the child's set-up is done: the user's clock starts now
                if _route(sel, key, result) == "ready" and not ready:
                    ready, deadline = True, time.monotonic() + timeout_s
    finally:
        if sel.get_map():  # timed out: kill the call; the keeper then cleans up and exits
            if cg:
                kill_cgroup(cg)
            else:  # trusted mode without cgroups: the keeper kills its descendants
                proc.send_signal(signal.SIGTERM)
            _drain(sel, result)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid)
            proc.wait()
        sel.close()
        for f in (proc.stdout, proc.stderr):
            f.close()
        os.close(ready_r)
        os.close(result_r)
    if not ready:
        raise SandboxSetupError(
            f"sandbox ({mode}) failed before running the code "
            f"({'set-up timed out' if timed_out else f'exit {proc.returncode}'}): "
            f"{err.text()[-2000:]}"
        )
    if timed_out:
        return SandboxResult(
            ok=False, returncode=None, stdout=out.text(), stderr=err.text(), reason="timeout",
            isolation=mode, duration_s=time.monotonic() - start,
        )  # fmt: skip
    if not result:
        raise SandboxSetupError(
            f"sandbox ({mode}) keeper died (exit {proc.returncode}): {err.text()[-2000:]}"
        )
    info = json.loads(result)
    rc = os.waitstatus_to_exitcode(info["status"])
    reason = _reason(rc, info["oom_kills"], err.data)
    return SandboxResult(
        ok=reason == "ok", returncode=rc, stdout=out.text(),
        stderr=err.text(), reason=reason, isolation=mode, duration_s=time.monotonic() - start,
    )  # fmt: skip


def _route(sel, key, result: bytearray) -> str | None:
    """Read one chunk from a ready pipe: output into its _Capped sink, the keeper's result into
    `result`; a closed pipe is unregistered. Returns "ready" when the ready pipe spoke."""
    chunk = os.read(key.fd, 65536)
    if not chunk:
        sel.unregister(key.fileobj)
    elif key.data == "result":
        result += chunk
    elif key.data == "ready":
        return "ready"
    else:
        key.data.add(chunk)
    return None


def _drain(sel, result: bytearray) -> None:
    """After the kill: what is still in the pipes, up to a second."""
    until = time.monotonic() + 1.0
    while sel.get_map() and time.monotonic() < until:
        for key, _ in sel.select(timeout=0.05):
            _route(sel, key, result)


def _signal_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reason(rc: int, oom_kills: int, stderr: bytes) -> Reason:
    if rc == -signal.SIGXCPU:
        return "timeout"
    if rc == MEMORY_EXIT or (rc != 0 and oom_kills) or (rc < 0 and b"MemoryError" in stderr):
        return "memory"
    return "killed" if rc < 0 else ("error" if rc else "ok")
