"""Isolation modes: which one a call gets, and whether this machine offers it.

- "namespaces": the keeper builds the sandbox itself (keeper.py); needs root (the user-namespace
  variant for unprivileged users is not built: use "bwrap" there) and per-call cgroups.
- "bwrap": the same root, namespaces, seccomp filter and cgroups through bubblewrap; needs `bwrap`
  on PATH, user namespaces (bwrap makes one; as root we run it as the call's own uid) and cgroups.
- "trusted": no kernel isolation (rlimits, audit hooks, a private host directory, the keeper's
  subreaper kill, the cgroup where one can be made): for code you trust. Never picked by "auto".
"auto" takes the first of namespaces, bwrap that runs `print(6 * 7)` here (probed once per
process); where neither does, untrusted code is refused with SandboxSetupError.
"""

from __future__ import annotations

import shutil
from functools import lru_cache

from grouprl.envs.sandbox.result import SandboxSetupError

KERNEL_MODES = ("namespaces", "bwrap")
ALLOWED = ("auto", *KERNEL_MODES, "trusted")


def bwrap_path() -> str:
    exe = shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin")
    if exe is None:
        raise SandboxSetupError("isolation='bwrap' needs bubblewrap (`bwrap` in /usr/bin)")
    return exe


def check_available(mode: str) -> None:
    import os

    from grouprl.envs.sandbox import cgroups

    if mode == "namespaces" and os.geteuid() != 0:
        raise SandboxSetupError("isolation='namespaces' needs root here; use 'bwrap'")
    if mode == "bwrap":
        bwrap_path()
    if mode in KERNEL_MODES and not cgroups.available():
        raise SandboxSetupError(f"isolation={mode!r}: {cgroups.why_unavailable()}")


@lru_cache(maxsize=1)
def auto_mode() -> str:
    """The strongest mode that works here, probed once per process; never "trusted"."""
    from grouprl.envs.sandbox.run import run_python

    why = []
    for mode in KERNEL_MODES:
        try:
            r = run_python("print(6 * 7)", timeout_s=10, isolation=mode)
        except SandboxSetupError as e:
            why.append(f"{mode}: {e}")
            continue
        if r.stdout == "42\n":
            return mode
        why.append(f"{mode}: the probe printed {r.stdout!r} ({r.reason}: {r.stderr[-300:]!r})")
    raise SandboxSetupError(
        "no kernel isolation works here, so untrusted code is refused (" + "; ".join(why) + "). "
        "For code you trust, pass isolation='trusted' (no isolation: rlimits and audit hooks only)."
    )


def resolve(isolation: str) -> str:
    if isolation not in ALLOWED:
        hint = " ('hooks' is now 'trusted': code you trust only)" if isolation == "hooks" else ""
        raise ValueError(f"unknown isolation {isolation!r}: allowed are {', '.join(ALLOWED)}{hint}")
    if isolation == "auto":
        return auto_mode()
    check_available(isolation)
    return isolation
