"""grouprl.envs.sandbox: the API, outcomes, limits, clean-up and the seccomp program.

The basic cases run in each isolation mode this machine offers ("trusted" always; "namespaces"
as root; "bwrap" where bubblewrap works); the attack suite by class is tests/test_sandbox_hostile.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from grouprl.envs.sandbox import SandboxSetupError, cgroups, modes, run, run_python, seccomp
from grouprl.envs.sandbox.keeper import remove_tree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def light_import_prelude(repo: str) -> str:
    """Python source that makes `grouprl.envs.sandbox` importable in a fresh interpreter without
    running grouprl/__init__ and grouprl/envs/__init__ (they import torch: seconds per process)."""
    return (
        "import sys, types\n"
        f"for _name, _path in (('grouprl', {repo + '/grouprl'!r}), "
        f"('grouprl.envs', {repo + '/grouprl/envs'!r})):\n"
        "    _m = types.ModuleType(_name); _m.__path__ = [_path]; sys.modules[_name] = _m\n"
    )


def _works(mode: str) -> bool:
    """The machine offers `mode` (root / bwrap / cgroups). Whether it then runs code is what the
    tests check: a mode offered but broken fails them rather than dropping out of the list."""
    from grouprl.envs.sandbox.modes import check_available

    try:
        check_available(mode)
        return True
    except SandboxSetupError:
        return False


KERNEL_MODES = [m for m in ("namespaces", "bwrap") if _works(m)]
MODES = [*KERNEL_MODES, "trusted"]


def _own_cgroups(pid: int) -> list[str]:
    out = []
    for base in cgroups._base_dirs():
        if os.path.isdir(base):
            out += [n for n in os.listdir(base) if n.startswith(f"{pid}-")]
    return out


@pytest.fixture
def work_dirs(monkeypatch):
    """Records the private host directories made (trusted mode), then checks that no process, no
    directory and no cgroup outlived a run."""
    made: list[str] = []
    real_mkdtemp = run.tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):
        made.append(real_mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(run.tempfile, "mkdtemp", mkdtemp)
    yield made
    assert _own_cgroups(os.getpid()) == []
    for d in made:
        assert not os.path.exists(d), f"private directory {d} was not removed"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        assert not any(d in cmd for d in made), f"process {pid} outlived its sandbox: {cmd!r}"


# ----------------------------------------------------------------------------------- basics
@pytest.mark.parametrize("mode", MODES)
def test_plain_run_stdin_exit_codes_and_errors(mode, work_dirs):
    r = run_python("print(input()[::-1]); print(6 * 7)", stdin="abc\n", isolation=mode)
    assert (r.ok, r.reason, r.returncode, r.stdout, r.isolation) == (
        True,
        "ok",
        0,
        "cba\n42\n",
        mode,
    )
    r = run_python("raise SystemExit(3)", isolation=mode)
    assert (r.ok, r.reason, r.returncode) == (False, "error", 3)
    r = run_python("x = 1\n1 / 0", isolation=mode)
    assert (r.reason, r.returncode) == ("error", 1)
    assert 'File "main.py", line 2' in r.stderr and r.stderr.rstrip().endswith("division by zero")
    r = run_python("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", isolation=mode)
    assert (r.reason, r.returncode) == ("killed", -11)


@pytest.mark.parametrize("mode", MODES)
def test_private_directory_is_the_cwd_writable_and_deleted(mode, work_dirs):
    code = "import os; open('a.txt', 'w').write('hi'); print(os.getcwd(), os.environ['HOME'])"
    r = run_python(code, isolation=mode)
    work = work_dirs[-1] if mode == "trusted" else "/tmp"
    assert r.ok and r.stdout.split() == [work, work]


@pytest.mark.parametrize("mode", MODES)
def test_numpy_works_inside_with_site_packages_only(mode, work_dirs):
    pytest.importorskip("numpy")
    code = "import numpy as np; print(int(np.arange(10).sum()))"
    r = run_python(code, isolation=mode, libraries="site-packages")
    assert r.ok and r.stdout == "45\n", r.stderr
    if mode != "trusted":  # the default root has the standard library only
        r = run_python(code, isolation=mode)
        assert r.reason == "error" and "No module named 'numpy'" in r.stderr


def test_auto_picks_the_strongest_kernel_mode_and_never_trusted():
    assert KERNEL_MODES, "this machine should offer a kernel mode (root or bubblewrap)"
    assert run_python("print(1)").isolation == KERNEL_MODES[0]


def test_without_kernel_isolation_untrusted_code_is_refused():
    """As uid 65534 here: no root (namespaces) and no writable cgroup (both modes need one)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child drops to nobody and asks for "auto"
        try:
            os.close(read)
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            modes.auto_mode.cache_clear()
            cgroups.hierarchies.cache_clear()
            try:
                run_python("print(1)")
                msg = "ran"
            except SandboxSetupError as e:
                msg = str(e)
            os.write(write, msg.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        msg = f.read().decode()
    os.waitpid(pid, 0)
    assert "untrusted code is refused" in msg and "isolation='trusted'" in msg, msg


def test_bad_arguments_fail_loudly():
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("pass", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("pass", memory_mb=1)
    with pytest.raises(ValueError, match="allowed are auto, namespaces, bwrap, trusted"):
        run_python("pass", isolation="chroot")
    with pytest.raises(ValueError, match="'hooks' is now 'trusted'"):
        run_python("pass", isolation="hooks")
    with pytest.raises(ValueError, match="libraries"):
        run_python("pass", libraries="all")
    with pytest.raises(TypeError):
        run_python(b"print(1)")


def test_unavailable_mode_is_an_error_not_a_fallback():
    missing = [m for m in ("namespaces", "bwrap") if m not in MODES]
    for mode in missing:
        with pytest.raises(SandboxSetupError):
            run_python("print(1)", isolation=mode)


def test_concurrent_runs_stay_separate(work_dirs):
    results: dict[int, str] = {}

    def one(i: int) -> None:
        results[i] = run_python(f"import time; time.sleep(0.2); print({i} * {i})").stdout

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: f"{i * i}\n" for i in range(4)}


# ---------------------------------------------------------------------------- hostile cases
@pytest.mark.parametrize("mode", MODES)
def test_infinite_loop_and_sleep_time_out(mode, work_dirs):
    r = run_python("while True: pass", timeout_s=0.5, isolation=mode)
    assert (r.ok, r.reason, r.returncode) == (False, "timeout", None)
    assert r.duration_s < 5
    r = run_python(
        "import time; print('start', flush=True); time.sleep(60)", timeout_s=0.3, isolation=mode
    )
    assert r.reason == "timeout" and r.stdout == "start\n" and r.duration_s < 5


@pytest.mark.parametrize("mode", MODES)
def test_fork_storm_and_subprocesses_are_refused(mode, work_dirs):
    storm = "import os\nfor _ in range(10_000):\n    os.fork()\n"
    r = run_python(storm, isolation=mode)
    assert r.reason == "error" and "PermissionError" in r.stderr
    for code in (
        "import subprocess; subprocess.run(['/bin/sh', '-c', 'echo escaped'])",
        "import os; os.system('echo escaped')",
        "import ctypes; ctypes.CDLL(None).fork()",
        "import multiprocessing as mp; p = mp.Process(target=print); p.start(); p.join()",
    ):
        r = run_python(code, isolation=mode)
        assert r.reason == "error" and "escaped" not in r.stdout, code


@pytest.mark.parametrize("mode", MODES)
def test_huge_allocation_is_a_memory_failure(mode, work_dirs):
    for code in ("x = bytearray(2 * 1024**3)", "x = [0] * 10**9", "s = 'x' * (1 << 31)"):
        r = run_python(code, memory_mb=128, isolation=mode)
        assert (r.ok, r.reason) == (False, "memory"), (code, r)
    # a file bigger than the size limit cannot be written either
    r = run_python("open('big', 'wb').write(b'x' * (64 << 20))", memory_mb=256, isolation=mode)
    assert r.reason in ("error", "memory") and not r.ok


@pytest.mark.parametrize("mode", MODES)
def test_writes_outside_the_private_directory_fail(mode, work_dirs, tmp_path):
    target = tmp_path / "pwned.txt"
    for code in (
        f"open({str(target)!r}, 'w').write('x')",
        f"import os; os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY)",
        f"import os; os.mkdir({str(tmp_path / 'pwned_dir')!r})",
        f"import os; os.symlink({str(target)!r}, 'link'); open('link', 'w').write('x')",
        f"import shutil; shutil.rmtree({str(tmp_path)!r})",
    ):
        r = run_python(code, isolation=mode)
        # refused by the hooks, or the host path is simply not there (kernel modes)
        refused = ("PermissionError", "Read-only", "No such file or directory")
        assert not r.ok and any(x in r.stderr for x in refused), code
    assert tmp_path.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", MODES)
def test_no_inherited_secrets(mode, work_dirs, monkeypatch):
    monkeypatch.setenv("GROUPRL_FAKE_SECRET", "hunter2-0c7f")
    r = run_python("import os; print(sorted(os.environ))", isolation=mode)
    assert r.ok and "GROUPRL_FAKE_SECRET" not in r.stdout and "PATH" not in r.stdout
    r = run_python("import os; print(open(f'/proc/{os.getppid()}/environ').read())", isolation=mode)
    assert "hunter2-0c7f" not in r.stdout + r.stderr


@pytest.mark.parametrize("mode", MODES)
def test_no_network(mode, work_dirs):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.3)
    port = server.getsockname()[1]
    code = f"import socket; s = socket.create_connection(('127.0.0.1', {port}), 1); s.send(b'hi')"
    r = run_python(code, isolation=mode)
    assert not r.ok
    with pytest.raises(TimeoutError):
        server.accept()  # nobody connected
    server.close()


