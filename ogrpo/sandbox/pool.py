"""Run untrusted, model-written programs (Python, C, C++) locally, contained, many at a time.

Process tree of one run (L = launcher, a fresh interpreter running launcher.py; I = reaper; P = the program):

    trainer thread --Popen--> L (root or the trainer's uid, own session)
        L: [join a memory cgroup]; ["userns" as root: become the slot uid]; unshare(net, pid, mount, ipc, uts
           [, user]); /tmp, /var/tmp, /dev/shm, /run/lock <- a size-capped tmpfs holding a copy of the program
           (a compile run: the host work dir); every other mount remounted read-only; not dumpable
        L --fork--> I (pid 1 of the new pid namespace; dies with L through PDEATHSIG)
            I: mounts a private /proc, reaps everything, reports P's status on fd 3 as one JSON object
            I --fork--> P: rlimits; ["userns": a nested user namespace where it is uid 1000] [root: the slot
               uid]; empty capability bounding set, no_new_privs, SIGPIPE/SIGXFSZ to default, seccomp filter;
               execve(program)

Why this shape:
- Containment comes from the kernel, not from the program's cooperation. When I exits (P finished, or the
  trainer SIGKILLs the process group on the wall-clock timeout) the kernel kills every process left in the pid
  namespace, so a fork bomb's descendants, daemons and setsid() escapes all go with it.
- The program holds no privilege it can use. At the "root" level it runs as the slot's uid with no
  capabilities; at the "userns" level the launcher must be root of its user namespace to mount, so the
  program gets a nested user namespace mapping uid 1000 onto that root: its capabilities there are gone at
  execve (non-zero uid), and the mount, pid and network namespaces belong to the outer namespace, where it
  never had any. Remount, umount, a new /proc and a new user namespace fail with EPERM; the bounding set is
  empty and no_new_privs is set, so nothing it execs gains one. The launcher and the reaper are not dumpable:
  a program of the same host uid can neither ptrace them nor open their /proc/PID/fd (the status pipe).
- The status report is parsed as data (JSON, each field type-checked), never unmarshalled.
- RLIMIT_NPROC counts processes per real uid and is not enforced for host uid 0. As root, each worker slot
  runs its programs under its own unprivileged uid at every level ("userns" maps it into the namespace), so the
  limit applies and one program's fork bomb cannot use up another's budget; the uid also keeps it out of root's
  files. Slot uids are unique on the node: each is held through an flock on a file named by it under a
  root-owned dir (/run/ogrpo-sandbox-slots), so two pools (one process or two trainers) never share one. For an
  unprivileged trainer at "userns", Linux 5.14+ counts NPROC per user namespace; at "none" the program shares
  the trainer's uid, so its limit is that uid's task count at launch (the trainer's threads, sibling runs) plus
  `Limits.nproc`.
- Writes: the run's tmpfs is the only writable place (64 MiB, 8,192 inodes by default: what a program writes
  costs no disk and needs no cleanup, since the tmpfs goes with its mount namespace). Every other mount of the
  private mount namespace is remounted read-only, which also covers a site's 1777 /scratch and everything the
  trainer's own uid could write. Compile runs write their binary to the host work dir (the compiler is not the
  model's code); host work dirs are removed by ogrpo/sandbox/cleanup.py's background thread.
- A new network namespace has only a downed loopback: connect() to 127.0.0.1 fails with ENETUNREACH. The
  seccomp filter (ogrpo/sandbox/seccomp.py) refuses AF_UNIX and every other non-IP socket, which a
  network namespace does not cover (a filesystem socket such as a session D-Bus is reachable from any netns),
  plus ptrace, mounts, new namespaces, keyrings, bpf, io_uring and the like. RLIMIT_NOFILE (64) bounds the
  kernel memory a program can pin in socket buffers and pipes.
- Memory: RLIMIT_AS per process, and where this process may create cgroup v2 children with the memory
  controller (a delegated subtree, a container's own cgroup namespace), a cgroup per run whose memory.max
  covers the whole tree, kernel memory and tmpfs included (`Sandbox.memory_limit`).
- The trainer process never forks Python: a bounded ThreadPoolExecutor whose threads only call subprocess.Popen
  (fork immediately followed by exec in C, no Python code in between), so no CUDA context, NCCL state or held
  lock is copied into a child that could use it. Without preexec_fn/user/group, CPython (3.10+) starts the
  launcher with vfork, so a trainer with tens of GiB mapped pays no page-table copy per program; that is why
  the uid change and the rlimits happen in the launcher, not through Popen's arguments.
- stdin/stdout/stderr are memfds (files on no path: no other run can read them), so output is bounded by
  RLIMIT_FSIZE (SIGXFSZ past it, reset from Python's "ignored" before execve) instead of being read into the
  trainer's memory, and there are no pipes to deadlock on. Inside the mount namespace tmp_root itself is covered
  by an empty read-only tmpfs: the program sees no other run's work dir, whatever TMPDIR is.

Isolation levels (`Sandbox.isolation`):
- "root": all of the above (needs CAP_SYS_ADMIN, e.g. the tests here, containers run as root).
- "userns": the same through an unprivileged user namespace (the usual case on a cluster). The program writes
  nothing outside its tmpfs; without Landlock it can read what the trainer's user can read (e.g. a token under
  $HOME, the training data).
- "none": no namespaces; only with an explicit opt-in (`Sandbox(isolation="none")`, the recipe's
  `ogrpo.sandbox: none`): rlimits, the seccomp filter with every socket family refused, a kill of the program's
  process tree (a child subreaper; as root also the slot uid's processes), the slot uid when root, Landlock
  where the kernel has it (ogrpo/sandbox/landlock.py: writes only in the work dir; from ABI 6 no signals
  to processes outside its tree; no ptrace or /proc/PID/mem of them), and for Python programs an audit hook
  refusing subprocesses, ctypes and _posixsubprocess. The program runs as the trainer's user when the trainer
  is not root: on a kernel without Landlock it can read and write that user's files; it sees the node's
  processes. `isolation="auto"` probes "root" then "userns" and raises SandboxUnavailable when neither
  works: it never falls back to "none" silently.
At every level, where the kernel has Landlock, a program reads only the system's software, its interpreter's
or compiler's installation and its own dirs (ogrpo/sandbox/landlock.py): not the training data, whose test
cases hold the expected outputs, nor the user's files.

Remote executors (E2B, Piston, Morph in open-r1) stay out. A site that has one plugs it in as a reward function
(`my_pkg.rewards:score` in `reward_funcs`) calling its client; the helpers in ogrpo/rewards/code.py (`extract_code`,
`lines_match`) are plain functions it can reuse to score the same way.

This module is the trainer side (the pool, slots, uids, cgroups, the launch); L is launcher.py (`python -P -S -m
ogrpo.sandbox.launcher`, reading a marshal of the run written by the trainer from the memfd named by
OGRPO_SBX_SPEC_FD), which imports only the standard library (and its seccomp/landlock siblings).
"""

