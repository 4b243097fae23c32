"""Run untrusted, model-written programs (Python, C, C++) locally, contained, many at a time.

Process tree of one run (L = launcher, a fresh interpreter running this module; I = reaper; P = the program):

    trainer thread --Popen--> L (root or the trainer's uid, own session)
        L: unshare(net, pid, mount, ipc, uts[, user]); /tmp, /var/tmp, /dev/shm, /run/lock <- bind of the work
           dir; every other mount remounted read-only
        L --fork--> I (pid 1 of the new pid namespace; dies with L through PDEATHSIG)
            I: mounts a private /proc, reaps everything, reports P's status on fd 3
            I --fork--> P: rlimits, no_new_privs, setuid to the slot's uid, chdir, execve(program)

Why this shape:
- Containment comes from the kernel, not from the program's cooperation. When I exits (P finished, or the
  trainer SIGKILLs the process group on the wall-clock timeout) the kernel kills every process left in the pid
  namespace, so a fork bomb's descendants, daemons and setsid() escapes all go with it.
- RLIMIT_NPROC counts processes per real uid and is not enforced for root. As root, each worker slot runs its
  programs under its own unprivileged uid (`uid_base + slot`), so the limit applies and one program's fork bomb
  cannot use up another's budget; the uid also keeps it out of root's files (the repository, 0755).
- Writes: the work dir is the only writable place. It is bound over the usual world-writable dirs, and every
  other mount of the private mount namespace is remounted read-only, which also covers a site's 1777 /scratch
  and, at the "userns" level, everything the trainer's own uid could write.
- A new network namespace has only a downed loopback: connect() to 127.0.0.1 fails with ENETUNREACH.
- The trainer process never forks Python: a bounded ThreadPoolExecutor whose threads only call subprocess.Popen
  (fork immediately followed by exec in C, no Python code in between), so no CUDA context, NCCL state or held
  lock is copied into a child that could use it. multiprocessing's fork start method after CUDA init is exactly
  what this avoids; spawn/forkserver would also be correct but cost a Python interpreter per worker for nothing,
  since the work is in the child programs, not in Python. Without preexec_fn/user/group, CPython (3.10+) starts
  the launcher with vfork, so a trainer with tens of GiB mapped pays no page-table copy per program; that is why
  the uid change and the rlimits happen in the launcher, not through Popen's arguments.
- stdin/stdout/stderr are files outside the work dir, so output is bounded by RLIMIT_FSIZE (SIGXFSZ past it)
  instead of being read into the trainer's memory, and there are no pipes to deadlock on.

Isolation levels, chosen once per Sandbox by probing (`isolation="auto"`):
- "root": all of the above (needs CAP_SYS_ADMIN, e.g. the tests here, containers run as root).
- "userns": an unprivileged user namespace gives the same net/pid/mount namespaces without root (the usual case
  on a cluster). The program keeps the trainer's uid: it can write nothing (read-only mounts) but can read what
  the trainer's user can read, e.g. a token under $HOME. RLIMIT_NPROC still bounds it: since Linux 5.14 it is
  counted per user namespace (measured on 6.18: a program limited to 16 forked 13 children while its uid ran 40
  other processes). The pid namespace kills leftovers.
- "none": rlimits, the process-group kill and, as root (e.g. a container that forbids unshare), the slot uid
  plus a kill of all its processes afterwards. Python programs get an audit hook that refuses sockets,
  subprocesses and ctypes; C/C++ programs have no network containment at this level (a site needs user
  namespaces, a seccomp filter or a container runtime for that), which `Sandbox.isolation` reports.

Remote executors (E2B, Piston, Morph in open-r1) stay out. A site that has one plugs it in as a reward function
(`my_pkg.rewards:score` in `reward_funcs`) calling its client; the helpers in code_rewards.py (`extract_code`,
`lines_match`) are plain functions it can reuse to score the same way.

This module is also the launcher (`python -P -S -m ogrpo.train.sandbox SPEC`, SPEC a hex-encoded marshal of the
run), so it imports only the standard library, and the launcher part runs before the trainer-side imports.
"""

from __future__ import annotations

# The launcher needs only these (built in or already loaded at interpreter start-up, ~2 ms with ctypes); the
# trainer-side imports come after the launcher's entry point, since json/subprocess/dataclasses cost ~0.2 s of
# start-up per run on a loaded 2-core node.
import marshal
import os
import signal
import sys
import time