@pytest.mark.parametrize("mode", MODES)
def test_megabytes_of_output_are_capped(mode, work_dirs):
    code = "import sys; sys.stdout.write('x' * 5_000_000); sys.stderr.write('y' * 3_000_000)"
    r = run_python(code, isolation=mode, output_cap=1000)
    assert r.ok
    assert r.stdout == "x" * 1000 + "\n[... 4999000 more bytes dropped]"
    assert r.stderr == "y" * 1000 + "\n[... 2999000 more bytes dropped]"


_KILL_PARENT = {
    "kill_ppid": "import os, signal; os.kill(os.getppid(), signal.SIGKILL)",
    "killpg_ppid": "import os, signal; os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
    "kill_group": "import os, signal; os.kill(0, signal.SIGKILL)",
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(_KILL_PARENT))
def test_killing_the_parent_fails(mode, case, work_dirs):
    # the parent here is an intermediate process, so a failure cannot take pytest down with it
    script = light_import_prelude(REPO) + textwrap.dedent(f"""
        from grouprl.envs.sandbox import run_python
        r = run_python({_KILL_PARENT[case]!r}, isolation={mode!r})
        print("survived", r.reason)
    """)
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0 and out.stdout.startswith("survived"), out


# ------------------------------------------------------------------------ output, clean-up
@pytest.mark.parametrize("mode", MODES)
def test_lone_surrogates_and_invalid_bytes_come_back_as_valid_text(mode, work_dirs):
    code = "import sys; sys.stdout.buffer.write(b'ok \\xff\\xfe \\xed\\xa0\\x80'); x = '\\ud800'"
    r = run_python(code + "\nprint(x)", stdin="\ud800", isolation=mode)
    assert r.stdout.startswith("ok \ufffd\ufffd") and r.reason == "error"
    assert "UnicodeEncodeError" in r.stderr  # printing the lone surrogate fails in the child
    (r.stdout + r.stderr).encode("utf-8")  # valid UTF-8 whatever the code wrote
    r = run_python("print(len('\ud800'))", isolation=mode)  # a lone surrogate in the source
    assert r.reason == "error" and "surrogate" in r.stderr


