"""Test helper: start a daemon the classic way, to check that killing a worker's tree reaches it."""

from __future__ import annotations

import os
import time
from pathlib import Path


def spawn_daemon(pid_file: Path) -> int:
    """fork, setsid, fork again, the middle one exits: a sleeper in its own session, re-parented
    away from its starter. Its pid is written to `pid_file` and returned."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            pid_file.write_text(str(os.getpid()))
            time.sleep(300)
        os._exit(0)
    os.waitpid(pid, 0)
    for _ in range(500):
        if pid_file.exists() and pid_file.read_text():
            return int(pid_file.read_text())
        time.sleep(0.01)
    raise AssertionError("the daemon did not start")