# Writable by everyone on a stock Linux: each becomes the run's own work dir inside its mount namespace.
# /tmp last: the work dir itself usually lives under /tmp and must still be reachable by path until then.
_SHARED_TMP = ("/var/tmp", "/dev/shm", "/run/lock", "/tmp")
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"

# ====================================== launcher (the child interpreter) ======================================
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
CLONE_NEWIPC, CLONE_NEWUTS = 0x08000000, 0x04000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
# A read-only bind remount must restate these or the kernel refuses it (they are locked in a user namespace).
_KEEP_FLAGS = {b"nosuid": MS_NOSUID, b"nodev": MS_NODEV, b"noexec": MS_NOEXEC, b"noatime": 1024,
               b"nodiratime": 2048, b"relatime": 1 << 21}
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38

# Installed before a Python program's first line at the "none" level only (there is no network namespace).
# Audit hooks cannot be removed from Python; ctypes is refused too since it could call connect() directly.
_AUDIT_PRELUDE = """\
import sys
def _ogrpo_deny(event, args):
    if event.startswith(("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.fork", "os.system",
                         "ctypes.")) and event != "socket.gethostname":
        raise PermissionError("sandbox: " + event + " is not allowed")
sys.addaudithook(_ogrpo_deny)
del _ogrpo_deny
sys.argv = sys.argv[1:]
exec(compile(open(sys.argv[0], encoding="utf-8").read(), sys.argv[0], "exec"),
     {"__name__": "__main__", "__file__": sys.argv[0]})
"""


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _launcher_main(spec: dict) -> int:
    status_fd = int(os.environ["OGRPO_SBX_STATUS_FD"])
    report = lambda d: os.write(status_fd, marshal.dumps(d))  # noqa: E731
    limits = spec["limits"]
    try:
        libc = _libc()
        isolation = spec["isolation"]
        if isolation in ("root", "userns"):
            flags = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS
            outer_uid, outer_gid = os.getuid(), os.getgid()
            _check(libc.unshare(flags | (CLONE_NEWUSER if isolation == "userns" else 0)), "unshare")
            if isolation == "userns":  # map ourselves to root inside, so mounts are allowed
                for name, text in (("setgroups", "deny"), ("uid_map", f"0 {outer_uid} 1"),
                                   ("gid_map", f"0 {outer_gid} 1")):
                    with open(f"/proc/self/{name}", "w") as f:
                        f.write(text)
            # Nothing mounted here may leak back to the host's mount namespace.
            _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
            binds = [d.encode() for d in _SHARED_TMP if os.path.isdir(d)]
            for d in binds:
                _check(libc.mount(spec["work"].encode(), d, None, MS_BIND, None), f"bind {d.decode()}")
            _read_only_except(libc, set(binds))
    except Exception as exc:
        report({"error": f"sandbox setup ({spec['isolation']}): {exc}"})
        return 125

    # The trainer's wall-clock timeout arrives as SIGTERM: SIGKILL the reaper and wait for it. The exit of a pid
    # namespace's init returns only once the kernel has killed and reaped every process in it, so when this
    # launcher exits nothing of the program is left (no stragglers counting against the slot uid's NPROC).
    reaper = 0
    killed = []

    def on_term(signum, frame):
        killed.append(signum)
        if reaper > 0:
            os.kill(reaper, signal.SIGKILL)

    signal.signal(signal.SIGTERM, on_term)
    if spec["isolation"] == "none":
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    t0 = time.monotonic()
    reaper = os.fork()
    if reaper and killed:  # SIGTERM came before the fork
        os.kill(reaper, signal.SIGKILL)
    if reaper == 0:  # I: pid 1 of the new pid namespace when there is one
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
            if spec["isolation"] in ("root", "userns"):
                libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)  # best effort
            os._exit(_reap(spec, limits, status_fd, t0))
        except BaseException as exc:  # noqa: BLE001 - whatever happens here, the parent must get a report
            try:
                report({"error": f"sandbox reaper: {exc}"})
            finally:
                os._exit(125)
    _, status = os.waitpid(reaper, 0)
    if spec["isolation"] == "none":
        _sweep(spec["uid"])
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 125


def _read_only_except(libc, writable: set[bytes]) -> None:
    """Remount every mount of this (private) mount namespace read-only except the work-dir binds: the program
    can then write nowhere else, including world-writable dirs of a site (/scratch) and, at the "userns" level,
    everything the trainer's uid owns. Device nodes (/dev/null) still work on a read-only /dev."""
    import codecs

    with open("/proc/self/mountinfo", "rb") as f:
        mounts = [line.split() for line in f.read().splitlines()]
    done = set(writable)
    for fields in mounts:
        target = codecs.escape_decode(fields[4])[0]  # mountinfo writes " " as \040
        opts = fields[5].split(b",")
        if target in done or b"ro" in opts:
            continue
        done.add(target)
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for opt in opts:
            flags |= _KEEP_FLAGS.get(opt, 0)
        if libc.mount(None, target, None, flags, None) != 0 and target == b"/":
            _check(-1, "remount / read-only")