DEEP_TREE = """
import os
import signal
for _ in range(1200):  # deeper than the recursion limit of a recursive rm
    os.mkdir("d")
    os.chdir("d")
open("leaf", "w").write("x")
print("deep")
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_deep_tree_is_cleaned_up_without_recursion(mode, work_dirs):
    r = run_python(DEEP_TREE, isolation=mode, audit_hooks="off", timeout_s=30)
    assert r.ok and r.stdout == "deep\n", r.stderr  # work_dirs checks the directory is gone


def test_remove_tree_handles_depth_and_long_paths(tmp_path):
    top = tmp_path / "top"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY)
    for _ in range(1200):  # deeper than the recursion limit (a recursive rm fails)
        os.mkdir("dd", dir_fd=fd)
        new = os.open("dd", os.O_RDONLY, dir_fd=fd)
        os.close(os.open("f", os.O_CREAT | os.O_WRONLY, dir_fd=new))
        os.symlink("/etc/passwd", "link", dir_fd=new)
        os.close(fd)
        fd = new
    os.close(fd)
    remove_tree(str(top))
    assert not top.exists() and os.path.exists("/etc/passwd")


def test_setsid_grandchildren_of_trusted_code_die(work_dirs):
    marker = "grouprl-trusted-daemon-" + str(os.getpid())
    code = textwrap.dedent(f"""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)",
                                          {marker!r}])
            os._exit(0)
        os.wait()
        time.sleep(0.3)
        print("spawned")
    """)
    r = run_python(code, isolation="trusted", audit_hooks="off")
    assert r.stdout == "spawned\n", r.stderr
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert marker.encode() not in f.read(), f"process {pid} outlived the call"
        except OSError:
            continue


@pytest.mark.skipif(not KERNEL_MODES, reason="needs a kernel mode")
def test_cgroups_of_dead_owners_are_reaped_at_the_next_call():
    """Trainer and keeper both SIGKILLed: the cgroup stays; the next call anywhere removes it."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", light_import_prelude(REPO) + "from grouprl.envs.sandbox import run_python\n"
         "run_python('import time; time.sleep(60)', timeout_s=60)"],
        env={**os.environ, "PYTHONPATH": REPO},
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not _own_cgroups(trainer.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _own_cgroups(trainer.pid)
    keepers = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except OSError:
            continue
        if ppid == trainer.pid:
            keepers.append(int(pid))
    for pid in [trainer.pid, *keepers]:  # all at once: nobody is left to clean up
        os.kill(pid, signal.SIGKILL)
    trainer.wait()
    time.sleep(0.2)
    assert _own_cgroups(trainer.pid)  # left behind...
    assert run_python("print(1)").ok
    assert _own_cgroups(trainer.pid) == []  # ...and reaped by the next call


TAMPER = """
import __main__, builtins, os, socket, sys
for name in list(vars(__main__)):  # the runner's module: every global the hook might read
    if not name.startswith("__"):
        setattr(__main__, name, frozenset() if name.isupper() or name.startswith("_") else None)
builtins.isinstance = lambda *a: False
builtins.PermissionError = KeyError
def tried(fn):
    try:
        fn()
        return "allowed"
    except BaseException as e:
        return type(e).__name__
def fork():
    if os.fork() == 0:
        os._exit(0)
    os.wait()
def reimport():
    sys.modules.pop("_posixsubprocess", None)
    return __import__("_posixsubprocess").fork_exec(*[None] * 23)
print(tried(fork), tried(lambda: socket.socket()), tried(reimport))
"""


def test_audit_hooks_survive_rebinding_every_global():
    """The hook reads nothing the code can rebind (trusted mode: the hooks are all there is)."""
    r = run_python(TAMPER, isolation="trusted")
    assert r.stdout.split() == ["PermissionError", "PermissionError", "ImportError"], r


# -------------------------------------------------------------------------------- seccomp
def _bpf(program: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    """A classic-BPF interpreter for the instructions the filter uses (hand-written oracle)."""
    import struct

    data = struct.pack("=iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    insns = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code in (0x15, 0x35, 0x45):
            hit = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if hit else jf)
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_seccomp_program_decisions(machine):
    prog = seccomp.filter_program(machine)
    arch = seccomp.AUDIT_ARCH[machine]
    x86 = machine == "x86_64"
    allow, eperm = 0x7FFF0000, 0x00050000 | 1
    enosys, kill = 0x00050000 | 38, 0x80000000
    nr = {name: nums[0 if x86 else 1] for name, nums in seccomp.SYSCALLS.items()}
    read_nr, write_nr = (0, 1) if x86 else (63, 64)
    assert _bpf(prog, read_nr, arch) == allow
    assert _bpf(prog, write_nr, arch) == allow
    for name in ("ptrace", "mount", "unshare", "setns", "bpf", "pidfd_open", "pidfd_send_signal",
                 "io_uring_setup", "userfaultfd", "keyctl", "chroot", "pivot_root"):  # fmt: skip
        assert _bpf(prog, nr[name], arch) == eperm, name
    assert _bpf(prog, nr["clone"], arch, (17,)) == allow  # fork: SIGCHLD only
    assert _bpf(prog, nr["clone"], arch, (0x3D0F00,)) == allow  # pthread_create's flags
    assert _bpf(prog, nr["clone"], arch, (0x10000000 | 17,)) == eperm  # CLONE_NEWUSER
    assert _bpf(prog, nr["clone"], arch, (0x20000 | 17,)) == eperm  # CLONE_NEWNS
    assert _bpf(prog, nr["clone3"], arch) == enosys
    assert _bpf(prog, nr["socket"], arch, (1, 1)) == allow  # AF_UNIX
    assert _bpf(prog, nr["socketpair"], arch, (1, 1)) == allow
    for family in (2, 10, 16, 17):  # AF_INET, AF_INET6, AF_NETLINK, AF_PACKET
        assert _bpf(prog, nr["socket"], arch, (family, 1)) == eperm
    assert _bpf(prog, nr["ioctl"], arch, (0, 0x5412)) == eperm  # TIOCSTI
    assert _bpf(prog, nr["ioctl"], arch, (0, 0x5401)) == allow  # TCGETS
    assert _bpf(prog, read_nr, 0x40000003) == kill  # i386 on x86_64: another arch
    if x86:
        assert _bpf(prog, 0x40000000 | 1, arch) == kill  # x32
    with pytest.raises(ValueError, match="riscv64"):
        seccomp.filter_program("riscv64")
