"""The sandbox's root file system: what is bound, read-only, into the fresh tmpfs it pivots into.

`root_layout(libraries, disk_mb)` returns (kind, source, destination) entries, in mount order:
- ("bind", host path, same path): the system library directories (/usr/lib, /lib, ...; kept as
  symlinks where the host has symlinks, as merged-/usr systems do), /etc/ld.so.cache, the
  interpreter's installation (realpath of sys.base_prefix: binary, libpython, standard library;
  under pyenv that is one folder below /root, which is all of /root the sandbox sees) and, with
  libraries="site-packages", the running environment's site-packages (numpy, sympy, ...);
- ("tmpfs", options, "/dev") and ("dev", host node, "/dev/null" | zero | random | urandom), plus
  the /dev/fd, stdin, stdout, stderr links into /proc/self;
- ("tmpfs", "size=...k,mode=0700,...", "/tmp"): the one writable place (cwd, HOME, TMPDIR),
  mounted before the binds, so that an interpreter or venv below the host's /tmp is bound inside
  it (read-only) rather than hidden by it;
- ("dir", "", "/proc"): where the PID namespace's own /proc goes.
Nothing else of the host is there: no /home, /root (but the interpreter), /etc (but the loader
cache), the project checkout, the run directory, the host's /tmp, /dev/shm, /run or /var/run.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from typing import Literal

Libraries = Literal["stdlib", "site-packages"]
SYSTEM_LIB_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32")
DEV_NODES = ("null", "zero", "random", "urandom")
WORK = "/tmp"  # inside: the private directory


def site_packages() -> list[str]:
    """The running environment's site-packages folders (a venv's, else the interpreter's)."""
    paths = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    return sorted(os.path.realpath(p) for p in paths if os.path.isdir(p))


def root_layout(libraries: Libraries, disk_mb: int, uid: int) -> list[tuple[str, str, str]]:
    binds: list[str] = []
    out: list[tuple[str, str, str]] = []
    for d in SYSTEM_LIB_DIRS:
        if os.path.islink(d):
            out.append(("symlink", os.readlink(d), d))
        elif os.path.isdir(d):
            binds.append(d)
    wanted = [os.path.realpath(sys.base_prefix), os.path.dirname(os.path.realpath(sys.executable))]
    if libraries == "site-packages":
        wanted += site_packages()
    elif libraries != "stdlib":
        raise ValueError(f"libraries must be 'stdlib' or 'site-packages', got {libraries!r}")
    kept: list[str] = []
    for path in sorted(set(binds + wanted), key=len):  # parents first; nested ones are covered
        if not any(path == b or path.startswith(b + os.sep) for b in kept):
            kept.append(path)
    # the private tmpfs goes first: a bind below it (a checkout or venv under the host's /tmp, as
    # CI's clone may be) is then mounted inside it instead of being hidden by it
    owner = f",uid={uid},gid={uid}" if uid else ""
    out.append(("tmpfs", f"size={disk_mb * 1024}k,mode=0700{owner}", WORK))
    out += [("bind", p, p) for p in kept]
    if os.path.isfile("/etc/ld.so.cache"):
        out.append(("bind", "/etc/ld.so.cache", "/etc/ld.so.cache"))
    out.append(("tmpfs", "size=64k,mode=0755", "/dev"))
    out += [("dev", f"/dev/{n}", f"/dev/{n}") for n in DEV_NODES]
    out += [("symlink", "/proc/self/fd", "/dev/fd")]
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        out.append(("symlink", f"/proc/self/fd/{i}", f"/dev/{name}"))
    out.append(("dir", "", "/proc"))
    return out