def _sweep(uid: int | None) -> None:
    """Without a pid namespace: kill and reap what the program left. This launcher is a child subreaper, so
    orphans (double forks, setsid daemons) become its children; as root, everything of the slot uid is killed
    too. Zombies are reaped here because an init that does not reap would leave them counting against NPROC."""
    for _ in range(500):
        if uid is not None:
            _kill_uid(uid)
        kids = _children()
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return  # no children left, dead or alive
        time.sleep(0.002)


def _children() -> list[int]:
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN: the uid kill and the group kill remain
        return []


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid`: kill(-1) from that uid reaches exactly its own processes."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresuid(uid, uid, uid)
            for _ in range(100):  # forks in flight can be missed by one pass; NPROC bounds how many there are
                os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:  # none left
            os._exit(0)
        except BaseException:  # noqa: BLE001
            os._exit(1)
        os._exit(1)
    os.waitpid(pid, 0)


def _reap(spec: dict, limits: dict, status_fd: int, t0: float) -> int:
    # Close-on-exec pipe: EOF means execve succeeded; a message means the sandbox, not the program, failed
    # (exit 127 alone could be either).
    exec_r, exec_w = os.pipe()
    program = os.fork()
    if program == 0:
        os.close(exec_r)
        try:
            _exec_program(spec, limits, status_fd)
        except BaseException as exc:  # noqa: BLE001
            os.write(exec_w, f"cannot start the program: {exc}".encode())
        os._exit(127)
    os.close(exec_w)
    failed = os.read(exec_r, 4096).decode(errors="replace")
    os.close(exec_r)
    code, sig, cpu = None, None, 0.0
    while True:  # reap orphans too, until the program itself is done
        pid, status, usage = os.wait4(-1, 0)
        if pid == program:
            cpu = usage.ru_utime + usage.ru_stime
            if os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
            else:
                code = os.WEXITSTATUS(status)
            break
    report = {"returncode": code, "signal": sig, "cpu_s": round(cpu, 4), "wall_s": round(time.monotonic() - t0, 4)}
    if failed:
        report["error"] = f"sandbox: {failed}"
    os.write(status_fd, marshal.dumps(report))
    # Returning ends pid 1 of the namespace, and the kernel SIGKILLs whatever the program left behind.
    return 0


def _exec_program(spec: dict, limits: dict, status_fd: int) -> None:
    import resource

    os.close(status_fd)
    for res, value in ((resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1)),
                       (resource.RLIMIT_AS, (limits["memory_bytes"],) * 2),
                       (resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2),
                       (resource.RLIMIT_NPROC, (limits["nproc"],) * 2),
                       (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(res, value)
    libc = _libc()
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")  # setuid binaries stay unprivileged
    uid = spec["uid"]
    # Before the uid change: the work dir's parents (e.g. a 0700 pytest or Slurm tmp dir) need not be searchable.
    os.chdir("/tmp" if spec["isolation"] in ("root", "userns") else spec["work"])
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    # After the uid change (which clears it): the program dies with its reaper even without a pid namespace.
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    argv = list(spec["argv"])
    if spec["audit_hook"]:  # argv is [python, -I, -B, main.py]
        argv = [argv[0], "-I", "-B", "-c", _AUDIT_PRELUDE, argv[-1]]
    os.execve(argv[0], argv, spec["env"])


if __name__ == "__main__":
    sys.exit(_launcher_main(marshal.loads(bytes.fromhex(sys.argv[1]))))

# ========================================= trainer side ========================================================

import select  # noqa: E402
import shutil  # noqa: E402
import stat  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402

MIB = 1024**2
GIB = 1024**3

LANGUAGES = ("python", "c", "cpp")
_UID_BASE, _UIDS_PER_PROCESS = 1_879_048_192, 256  # 0x70000000: up to 0x71000000, below 2**31 for old tools

# Run statuses. Only "ok" means the program exited 0 in time.
OK, ERROR, SIGNALED, CPU_LIMIT, TIMEOUT, COMPILE_ERROR, SANDBOX_ERROR = (
    "ok", "error", "signal", "cpu_limit", "timeout", "compile_error", "sandbox_error")


@dataclass(frozen=True)
class Limits:
    """Per-process limits of one run. Defaults follow open-r1's evaluation script (5 s per test case)."""

    cpu_s: int = 5                  # RLIMIT_CPU soft limit (SIGXCPU); the hard limit is one second later
    wall_s: float = 5.0             # wall clock, then the whole process tree is killed
    memory_bytes: int = 1 * GIB     # RLIMIT_AS: a Python interpreter maps ~30 MiB, a C program far less
    file_bytes: int = 16 * MIB      # RLIMIT_FSIZE: any file, stdout/stderr included
    nproc: int = 16                 # RLIMIT_NPROC (processes + threads of the slot's uid)
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
    allocation, not the node). `uid_base` is the first of `max_workers` uids used when running as root; they
    need no passwd entry and must not belong to anyone. The default range is far above login and subuid ranges
    and offset by this process's pid, so the trainer ranks of one node do not share uids (and NPROC budgets).
    """

    def __init__(self, max_workers: int | None = None, limits: Limits = Limits(),
                 compile_limits: Limits = COMPILE_LIMITS, isolation: str = "auto", uid_base: int | None = None,
                 python: str | None = None, cc: str = "gcc", cxx: str = "g++",
                 c_flags: tuple[str, ...] = ("-O2", "-std=gnu17", "-lm"),
                 cxx_flags: tuple[str, ...] = ("-O2", "-std=gnu++17", "-lm"),
                 tmp_root: str | None = None):
        from ogrpo.errors import OgrpoError

        cores = len(os.sched_getaffinity(0))
        self.max_workers = max(1, int(max_workers or cores))
        if self.max_workers > _UIDS_PER_PROCESS:
            raise OgrpoError(f"sandbox max_workers={self.max_workers}: at most {_UIDS_PER_PROCESS} per process")
        if isolation not in ("auto", "root", "userns", "none"):
            raise OgrpoError(f"sandbox isolation {isolation!r}: use auto, root, userns or none")
        self.limits, self.compile_limits = limits, compile_limits
        self.uid_base = uid_base if uid_base is not None else _UID_BASE + (os.getpid() % 65536) * _UIDS_PER_PROCESS
        self.cc, self.cxx, self.c_flags, self.cxx_flags = cc, cxx, tuple(c_flags), tuple(cxx_flags)
        self.tmp_root = tmp_root
        self._slots: "list[int]" = list(range(self.max_workers))
        self._slots_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.isolation = self._probe() if isolation == "auto" else isolation
        # Root runs programs as the slot's uid at every level but "userns" (whose only mapped uid is root).
        self.drop_uid = os.geteuid() == 0 and self.isolation != "userns"
        self.python = python or _python_for(self.drop_uid)

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

    def uids(self) -> list[int]:
        """The uids programs run under (empty when they keep the trainer's uid)."""
        return [self.uid_base + s for s in range(self.max_workers)] if self.drop_uid else []

    # --- internals -------------------------------------------------------------------------------------------
    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="ogrpo-sandbox")
            return self._pool

    def _probe(self) -> str:
        """The strongest level that actually runs a program here (the kernel or a container may forbid some)."""
        candidates = (["root"] if os.geteuid() == 0 else []) + ["userns"]
        for level in candidates:
            self.isolation, self.drop_uid = level, level == "root"
            res = self._run_job(Job("", "exec:/bin/true"), Limits(wall_s=10.0))
            if res.runs and res.runs[0].ok:
                return level
        return "none"

    def _run_job(self, job: Job, limits: Limits) -> JobResult:
        with self._slots_lock:
            slot = self._slots.pop()
        try:
            return self._run_job_in_slot(job, limits, slot)
        except Exception as exc:  # a sandbox failure is a failed run, never a crashed reward stage
            return JobResult(None, [RunResult(SANDBOX_ERROR, stderr=f"{type(exc).__name__}: {exc}")])
        finally:
            with self._slots_lock:
                self._slots.append(slot)

    def _run_job_in_slot(self, job: Job, limits: Limits, slot: int) -> JobResult:
        uid = self.uid_base + slot if self.drop_uid else None
        top = tempfile.mkdtemp(prefix="ogrpo-sbx-", dir=self.tmp_root)
        try:
            os.chmod(top, 0o711)  # the program may cross it to reach work/, not list or write it
            work, io = os.path.join(top, "work"), os.path.join(top, "io")
            os.mkdir(work, 0o700)
            os.mkdir(io, 0o700)
            if uid is not None:
                os.chown(work, uid, uid)
            compile_res, argv = self._build(job, work, io, uid)
            if compile_res is not None and not compile_res.ok:
                compile_res.status = COMPILE_ERROR if compile_res.status == ERROR else compile_res.status
                return JobResult(compile_res, [])
            runs = []
            for stdin in job.inputs:
                res = _launch(argv, stdin, work, io, uid, limits, self.isolation, job.language == "python")
                runs.append(res)
                if res.status in job.stop_on:
                    break
            return JobResult(compile_res, runs)
        finally:
            _remove_tree(top)

    def _build(self, job: Job, work: str, io: str, uid: int | None) -> tuple[RunResult | None, list[str]]:
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
        res = _launch([compiler, name, "-o", "prog", *flags], "", work, io, uid, self.compile_limits,
                      self.isolation, False)
        return res, ["./prog"]

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _remove_tree(top: str) -> None:
    """rmtree that also removes what the program made unlistable (a mode-000 dir stops a non-root rmtree)."""
    shutil.rmtree(top, ignore_errors=True)
    if os.path.lexists(top):
        for dirpath, dirnames, _ in os.walk(top):  # top-down: a dir is opened after its parent chmod-ed it
            for d in dirnames:
                try:
                    os.chmod(os.path.join(dirpath, d), 0o700, follow_symlinks=False)
                except OSError:
                    pass
        shutil.rmtree(top, ignore_errors=True)


def _python_for(drop_uid: bool) -> str:
    """An interpreter the sandbox uid can execute: the trainer's may live under a 0700 home (pyenv in /root)."""
    candidates = [sys.executable, shutil.which("python3", path=_SAFE_PATH) or "/usr/bin/python3"]
    if not drop_uid:
        return candidates[0]
    for cand in candidates:
        if _world_executable(cand):
            return cand
    return candidates[-1]


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


def _launch(argv: list[str], stdin: str, work: str, io: str, uid: int | None, limits: Limits,
            isolation: str, python_program: bool) -> RunResult:
    """Start the launcher for one run, wait up to the wall clock, kill the tree, collect the result."""
    stdin_path, out_path, err_path = (os.path.join(io, n) for n in ("stdin", "stdout", "stderr"))
    with open(stdin_path, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(stdin)
    spec = {"argv": argv, "work": work, "uid": uid, "isolation": isolation, "limits": asdict(limits),
            "env": _env(isolation), "audit_hook": isolation == "none" and python_program}
    status_r, status_w = os.pipe()
    launcher, env = _launcher_cmd()
    env.update(PATH=_SAFE_PATH, OGRPO_SBX_STATUS_FD=str(status_w))
    t0 = time.perf_counter()
    try:
        with open(stdin_path, "rb") as fin, open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
            proc = subprocess.Popen([*launcher, marshal.dumps(spec).hex()], stdin=fin, stdout=fout, stderr=ferr,
                                    pass_fds=(status_w,), close_fds=True, start_new_session=True, cwd=io, env=env)
        os.close(status_w)
        status_w = -1
        timed_out = not _wait(proc, limits.wall_s + 0.5)  # + the launcher's start-up (~30 ms) and slack
        if timed_out:
            proc.terminate()  # the launcher kills the tree and returns once it is gone (see _launcher_main)
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(proc.pid)  # also on a normal exit: background children left in the group ("none" level)
        proc.wait()
        wall = time.perf_counter() - t0
        report = _read_report(status_r)
    finally:
        os.close(status_r)
        if status_w >= 0:
            os.close(status_w)
    out, err = _read_capped(out_path, limits.output_bytes), _read_capped(err_path, limits.output_bytes)
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
    """`-m` reads this module's cached bytecode; running the file as a script would compile it on every run
    (~20 ms of ~50 ms launcher start-up, measured on a loaded 2-core node). -P (3.11+) keeps the launcher's
    cwd off sys.path, -S -s keep site-packages out; the environment is ours, so PYTHONPATH is safe to use."""
    if sys.version_info >= (3, 11) and __name__ == "ogrpo.train.sandbox":
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return [sys.executable, "-P", "-S", "-s", "-B", "-m", __name__], {"PYTHONPATH": root}
    return [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__)], {}


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
    try:  # written by the reaper (our code) before the program starts or after it ended; never by the program
        return marshal.loads(b"".join(chunks)) if chunks else {}
    except (ValueError, EOFError, TypeError):
        return {}


def _read_capped(path: str, cap: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(cap).decode("utf-8", errors="replace")
    except OSError:
        return ""


