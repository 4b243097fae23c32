"""Landlock for the sandbox's "none" level: without namespaces, the kernel's unprivileged access control is what
keeps a program that runs as the trainer's own user out of that user's files and processes.

Standard library only (the launcher imports it). Applied by the launcher right before execve, after
no_new_privs, so it needs no privilege. What it takes away (each where the running kernel's Landlock ABI has
it; `abi()` says which, 0 when Landlock is off):
- ABI 1+: writing, creating, removing or renaming anything outside the work dir (/dev/null stays writable;
  already open stdout/stderr are not affected). Reading stays allowed, as at the "userns" level.
- ABI 4+: TCP bind/connect (the seccomp filter already refuses sockets at this level).
- ABI 6+: signals to processes outside the program's own tree (the trainer, its reaper) and abstract UNIX
  sockets. Landlock also refuses ptrace and /proc/PID/mem of processes outside the domain at every ABI.
"""

from __future__ import annotations

import os
import struct

_CREATE, _ADD_RULE, _RESTRICT = 444, 445, 446  # the same numbers on x86_64 and aarch64
_VERSION_FLAG, _RULE_PATH_BENEATH = 1, 1
WRITE_FILE, REMOVE_DIR, REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
MAKE = sum(1 << b for b in range(6, 13))  # char, dir, reg, sock, fifo, block, sym
REFER, TRUNCATE = 1 << 13, 1 << 14
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1, 2


def abi(libc=None) -> int:
    import ctypes

    libc = libc or ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    version = libc.syscall(ctypes.c_long(_CREATE), None, ctypes.c_size_t(0), ctypes.c_uint32(_VERSION_FLAG))
    return max(0, int(version))


def restrict(libc, work_dir: str) -> int:
    """Confine the calling process to writing under `work_dir`; returns the ABI applied (0: unavailable)."""
    import ctypes

    version = abi(libc)
    if version < 1:
        return 0
    write = WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE | (REFER if version >= 2 else 0) | (
        TRUNCATE if version >= 3 else 0)
    attr = struct.pack("=Q", write)
    if version >= 4:
        attr += struct.pack("=Q", NET_BIND_TCP | NET_CONNECT_TCP)
    if version >= 6:
        attr += struct.pack("=Q", SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL)
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = libc.syscall(ctypes.c_long(_CREATE), buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock_create_ruleset: {os.strerror(err)}")
    try:
        for path, allowed in ((work_dir, write), ("/dev/null", WRITE_FILE | (TRUNCATE if version >= 3 else 0))):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = ctypes.create_string_buffer(struct.pack("=Qi", allowed, fd), 12)
                if libc.syscall(ctypes.c_long(_ADD_RULE), ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                                rule, ctypes.c_uint32(0)) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"landlock_add_rule {path}: {os.strerror(err)}")
            finally:
                os.close(fd)
        if libc.syscall(ctypes.c_long(_RESTRICT), ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"landlock_restrict_self: {os.strerror(err)}")
    finally:
        os.close(ruleset)
    return version