from __future__ import annotations

import fcntl
import json
import marshal
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from ogrpo.errors import OgrpoError
from ogrpo.sandbox import landlock
from ogrpo.sandbox import launcher as _launcher  # each run's program; loaded here, its bytecode is cached for -m
from ogrpo.sandbox.cleanup import CLEANER

_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"

MIB = 1024**2
GIB = 1024**3

LANGUAGES = ("python", "c", "cpp")
_UID_BASE, _UIDS_PER_PROCESS = 1_879_048_192, 256  # 0x70000000: up to 0x71000000, below 2**31 for old tools
_UID_SPAN = 1 << 24
# Root-owned and not writable by others (checked): a lock file per slot uid held by the pool using it.
_SLOT_DIRS = ("/run/ogrpo-sandbox-slots", "/dev/shm/ogrpo-sandbox-slots")

# Run statuses. Only "ok" means the program exited 0 in time.
OK, ERROR, SIGNALED, CPU_LIMIT, TIMEOUT, COMPILE_ERROR, SANDBOX_ERROR = (
    "ok", "error", "signal", "cpu_limit", "timeout", "compile_error", "sandbox_error")


class SandboxUnavailable(OgrpoError):
    """No isolating level works here and none was opted out of: code rewards refuse to run."""


@dataclass(frozen=True)
class Limits:
    """Per-process limits of one run. Defaults follow open-r1's evaluation script (5 s per test case)."""

    cpu_s: int = 5                  # RLIMIT_CPU soft limit (SIGXCPU); the hard limit is one second later
    wall_s: float = 5.0             # wall clock, then the whole process tree is killed
    memory_bytes: int = 1 * GIB     # RLIMIT_AS: a Python interpreter maps ~30 MiB, a C program far less
    file_bytes: int = 16 * MIB      # RLIMIT_FSIZE: any file, stdout/stderr included
    nproc: int = 16                 # RLIMIT_NPROC (processes + threads of the slot's uid)
    nofile: int = 64                # RLIMIT_NOFILE: open files, sockets and pipes (socket buffers are kernel memory)
    disk_bytes: int = 64 * MIB      # the size of a program run's private tmpfs (its /tmp and working dir)
    inodes: int = 8192              # files and directories it may hold
    output_bytes: int = 1 * MIB     # how much of stdout/stderr is read back


