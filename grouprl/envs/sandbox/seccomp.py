"""The sandbox's seccomp filter: a classic-BPF program built by hand (no libseccomp).

`filter_program(machine)` returns the program as raw bytes, an array of `struct sock_filter`
{u16 code; u8 jt; u8 jf; u32 k} in native byte order, which is both what `bwrap --seccomp FD`
reads and what `prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &sock_fprog)` takes (see
keeper.install_seccomp). The program reads `struct seccomp_data` {int nr; u32 arch; u64 ip;
u64 args[6]}: nr at offset 0, arch at 4, the low 32 bits of args[i] at 16 + 8 i (little endian).

Policy (the kernel namespaces, the read-only root and the dropped capabilities are the boundary;
this filter removes the kernel interfaces that those layers do not cover, or that have a long
record of privilege escalations):
- another architecture than the one the filter was built for (i386 via int 0x80 on x86_64) and the
  x32 ABI (nr >= 0x40000000): the process is killed;
- DENIED below: EPERM (ptrace, mounts, namespaces, pidfds, bpf, keyrings, io_uring, userfaultfd,
  perf, modules, kexec, reboot, swap, chroot, file handles, clock / hostname changes, ...);
- clone with any CLONE_NEW* flag: EPERM; clone3 (its flags sit behind a pointer the filter cannot
  read): ENOSYS, so the C library falls back to clone;
- socket / socketpair of any family but AF_UNIX: EPERM (there is no network interface anyway; the
  unix sockets reachable are only those made inside, the host's are neither mounted nor in the
  network namespace's abstract socket space);
- ioctl TIOCSTI / TIOCLINUX (typing into a terminal): EPERM;
- everything else: allowed.
"""

from __future__ import annotations

import errno
import struct
import sys

# classic BPF opcodes (linux/filter.h, linux/bpf_common.h)
LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS: A = u32 at offset k of seccomp_data
JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
RET_K = 0x06  # BPF_RET | BPF_K
# seccomp return values (linux/seccomp.h)
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000
# audit architectures (linux/audit.h)
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000
CLONE_NEW_FLAGS = 0x7E020000  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
AF_UNIX = 1
TIOCSTI, TIOCLINUX = 0x5412, 0x541C

# syscall name -> (x86_64 number, aarch64 number); None: the call does not exist there
SYSCALLS: dict[str, tuple[int | None, int | None]] = {
    "ptrace": (101, 117), "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41),
    "unshare": (272, 97), "setns": (308, 268), "bpf": (321, 280), "keyctl": (250, 219),
    "add_key": (248, 217), "request_key": (249, 218), "pidfd_open": (434, 434),
    "pidfd_send_signal": (424, 424), "pidfd_getfd": (438, 438), "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271), "perf_event_open": (298, 241), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "init_module": (175, 105), "finit_module": (313, 273),
    "delete_module": (176, 106), "io_uring_setup": (425, 425), "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427), "userfaultfd": (323, 282), "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264), "reboot": (169, 142), "swapon": (167, 224),
    "swapoff": (168, 225), "chroot": (161, 51), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "move_mount": (429, 429),
    "open_tree": (428, 428), "open_tree_attr": (467, 467), "mount_setattr": (442, 442),
    "acct": (163, 89),
    "settimeofday": (164, 170), "clock_settime": (227, 112), "clock_adjtime": (305, 266),
    "adjtimex": (159, 171), "sethostname": (170, 161), "setdomainname": (171, 162),
    "quotactl": (179, 60), "quotactl_fd": (443, 443), "personality": (135, 92),
    "syslog": (103, 116), "kcmp": (312, 272), "memfd_secret": (447, 447),
    "fanotify_init": (300, 262), "lookup_dcookie": (212, 18), "vhangup": (153, 58),
    "iopl": (172, None), "ioperm": (173, None), "uselib": (134, None),
    "clone": (56, 220), "clone3": (435, 435), "socket": (41, 198), "socketpair": (53, 199),
    "ioctl": (16, 29),
}  # fmt: skip
DENIED = tuple(n for n in SYSCALLS if n not in ("clone", "clone3", "socket", "socketpair", "ioctl"))


def _nr(name: str, machine: str) -> int | None:
    return SYSCALLS[name][0 if machine == "x86_64" else 1]


def filter_program(machine: str) -> bytes:
    """The filter for `machine` ("x86_64" or "aarch64") as raw sock_filter bytes (module docstring)."""
    if machine not in AUDIT_ARCH:
        raise ValueError(f"no seccomp filter for architecture {machine!r} (x86_64, aarch64)")
    if sys.byteorder != "little":
        raise ValueError("the seccomp filter reads syscall arguments as little-endian")
    # returns sit at the end; a jump names its target, resolved to an offset once all are placed
    prog: list[tuple[int, int | str, int | str, int]] = [
        (LD_W_ABS, 0, 0, 4),  # A = arch
        (JEQ_K, 0, "kill", AUDIT_ARCH[machine]),
        (LD_W_ABS, 0, 0, 0),  # A = nr
    ]
    if machine == "x86_64":
        prog.append((JGE_K, "kill", 0, X32_SYSCALL_BIT))
    for name in DENIED:
        if (nr := _nr(name, machine)) is not None:
            prog.append((JEQ_K, "eperm", 0, nr))
    prog.append((JEQ_K, "clone3", 0, _nr("clone3", machine)))
    prog.append((JEQ_K, "clone", 0, _nr("clone", machine)))
    prog.append((JEQ_K, "socket", 0, _nr("socket", machine)))
    prog.append((JEQ_K, "socket", 0, _nr("socketpair", machine)))
    prog.append((JEQ_K, "ioctl", "allow", _nr("ioctl", machine)))
    labels: dict[str, int] = {}
    for label, body in (
        ("clone", [(LD_W_ABS, 0, 0, 16), (JSET_K, "eperm", "allow", CLONE_NEW_FLAGS)]),
        ("socket", [(LD_W_ABS, 0, 0, 16), (JEQ_K, "allow", "eperm", AF_UNIX)]),
        ("ioctl", [(LD_W_ABS, 0, 0, 24), (JEQ_K, "eperm", 0, TIOCSTI)]),
        ("ioctl_2", [(JEQ_K, "eperm", "allow", TIOCLINUX)]),
        ("allow", [(RET_K, 0, 0, RET_ALLOW)]),
        ("eperm", [(RET_K, 0, 0, RET_ERRNO | errno.EPERM)]),
        ("clone3", [(RET_K, 0, 0, RET_ERRNO | errno.ENOSYS)]),
        ("kill", [(RET_K, 0, 0, RET_KILL_PROCESS)]),
    ):
        labels[label] = len(prog)
        prog.extend(body)
    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(prog):
        offsets = [labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf)]
        if not all(0 <= o <= 255 for o in offsets):
            raise AssertionError(f"seccomp jump out of range at instruction {i}: {offsets}")
        out += struct.pack("=HBBI", code, offsets[0], offsets[1], k)
    return bytes(out)
