"""Landlock, the kernel's unprivileged access control, for every sandbox level.

At every level it confines reads: a program reads and executes only the system's software (`SYSTEM`), its own
interpreter's or compiler's installation (`readable_for`) and its own dirs, so it cannot read the training data
(the test cases' expected outputs) wherever they lie, nor the user's files: reading is the one thing namespaces
and a slot uid leave it (every mount stays readable; the trainer's user's files, or the world-readable ones).
At the "none" level (no namespaces) it is also what keeps a program that runs as the trainer's own user out of
that user's files and processes.

Standard library only (the launcher imports it). Applied by the launcher right before execve, after
no_new_privs, so it needs no privilege. What it takes away (each where the running kernel's Landlock ABI has
it; `abi()` says which, 0 when Landlock is off):
- ABI 1+: reading a file, listing a dir or executing a file outside those paths; at the "none" level writing,
  creating, removing or renaming anything outside the work dir (/dev/null stays writable; already open
  stdout/stderr are not affected).
- ABI 4+: TCP bind/connect (the seccomp filter already refuses sockets at the "none" level).
- ABI 6+: signals to processes outside the program's own tree (the trainer, its reaper) and abstract UNIX
  sockets. Landlock also refuses ptrace and /proc/PID/mem of processes outside the domain at every ABI.
"""

from __future__ import annotations

import os
import stat
import struct

_CREATE, _ADD_RULE, _RESTRICT = 444, 445, 446  # the same numbers on x86_64 and aarch64
_VERSION_FLAG, _RULE_PATH_BENEATH = 1, 1
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR, REMOVE_DIR, REMOVE_FILE = 1, 1 << 1, 1 << 2, 1 << 3, 1 << 4, 1 << 5
READ = EXECUTE | READ_FILE | READ_DIR
MAKE = sum(1 << b for b in range(6, 13))  # char, dir, reg, sock, fifo, block, sym
REFER, TRUNCATE = 1 << 13, 1 << 14
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE  # what a rule on a file (not a dir) may grant
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1, 2


def abi(libc=None) -> int:
    import ctypes

    libc = libc or ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    version = libc.syscall(ctypes.c_long(_CREATE), None, ctypes.c_size_t(0), ctypes.c_uint32(_VERSION_FLAG))
    return max(0, int(version))


# The system's software: what a program's interpreter, compiler, loader and libc read. Data lives elsewhere
# (home, project, scratch and dataset dirs, the HF cache); a site that keeps datasets under /usr or /etc has them
# readable again.
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc",
          "/sys/devices/system/cpu")  # glibc counts the CPUs there (sysconf), Python's os.cpu_count with it
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


def readable_for(executable: str) -> list[str]:
    """Beyond SYSTEM, what running `executable` reads: its installation (the prefix above its bin/, where the
    interpreter or compiler lives outside /usr: a uv or conda Python, a module's gcc) and, for a venv's Python,
    the venv (its pyvenv.cfg and site-packages). A program built in the work dir adds nothing."""
    out = []
    for path in (executable, os.path.realpath(executable)):
        bindir = os.path.dirname(os.path.abspath(path))
        if os.path.basename(bindir) == "bin":
            out.append(os.path.dirname(bindir))
    return out


def restrict(libc, work_dir: str | None, readable: tuple[str, ...] = ()) -> int:
    """Confine the calling process: reading, listing and executing only beneath `readable`, the DEVICES and
    `work_dir`; with `work_dir` (the "none" level) also writing only beneath it. Paths that do not exist are
    skipped. Returns the ABI applied (0: unavailable)."""
    import ctypes

    version = abi(libc)
    if version < 1:
        return 0
    write = WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE | (REFER if version >= 2 else 0) | (
        TRUNCATE if version >= 3 else 0)
    handled = READ | (write if work_dir is not None else 0)
    attr = struct.pack("=Q", handled)
    if work_dir is not None and version >= 4:
        attr += struct.pack("=Q", NET_BIND_TCP | NET_CONNECT_TCP)
    if work_dir is not None and version >= 6:
        attr += struct.pack("=Q", SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL)
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = libc.syscall(ctypes.c_long(_CREATE), buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock_create_ruleset: {os.strerror(err)}")
    rules = [(p, READ) for p in readable] + [(p, READ_FILE) for p in DEVICES]
    if work_dir is not None:
        rules += [(work_dir, READ | write), ("/dev/null", READ_FILE | WRITE_FILE | (TRUNCATE if version >= 3 else 0))]
    try:
        for path, allowed in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    allowed &= FILE_RIGHTS
                rule = ctypes.create_string_buffer(struct.pack("=Qi", allowed & handled, fd), 12)
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