# gcc/g++ run cc1/cc1plus, as, collect2 and ld: more memory, more processes, bigger files than a test run.
COMPILE_LIMITS = Limits(cpu_s=20, wall_s=30.0, memory_bytes=4 * GIB, file_bytes=64 * MIB, nproc=32)


@dataclass
class RunResult:
    status: str
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    returncode: int | None = None
    signal: int | None = None
    cpu_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == OK


@dataclass
class Job:
    """One program and the stdin of each of its runs; compiled once when the language needs it."""

    source: str
    language: str = "python"
    inputs: list[str] = field(default_factory=lambda: [""])
    stop_on: tuple[str, ...] = ()  # statuses after which the remaining inputs are not run (e.g. TIMEOUT)


@dataclass
class JobResult:
    compile: RunResult | None
    runs: list[RunResult]


class Sandbox:
    """A bounded pool that runs jobs in parallel, each contained as described in the module docstring.

    `max_workers` defaults to the CPU cores this process may use (its affinity mask, i.e. the Slurm
    allocation, not the node). As root, programs run as `max_workers` slot uids taken from [uid_base,
    uid_base + 2**24) (they need no passwd entry and must not belong to anyone); each is locked node-wide while
    this pool or one of its launchers holds it, so no other pool or trainer on the node gets it. The default
    range is far above login and subuid ranges.
    """

    def __init__(self, max_workers: int | None = None, limits: Limits = Limits(),
                 compile_limits: Limits = COMPILE_LIMITS, isolation: str = "auto", uid_base: int | None = None,
                 python: str | None = None, cc: str = "gcc", cxx: str = "g++",
                 c_flags: tuple[str, ...] = ("-O2", "-std=gnu17", "-lm"),
                 cxx_flags: tuple[str, ...] = ("-O2", "-std=gnu++17", "-lm"),
                 tmp_root: str | None = None):
        cores = len(os.sched_getaffinity(0))
        self.max_workers = max(1, int(max_workers or cores))
        if self.max_workers > _UIDS_PER_PROCESS:
            raise OgrpoError(f"sandbox max_workers={self.max_workers}: at most {_UIDS_PER_PROCESS} per process")
        if isolation not in ("auto", "root", "userns", "none"):
            raise OgrpoError(f"sandbox isolation {isolation!r}: use auto, root, userns or none")
        self.limits, self.compile_limits = limits, compile_limits
        self.uid_base = uid_base if uid_base is not None else _UID_BASE
        self.cc, self.cxx, self.c_flags, self.cxx_flags = cc, cxx, tuple(c_flags), tuple(cxx_flags)
        self.tmp_root = tmp_root
        self._slots: "list[int]" = list(range(self.max_workers))
        self._slots_lock = threading.Condition()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        # Root runs programs as the slot's uid at every level ("userns" maps it into the namespace).
        self.drop_uid = os.geteuid() == 0
        self._slot_uids: list[int] = []
        self._slot_locks: list[int] = []
        weakref.finalize(self, _release_locks, self._slot_locks)
        self._claim_slot_uids()
        self.python = python or _python_for(self.drop_uid)
        # what the programs' interpreter and compilers read, beside the system's software (landlock.py)
        self.readable = sorted({*_python_prefixes(self.python),
                                *(d for c in (cc, cxx) for d in landlock.readable_for(
                                    shutil.which(c, path=_SAFE_PATH) or c))})
        self.probe_errors: dict[str, str] = {}
        self.landlock = landlock.abi()  # reads confined at every level, writes and signals at "none" (0: none)
        self.cgroup_parent = _memory_cgroup()
        self._cgroup_seq = 0
        self.isolation = self._probe() if isolation == "auto" else isolation
        if self.isolation == "unavailable":
            why = "; ".join(f"{k}: {v}" for k, v in self.probe_errors.items())
            raise SandboxUnavailable(
                f"sandbox: no isolating level works on this node ({why}); model-written programs are not run "
                "without one. Allow unprivileged user namespaces (sysctl user.max_user_namespaces > 0, "
                "kernel.unprivileged_userns_clone=1, kernel.apparmor_restrict_unprivileged_userns=0, no seccomp "
                "profile denying unshare) or opt in to running "
                "them unisolated with `ogrpo: {sandbox: none}` in the recipe")
        # a Python that cannot start in it would score every program 0, silently: say so now
        run = self.run("print(6 * 7)", "python", limits=Limits(wall_s=30.0))
        if run.stdout.strip() != "42":
            why = ((run.stderr or run.status).strip().splitlines() or [run.status])[-1]
            raise SandboxUnavailable(f"sandbox ({self.isolation}): Python programs do not start in it "
                                     f"({self.python}: {why})")

    # --- public API ------------------------------------------------------------------------------------------
    def run(self, source: str, language: str = "python", stdin: str = "", limits: Limits | None = None) -> RunResult:
        """Compile if needed, then run once. Never raises for anything the program does."""
        res = self.run_jobs([Job(source, language, [stdin])], limits=limits)[0]
        return res.runs[0] if res.runs else res.compile

    def run_jobs(self, jobs: list[Job], limits: Limits | None = None) -> list[JobResult]:
        """All jobs in parallel over the pool, results in order."""
        pool = self._executor()
        futures = [pool.submit(self._run_job, job, limits or self.limits) for job in jobs]
        return [f.result() for f in futures]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        CLEANER.drain()  # the work dirs of this pool's runs are gone when close() returns
        _release_locks(self._slot_locks)  # nothing of theirs is left: another pool may have them

    @property
    def memory_limit(self) -> str:
        """"cgroup" (one memory.max for the run's whole process tree, kernel memory and tmpfs included) where
        this process may create cgroup v2 children with the memory controller, else "rlimit" (RLIMIT_AS per
        process)."""
        return "cgroup" if self.cgroup_parent else "rlimit"

    def describe(self) -> dict:
        """The isolation in force, as logged once per run and recorded in the manifest."""
        detail = {
            "root": "namespaces, programs as a slot uid, empty capability bounding set, no_new_privs, seccomp",
            "userns": "user namespace; programs as uid 1000 of a nested one (no capabilities), no_new_privs, seccomp",
            "none": "no namespaces: rlimits, seccomp (no sockets), Python audit hook"
                    + (", a slot uid" if self.drop_uid else "; programs run as the trainer's user")
                    + (", Landlock: writes only in the work dir" if self.landlock
                       else ", no Landlock: programs can write what that user can"),
        }[self.isolation]
        detail += (f"; Landlock ABI {self.landlock}: reads only of the system's software and the program's own"
                   if self.landlock else "; no Landlock: programs read what their uid may (the training data too)")
        return {"isolation": self.isolation, "detail": detail, "memory": self.memory_limit,
                "landlock": self.landlock,
                "slot_uids": bool(self.drop_uid), "max_workers": self.max_workers}

    def uids(self) -> list[int]:
        """The uids programs run under (empty when they keep the trainer's uid)."""
        return list(self._slot_uids)

    # --- internals -------------------------------------------------------------------------------------------
    def _claim_slot_uids(self) -> None:
        if self.drop_uid and not self._slot_locks:
            self._slot_uids[:] = _claim_uids(self.uid_base, self.max_workers, self._slot_locks)

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._claim_slot_uids()  # given back by close()
                self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="ogrpo-sandbox")
            return self._pool

    def _probe(self) -> str:
        """The strongest level that actually runs a program here (the kernel or a container may forbid some);
        "unavailable" when none isolates. "none" is never chosen by probing: only by the caller's opt-in."""
        candidates = (["root"] if os.geteuid() == 0 else []) + ["userns"]
        for level in candidates:
            self.isolation = level
            for _ in range(2 if self.cgroup_parent else 1):
                res = self._run_job(Job("", "exec:/bin/true"), Limits(wall_s=10.0))
                run = res.runs[0] if res.runs else res.compile
                if run is not None and run.ok:
                    return level
                why = ((run.stderr if run else "") or "no result").strip().splitlines()[-1]
                self.probe_errors[level] = why
                if self.cgroup_parent:  # a cgroup the kernel would not let us use must not cost the level
                    self.probe_errors["cgroup"] = why
                    self.cgroup_parent = None
        return "unavailable"

    def _run_job(self, job: Job, limits: Limits) -> JobResult:
        # A slot (and its uid) comes back only once the cleaner has removed its work dir: a later program of
        # the same uid must find no tree of it left to tamper with while it is being removed.
        with self._slots_lock:
            self._slots_lock.wait_for(lambda: self._slots)
            slot = self._slots.pop()
        top = None
        try:
            top = tempfile.mkdtemp(prefix="ogrpo-sbx-", dir=self.tmp_root)
            return self._run_job_in_slot(job, limits, slot, top)
        except Exception as exc:  # a sandbox failure is a failed run, never a crashed reward stage
            return JobResult(None, [RunResult(SANDBOX_ERROR, stderr=f"{type(exc).__name__}: {exc}")])
        finally:
            if top is None:
                self._free_slot(slot)
            else:  # off the trainer's path: a hostile tree can take seconds to remove
                CLEANER.submit(top, lambda: self._free_slot(slot))

    def _free_slot(self, slot: int) -> None:
        with self._slots_lock:
            self._slots.append(slot)
            self._slots_lock.notify()

    def _run_job_in_slot(self, job: Job, limits: Limits, slot: int, top: str) -> JobResult:
        uid = self._slot_uids[slot] if self.drop_uid else None
        lock = self._slot_locks[slot] if self.drop_uid else None
        os.chmod(top, 0o711)  # the program may cross it to reach work/, not list or write it
        work = os.path.join(top, "work")
        os.mkdir(work, 0o700)
        if uid is not None:
            os.chown(work, uid, uid)
        compile_res, argv = self._build(job, work, uid, lock)
        if compile_res is not None and not compile_res.ok:
            compile_res.status = COMPILE_ERROR if compile_res.status == ERROR else compile_res.status
            return JobResult(compile_res, [])
        # At the namespace levels a program run works on its own tmpfs, holding a copy of what it runs.
        copy = [argv[-1].removeprefix("./")] if self.isolation != "none" and not job.language.startswith(
            "exec:") else None
        runs = []
        for stdin in job.inputs:
            cgroup = self._cgroup(limits)
            try:
                res = _launch(argv, stdin, work, uid, limits, self.isolation, job.language == "python",
                              copy, cgroup, lock, self.readable)
            finally:
                _remove_cgroup(cgroup)
            runs.append(res)
            if res.status in job.stop_on:
                break
        return JobResult(compile_res, runs)

    def _cgroup(self, limits: Limits) -> str | None:
        if not self.cgroup_parent:
            return None
        with self._slots_lock:
            self._cgroup_seq += 1
            path = os.path.join(self.cgroup_parent, f"ogrpo-sbx-{os.getpid()}-{self._cgroup_seq}")
        os.mkdir(path)
        for name, value in (("memory.max", limits.memory_bytes), ("memory.swap.max", 0),
                            ("pids.max", limits.nproc * 4)):
            try:
                with open(os.path.join(path, name), "w") as f:
                    f.write(str(value))
            except FileNotFoundError:  # swap accounting or the pids controller off: memory.max is what counts
                if name == "memory.max":
                    raise
        return path

    def _build(self, job: Job, work: str, uid: int | None, lock: int | None) -> tuple[RunResult | None, list[str]]:
        lang = job.language
        if lang.startswith("exec:"):  # an existing binary (the probe)
            return None, [lang[5:]]
        if lang not in LANGUAGES:
            return RunResult(SANDBOX_ERROR, stderr=f"unknown language {lang!r}; use one of {LANGUAGES}"), []
        name = {"python": "main.py", "c": "main.c", "cpp": "main.cpp"}[lang]
        path = os.path.join(work, name)
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(job.source)
        if uid is not None:
            os.chown(path, uid, uid)
        if lang == "python":
            return None, [self.python, "-I", "-B", name]
        compiler, flags = (self.cc, self.c_flags) if lang == "c" else (self.cxx, self.cxx_flags)
        compiler = shutil.which(compiler, path=_SAFE_PATH) or compiler
        cgroup = self._cgroup(self.compile_limits)
        try:
            res = _launch([compiler, name, "-o", "prog", *flags], "", work, uid, self.compile_limits,
                          self.isolation, False, None, cgroup, lock, self.readable)
        finally:
            _remove_cgroup(cgroup)
        if res.ok:
            _make_executable(os.path.join(work, "prog"))
        return res, ["./prog"]

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _make_executable(path: str) -> None:
    """At "none" the filter refuses the linker's chmod of its output (the whole chmod family: Landlock does not
    cover it), which it does best effort; the trainer adds the x bits, on the file itself (never a symlink)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # no output: the run reports it
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            os.fchmod(fd, (st.st_mode & 0o777) | 0o111)
    finally:
        os.close(fd)


def _slot_dir() -> int:
    """An fd of the node-wide dir of slot locks: made by root, owned by root and writable by nobody else (a
    dir someone else made could hold anything)."""
    for path in _SLOT_DIRS:
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            pass
        except OSError:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        st = os.fstat(fd)
        if st.st_uid == 0 and not st.st_mode & 0o022:
            return fd
        os.close(fd)
    raise OgrpoError(f"sandbox: no root-owned directory for the slot uid locks (tried {', '.join(_SLOT_DIRS)})")


def _claim_uids(base: int, count: int, locks: list[int]) -> list[int]:
    """The first `count` uids from `base` that nothing on the node holds: each is held by an exclusive flock on a
    file named by it, released by close() or this process's exit, and by every launcher still running as it
    (each inherits the lock: a uid whose program outlived a killed trainer stays taken). Searching from `base`
    keeps the lock files as few as the node's most slots at once."""
    dfd = _slot_dir()
    uids: list[int] = []
    try:
        for i in range(_UID_SPAN):
            uid = base + i
            fd = os.open(str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            locks.append(fd)
            uids.append(uid)
            if len(uids) == count:
                return uids
    finally:
        os.close(dfd)
    _release_locks(locks)
    raise OgrpoError(f"sandbox: no {count} free slot uids from {base}")


def _release_locks(locks: list[int]) -> None:
    while locks:
        os.close(locks.pop())


def _memory_cgroup() -> str | None:
    """This process's cgroup v2 directory when children made in it get the memory controller and this process
    may create them (a delegated subtree, or the root cgroup of a container's own cgroup namespace)."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((line[3:].strip() for line in f if line.startswith("0::")), None)
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split(" - ")[0].split()[4] for line in f if " - cgroup2 " in line]
        if rel is None or not mounts:
            return None
        path = os.path.join(mounts[0], rel.lstrip("/"))
        with open(os.path.join(path, "cgroup.subtree_control")) as f:
            enabled = f.read().split()
        if "memory" in enabled and os.access(path, os.W_OK) and os.access(os.path.join(path, "cgroup.procs"),
                                                                        os.W_OK):
            return path
    except OSError:
        pass
    return None


def _remove_cgroup(path: str | None) -> None:
    """The launcher has exited and the pid namespace (or the sweep) has taken every process: it is empty."""
    if path is None:
        return
    for _ in range(100):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY while the last exits are accounted
            time.sleep(0.01)


def _python_for(drop_uid: bool) -> str:
    """An interpreter the sandbox uid can execute: the trainer's may live under a 0700 home (pyenv in /root)."""
    candidates = [sys.executable, shutil.which("python3", path=_SAFE_PATH) or "/usr/bin/python3"]
    if not drop_uid:
        return candidates[0]
    for cand in candidates:
        if _world_executable(cand):
            return cand
    return candidates[-1]


def _python_prefixes(python: str) -> list[str]:
    """The installation dirs `python` reads at start-up (its venv, its base install), as it reports them."""
    code = "import sys; print('\\n'.join({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}))"
    try:
        out = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, timeout=60,
                             env={"PATH": _SAFE_PATH})
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [os.path.realpath(p) for p in out.stdout.splitlines() if p.startswith("/")] if out.returncode == 0 else []


