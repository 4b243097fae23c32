"""The seccomp filter the sandbox's launcher installs right before it execs a model-written program.

Standard library only (the launcher imports it): the classic-BPF program is packed with `struct` and installed
with `prctl(PR_SET_SECCOMP)` through ctypes. No privilege is needed: `no_new_privs`, which the launcher sets
anyway, is what the kernel asks for. The filter is inherited by every child and survives execve, so compilers,
interpreters and whatever they start stay under it.

What it does (errno EPERM unless said otherwise):
- any architecture but the one this interpreter runs on (x86_64 or aarch64) kills the process: an i386
  `int 0x80` has other syscall numbers and would walk past every rule below; x32 calls are refused.
- socket(): at the namespace levels only AF_INET/AF_INET6, which reach nothing but the namespace's downed
  loopback; AF_UNIX (a session D-Bus, a systemd user manager, an X server or ssh-agent socket on a read-only but
  still connectable path), netlink, packet sockets and the rest are refused. At the "none" level every family is
  refused: there is no network namespace there. socketpair() stays allowed for SOCK_STREAM only: a connected
  stream pair reaches no one but the program itself, and asyncio's event loop needs one; a datagram pair's
  socket can sendto() any socket path the program sees (/dev/log, journald, a systemd notify socket).
- calls a scoring program has no use for and an escape would: ptrace and process_vm_readv/writev (the reaper,
  the trainer at the "none" level), mount/umount2/pivot_root/chroot and the new mount API, unshare/setns and
  clone() with a CLONE_NEW* flag (a fresh user namespace gives back every capability), keyrings, bpf,
  perf_event_open, userfaultfd and io_uring (kernel attack surface; io_uring also bypasses this filter),
  kexec, modules, swap, reboot, syslog, acct, quotactl, open_by_handle_at, kcmp, pidfd_getfd.
- SysV IPC (shm*, msg*, sem*) and memfd_create/memfd_secret: RLIMIT_AS counts neither a SysV segment nor a
  memfd's pages, nor does the tmpfs cap (16 memfds of 1 GiB each per program pinned host memory no process's RSS
  shows, so the OOM killer picked the trainer), and a SysV segment outlives its creator (on the host at "none");
  POSIX message queues (mq_*): at "none" a queue is made in the host's IPC namespace, outlives the program and
  counts against the node's limit, and mq_unlink removed the trainer user's own; statmount/listmount (host mount
  paths).
- file locks (flock, fcntl's F_GETLK/F_SETLK/F_SETLKW and their F_OFD_ forms) and inotify/fanotify: programs
  that run side by side (a group's completions, same tests) share the read-only system files, and a lock held or
  an open seen on one of them passed a solver's answer, bit by bit, to a sibling that then scored without solving.
  (Timing channels between programs on one node remain; docs/sandbox.md.)
- calls that act on another process or user: prlimit64, sched_setparam/setscheduler/setaffinity/setattr,
  migrate_pages and move_pages only with pid 0 (the caller), setpriority only (PRIO_PROCESS, 0), ioprio_set only
  (IOPRIO_WHO_PROCESS, 0). At "none" the program shares the trainer's uid and sees its processes (Landlock
  covers neither); elsewhere the rule costs nothing and keeps the filter one.
- chmod/fchmod/fchmodat/fchmodat2 with a setuid or setgid bit in the mode.
- at "none" only (`metadata=True`): the whole chmod, chown, utime and xattr-write families. Landlock does not
  cover them, and the filter cannot tell which path a call names, so it refuses the class (a compiler's chmod
  of its output is best effort; the file is created executable).
- clone3() returns ENOSYS: its flags sit in a struct the filter cannot read, and glibc (2.34+) falls back to
  clone() on ENOSYS, whose flags it can.
"""

from __future__ import annotations

