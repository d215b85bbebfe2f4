"""grouprl.envs.sandbox: hostile snippets are contained, the test process survives, nothing leaks.

Every hostile case runs in each isolation mode this machine offers ("hooks" always; "namespaces"
as root; "bwrap" where bubblewrap works); pytest's pass count per id is the number contained.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from grouprl.envs import sandbox
from grouprl.envs.sandbox import SandboxSetupError, run_python


def _works(mode: str) -> bool:
    try:
        return run_python("print(1)", isolation=mode).stdout == "1\n"
    except SandboxSetupError:
        return False


MODES = [m for m in ("namespaces", "bwrap") if _works(m)] + ["hooks"]


@pytest.fixture
def work_dirs(monkeypatch):
    """Records the private directories made, then checks no process and no directory outlived a run."""
    made: list[str] = []
    real_mkdtemp = sandbox.tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):
        made.append(real_mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", mkdtemp)
    yield made
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
    r = run_python("import os; open('a.txt', 'w').write('hi'); print(os.getcwd())", isolation=mode)
    assert r.ok and r.stdout.strip() == work_dirs[-1]


@pytest.mark.parametrize("mode", MODES)
def test_numpy_works_inside(mode, work_dirs):
    pytest.importorskip("numpy")
    r = run_python("import numpy as np; print(int(np.arange(10).sum()))", isolation=mode)
    assert r.ok and r.stdout == "45\n", r.stderr


def test_auto_picks_the_strongest_mode_that_works():
    assert run_python("print(1)").isolation == MODES[0]


def test_bad_arguments_fail_loudly():
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("pass", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("pass", memory_mb=1)
    with pytest.raises(ValueError, match="allowed are auto, namespaces, bwrap, hooks"):
        run_python("pass", isolation="chroot")
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
        assert not r.ok and ("PermissionError" in r.stderr or "Read-only" in r.stderr), code
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
    script = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("sb", {sandbox.__file__!r})
        sb = importlib.util.module_from_spec(spec); sys.modules["sb"] = sb; spec.loader.exec_module(sb)
        r = sb.run_python({_KILL_PARENT[case]!r}, isolation={mode!r})
        print("survived", r.reason)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("survived"), out


# ------------------------------------------------------------------- the OS layers on their own
@pytest.mark.skipif("namespaces" not in MODES, reason="needs root namespaces")
def test_namespace_layers_hold_without_the_audit_hooks(work_dirs, tmp_path):
    def run(code: str):
        return run_python(code, isolation="namespaces", audit_hooks="off", timeout_s=3)

    r = run(f"open({str(tmp_path / 'x')!r}, 'w')")
    assert "Read-only file system" in r.stderr and not (tmp_path / "x").exists()
    r = run("import socket; socket.create_connection(('1.1.1.1', 53), 1)")
    assert "Network is unreachable" in r.stderr
    r = run("import os; print(os.getppid(), len([p for p in os.listdir('/proc') if p.isdigit()]))")
    assert r.stdout == "1 2\n"  # our init and us: the parent and the host's processes are unseen
    storm = textwrap.dedent("""
        import os, time
        n = 0
        try:
            for _ in range(500):
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                n += 1
        except OSError as e:
            print("stopped", e.errno)
        print(n)
    """)
    r = run(storm)
    assert r.stdout.splitlines()[0] == "stopped 11"  # EAGAIN from the pids cgroup
    assert int(r.stdout.splitlines()[1]) <= sandbox.EXTRA_TASKS
    r = run(
        "import subprocess; print(subprocess.run(['mount', '-o', 'remount,rw', '/']).returncode)"
    )
    assert r.stdout.strip() not in ("", "0")  # no capability left to undo the read-only world