def _world_executable(path: str) -> bool:
    real = os.path.realpath(path)
    if not os.path.isfile(real) or not os.stat(real).st_mode & stat.S_IXOTH:
        return False
    d = os.path.dirname(real)
    while True:
        if not os.stat(d).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(d)
        if parent == d:
            return True
        d = parent


def _env(isolation: str) -> dict[str, str]:
    home = "/tmp" if isolation in ("root", "userns") else "."
    return {"PATH": _SAFE_PATH, "LANG": "C.UTF-8", "HOME": home, "TMPDIR": home}


def _memfd(name: str, data: bytes = b"") -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _launch(argv: list[str], stdin: str, work: str, uid: int | None, limits: Limits,
            isolation: str, python_program: bool, copy: list[str] | None, cgroup: str | None = None,
            lock: int | None = None, readable: list[str] | None = None) -> RunResult:
    """Start the launcher for one run, wait up to the wall clock, kill the tree, collect the result.

    stdin, stdout and stderr are memfds: no file of the run exists on any path, so no other run (of the same
    host uid at "userns", or at "none") can read its input or output whatever tmp_root is, and reopening
    /proc/self/fd/N reaches only the program's own memfd. They are regular files, so RLIMIT_FSIZE still bounds
    the output (SIGXFSZ) and nothing has to drain a pipe."""
    spec = {"argv": argv, "work": work, "uid": uid, "isolation": isolation, "limits": asdict(limits), "readable": readable,
            "env": _env(isolation), "audit_hook": isolation == "none" and python_program,
            "tmpfs": copy is not None, "copy": copy or [], "cgroup": cgroup,
            "hide": os.path.dirname(os.path.dirname(work))}
    fin = _memfd("stdin", stdin.encode("utf-8", errors="surrogateescape"))
    fspec = _memfd("spec", marshal.dumps(spec))
    fout, ferr = _memfd("stdout"), _memfd("stderr")
    status_r, status_w = os.pipe()
    launcher, env = _launcher_cmd()
    env.update(PATH=_SAFE_PATH, OGRPO_SBX_STATUS_FD=str(status_w), OGRPO_SBX_SPEC_FD=str(fspec))
    if lock is not None:  # the launcher holds the slot uid's lock until it exits (see _claim_uids)
        env["OGRPO_SBX_LOCK_FD"] = str(lock)
    t0 = time.perf_counter()
    try:
        try:
            fds = (status_w, fspec) + ((lock,) if lock is not None else ())
            proc = subprocess.Popen(launcher, stdin=fin, stdout=fout, stderr=ferr, pass_fds=fds,
                                    close_fds=True, start_new_session=True, cwd=os.path.dirname(work), env=env)
        finally:  # the trainer keeps only the outputs (a program could reach its fds through /proc at "none")
            os.close(fin)
            os.close(fspec)
        os.close(status_w)
        status_w = -1
        timed_out = not _wait(proc, limits.wall_s + 0.5)  # + the launcher's start-up (~30 ms) and slack
        if timed_out:
            proc.terminate()  # the launcher kills the tree and returns once it is gone (launcher.py: _launcher_main)
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(proc.pid)  # also on a normal exit: background children left in the group ("none" level)
        proc.wait()
        wall = time.perf_counter() - t0
        report = _read_report(status_r)
        out, err = _read_capped(fout, limits.output_bytes), _read_capped(ferr, limits.output_bytes)
    finally:
        os.close(status_r)
        os.close(fout)
        os.close(ferr)
        if status_w >= 0:
            os.close(status_w)
    if timed_out:
        return RunResult(TIMEOUT, out, err, report.get("wall_s", wall))
    if "error" in report or not report:
        why = report.get("error") or f"launcher exited {proc.returncode} without a report"
        code = report.get("returncode", proc.returncode)
        return RunResult(SANDBOX_ERROR, out, (err + "\n" + why).strip(), wall, code)
    sig, code = report.get("signal"), report.get("returncode")
    if sig is not None:
        hard_cpu = sig == signal.SIGKILL and report.get("cpu_s", 0.0) >= limits.cpu_s
        status = CPU_LIMIT if sig == signal.SIGXCPU or hard_cpu else SIGNALED
    else:
        status = OK if code == 0 else ERROR
    return RunResult(status, out, err, report.get("wall_s", wall), code, sig, report.get("cpu_s", 0.0))