import os
import struct

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM, ENOSYS = 1, 38
AF_INET, AF_INET6 = 2, 10
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET (0x80, NEWTIME, is clone()'s exit signal
# byte, so it can only come through clone3/unshare, both refused).
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
X32_SYSCALL_BIT = 0x40000000

_LD_W_ABS, _JEQ_K, _JSET_K, _RET_K, _AND_K = 0x20, 0x15, 0x45, 0x06, 0x54
SOCK_STREAM, SOCK_TYPE_MASK = 1, 0xF  # socket types beside SOCK_NONBLOCK/SOCK_CLOEXEC in the type argument
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (little endian: args[0]'s low word at 16)

# Denied calls by name; the numbers come from the kernel's tables (arch/x86/entry/syscalls/syscall_64.tbl,
# include/uapi/asm-generic/unistd.h for aarch64); tests/test_sandbox_seccomp.py checks them against the
# installed headers.
DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
          "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr", "unshare", "setns",
          "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
          "io_uring_enter", "io_uring_register", "kexec_load", "kexec_file_load", "init_module", "finit_module",
          "delete_module", "swapon", "swapoff", "reboot", "syslog", "acct", "quotactl", "open_by_handle_at",
          "name_to_handle_at", "kcmp", "pidfd_getfd", "lookup_dcookie", "vhangup",
          "shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semctl",
          "semtimedop", "statmount", "listmount", "memfd_create", "memfd_secret", "mq_open", "mq_unlink",
          "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr", "flock", "inotify_init1",
          "inotify_add_watch", "fanotify_init", "fanotify_mark")
# Denied too where the architecture has them (aarch64 has only the newer call of each pair)
LEGACY = ("inotify_init",)
# fcntl's lock commands (F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW); its other commands
# (F_GETFD, F_SETFL, F_DUPFD_CLOEXEC ...) stay: every runtime uses them
FCNTL_LOCKS = (5, 6, 7, 36, 37, 38)
# Allowed only when every (argument, value) pair matches: the call targets the caller itself.
SELF_ONLY = {"prlimit64": ((0, 0),), "sched_setparam": ((0, 0),), "sched_setscheduler": ((0, 0),),
             "sched_setaffinity": ((0, 0),), "sched_setattr": ((0, 0),), "migrate_pages": ((0, 0),),
             "move_pages": ((0, 0),), "setpriority": ((0, 0), (1, 0)), "ioprio_set": ((0, 1), (1, 0))}
# The mode's argument index: refused with S_ISUID or S_ISGID in it.
MODE_ARG = {"chmod": 1, "fchmod": 1, "fchmodat": 2, "fchmodat2": 2}
S_ISUID_ISGID = 0o6000
# Refused at "none" (where Landlock does not reach them); names an architecture lacks are skipped.
METADATA = ("chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat", "utime", "utimes",
            "futimesat", "utimensat", "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr",
            "fremovexattr", "setxattrat", "removexattrat")
# Newer than some installed kernel headers; the same number on every architecture (the unified table from 424).
UNIFIED = {"memfd_secret": 447, "fchmodat2": 452, "statmount": 457, "listmount": 458, "setxattrat": 463,
           "removexattrat": 466}
SYSCALLS = {
    "x86_64": {
        "socket": 41, "socketpair": 53, "clone": 56, "clone3": 435, "fcntl": 72, "flock": 73, "inotify_init": 253,
        "inotify_add_watch": 254, "inotify_init1": 294, "fanotify_init": 300, "fanotify_mark": 301,
        "memfd_create": 319, "mq_open": 240,
        "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243, "mq_notify": 244, "mq_getsetattr": 245,
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
        "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "move_mount": 429, "open_tree": 428, "mount_setattr": 442, "unshare": 272,
        "setns": 308, "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298,
        "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
        "swapon": 167, "swapoff": 168, "reboot": 169, "syslog": 103, "acct": 163, "quotactl": 179,
        "open_by_handle_at": 304, "name_to_handle_at": 303, "kcmp": 312, "pidfd_getfd": 438,
        "lookup_dcookie": 212, "vhangup": 153, "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67, "msgget": 68,
        "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "semget": 64, "semop": 65, "semctl": 66, "semtimedop": 220,
        "prlimit64": 302, "sched_setparam": 142, "sched_setscheduler": 144, "sched_setaffinity": 203,
        "sched_setattr": 314, "migrate_pages": 256, "move_pages": 279, "setpriority": 141, "ioprio_set": 251,
        "chmod": 90, "fchmod": 91, "fchmodat": 268, "chown": 92, "fchown": 93, "lchown": 94, "fchownat": 260,
        "utime": 132, "utimes": 235, "futimesat": 261, "utimensat": 280, "setxattr": 188, "lsetxattr": 189,
        "fsetxattr": 190, "removexattr": 197, "lremovexattr": 198, "fremovexattr": 199},
    "aarch64": {
        "socket": 198, "socketpair": 199, "clone": 220, "clone3": 435, "fcntl": 25, "flock": 32,
        "inotify_init1": 26, "inotify_add_watch": 27, "fanotify_init": 262, "fanotify_mark": 263,
        "memfd_create": 279, "mq_open": 180,
        "mq_unlink": 181, "mq_timedsend": 182, "mq_timedreceive": 183, "mq_notify": 184, "mq_getsetattr": 185,
        "ptrace": 117, "process_vm_readv": 270,
        "process_vm_writev": 271, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "fsopen": 430,
        "fsconfig": 431, "fsmount": 432, "fspick": 433, "move_mount": 429, "open_tree": 428, "mount_setattr": 442,
        "unshare": 97, "setns": 268, "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280,
        "perf_event_open": 241, "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "kexec_load": 104, "kexec_file_load": 294, "init_module": 105,
        "finit_module": 273, "delete_module": 106, "swapon": 224, "swapoff": 225, "reboot": 142, "syslog": 116,
        "acct": 89, "quotactl": 60, "open_by_handle_at": 265, "name_to_handle_at": 264, "kcmp": 272,
        "pidfd_getfd": 438, "lookup_dcookie": 18, "vhangup": 58, "shmget": 194, "shmat": 196, "shmctl": 195,
        "shmdt": 197, "msgget": 186, "msgsnd": 189, "msgrcv": 188, "msgctl": 187, "semget": 190, "semop": 193,
        "semctl": 191, "semtimedop": 192, "prlimit64": 261, "sched_setparam": 118, "sched_setscheduler": 119,
        "sched_setaffinity": 122, "sched_setattr": 274, "migrate_pages": 238, "move_pages": 239, "setpriority": 140,
        "ioprio_set": 30, "fchmod": 52, "fchmodat": 53, "fchown": 55, "fchownat": 54, "utimensat": 88,
        "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "removexattr": 14, "lremovexattr": 15, "fremovexattr": 16},
}


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def _self_only(number: int, checks: tuple[tuple[int, int], ...]) -> list[bytes]:
    """`number` allowed when args[i] == value for every (i, value) (their low 32 bits: pids, `which` are ints),
    else EPERM. Every path of the block returns, so the syscall number need not be reloaded after it."""
    n = len(checks)
    body = []
    for i, (arg, value) in enumerate(checks):
        last = i == n - 1
        # a mismatch jumps to the EPERM at the end; the last match jumps over it
        body += [_op(_LD_W_ABS, _ARG0 + 8 * arg),
                 _op(_JEQ_K, value, jt=1 if last else 0, jf=0 if last else 2 * (n - 1 - i))]
    body += [_op(_RET_K, RET_ERRNO | EPERM), _op(_RET_K, RET_ALLOW)]
    return [_op(_JEQ_K, number, jf=len(body))] + body


def _refuse_values(number: int, arg: int, values: tuple[int, ...]) -> list[bytes]:
    """`number` refused (EPERM) when args[arg] (its low 32 bits) is one of `values`, else allowed: every path of
    the block returns."""
    m = len(values)
    return ([_op(_JEQ_K, number, jf=m + 3), _op(_LD_W_ABS, _ARG0 + 8 * arg)]
            + [_op(_JEQ_K, v, jt=m - j) for j, v in enumerate(values)]
            + [_op(_RET_K, RET_ALLOW), _op(_RET_K, RET_ERRNO | EPERM)])


def _no_mode_bits(number: int, arg: int) -> list[bytes]:
    return [_op(_JEQ_K, number, jf=4), _op(_LD_W_ABS, _ARG0 + 8 * arg), _op(_JSET_K, S_ISUID_ISGID, jf=1),
            _op(_RET_K, RET_ERRNO | EPERM), _op(_RET_K, RET_ALLOW)]


def build(arch: str, socket_families: tuple[int, ...], metadata: bool = False) -> bytes:
    """The filter for `arch` as packed struct sock_filter entries (see the module docstring); `metadata`: also
    refuse the chmod/chown/utime/xattr families (the "none" level)."""
    if arch not in SYSCALLS:
        raise OSError(f"seccomp: no syscall table for {arch}")
    nr = {**SYSCALLS[arch], **UNIFIED}
    deny = _op(_RET_K, RET_ERRNO | EPERM)
    prog = [_op(_LD_W_ABS, _ARCH), _op(_JEQ_K, AUDIT_ARCH[arch], jt=1), _op(_RET_K, RET_KILL_PROCESS),
            _op(_LD_W_ABS, _NR)]
    if arch == "x86_64":
        prog += [_op(_JSET_K, X32_SYSCALL_BIT, jf=1), deny]
    for name in DENIED + LEGACY + (METADATA if metadata else ()):
        if name in nr:
            prog += [_op(_JEQ_K, nr[name], jf=1), deny]
    for name, checks in SELF_ONLY.items():
        prog += _self_only(nr[name], checks)
    for name, arg in MODE_ARG.items():
        if name in nr:
            prog += _no_mode_bits(nr[name], arg)
    prog += _refuse_values(nr["fcntl"], 1, FCNTL_LOCKS)
    prog += [_op(_JEQ_K, nr["clone3"], jf=1), _op(_RET_K, RET_ERRNO | ENOSYS)]
    m = len(socket_families)
    prog += [_op(_JEQ_K, nr["socket"], jf=m + 3), _op(_LD_W_ABS, _ARG0)]
    prog += [_op(_JEQ_K, fam, jt=m - j) for j, fam in enumerate(socket_families)]
    prog += [deny, _op(_RET_K, RET_ALLOW)]
    prog += [_op(_JEQ_K, nr["socketpair"], jf=5), _op(_LD_W_ABS, _ARG0 + 8), _op(_AND_K, SOCK_TYPE_MASK),
             _op(_JEQ_K, SOCK_STREAM, jf=1), _op(_RET_K, RET_ALLOW), deny]
    prog += [_op(_LD_W_ABS, _NR)]  # the socketpair block left its type in the accumulator
    prog += [_op(_JEQ_K, nr["clone"], jf=3), _op(_LD_W_ABS, _ARG0), _op(_JSET_K, CLONE_NEW_FLAGS, jf=1), deny,
             _op(_RET_K, RET_ALLOW)]
    return b"".join(prog)


def machine() -> str:
    m = os.uname().machine  # not the platform module: ~10 ms of imports in every launcher
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m.lower(), m)


def install(libc, socket_families: tuple[int, ...], metadata: bool = False) -> None:
    """Install the filter on the calling thread (no_new_privs must already be set); raises OSError."""
    import ctypes

    code = build(machine(), socket_families, metadata)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(code, len(code))
    prog = SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter: {os.strerror(err)}")
