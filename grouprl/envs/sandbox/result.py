"""What a sandbox call returns, and the error raised when the sandbox itself fails."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Isolation = Literal["auto", "namespaces", "bwrap", "trusted"]
Reason = Literal["ok", "timeout", "memory", "killed", "error"]


class SandboxSetupError(RuntimeError):
    """The sandbox could not be set up (not a failure of the code it was asked to run)."""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one `run_python` call; stdout/stderr are decoded (utf-8, replace) and capped.

    reason: "ok" (exit 0), "error" (non-zero exit), "timeout" (wall clock or CPU limit), "memory"
    (MemoryError under RLIMIT_AS, or the cgroup's OOM killer), "killed" (any other signal).
    """

    ok: bool
    returncode: int | None
    stdout: str
    stderr: str
    reason: Reason
    isolation: str = "namespaces"
    duration_s: float = 0.0