def _launcher_cmd() -> tuple[list[str], dict[str, str]]:
    """`-m` reads launcher.py's cached bytecode; running the file as a script would compile it on every run
    (~20 ms of ~50 ms launcher start-up, measured on a loaded 2-core node). -P (3.11+) keeps the launcher's
    cwd off sys.path, -S -s keep site-packages out; the environment is ours, so PYTHONPATH is safe to use."""
    path = os.path.abspath(_launcher.__file__)
    if sys.version_info >= (3, 11):
        root = os.path.dirname(os.path.dirname(os.path.dirname(path)))
        return [sys.executable, "-P", "-S", "-s", "-B", "-m", _launcher.__name__], {"PYTHONPATH": root}
    return [sys.executable, "-I", "-S", "-B", path], {}


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    """True when the process exited within `timeout`. Popen.wait(timeout) polls with sleeps of up to 50 ms,
    which was a third of a short run's time; a pidfd wakes up the moment the launcher exits."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # Linux < 5.3
        try:
            proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(timeout * 1000))
    finally:
        os.close(fd)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_report(fd: int) -> dict:
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return parse_report(b"".join(chunks))


_REPORT_KEYS = {"returncode": (int, type(None)), "signal": (int, type(None)), "cpu_s": (int, float),
                "wall_s": (int, float), "error": (str,)}


def parse_report(data: bytes) -> dict:
    """The launcher's or reaper's one JSON object, checked field by field; anything else is an error report.

    The program cannot reach this pipe (it closes its copy before execve; the launcher and reaper are not
    dumpable), and it is parsed as data anyway: no unmarshalling of bytes a compromised writer could shape."""
    if not data:
        return {}
    try:
        report = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {"error": "sandbox: malformed status report"}
    if not isinstance(report, dict) or any(k not in _REPORT_KEYS or isinstance(v, bool)
                                           or not isinstance(v, _REPORT_KEYS[k]) for k, v in report.items()):
        return {"error": "sandbox: malformed status report"}
    return report


def _read_capped(fd: int, cap: int) -> str:
    return os.pread(fd, cap, 0).decode("utf-8", errors="replace")


