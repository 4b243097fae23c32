"""The launcher: the program each sandboxed run starts as (`python -P -S -m ogrpo.sandbox.launcher`, from pool.py's
`_launch`), L in the process tree of pool.py's docstring, which also gives the reasons for its shape. It reads a
marshal of the run written by the trainer from the memfd named by OGRPO_SBX_SPEC_FD, joins the run's memory
cgroup, enters its namespaces, makes the run's private and read-only mounts, forks the reaper (I) that forks the
program (P) under its rlimits, uid, seccomp filter and Landlock, and reports on the status fd.

It runs in the jailed child, before any uid change and without site-packages, so it imports only the standard
library and its standard-library-only siblings seccomp.py and landlock.py (tests/test_sandbox_launcher.py).
"""

from __future__ import annotations

# The launcher needs only these (built in or already loaded at interpreter start-up, ~2 ms with ctypes): the
# trainer side's json/subprocess/dataclasses (pool.py) would cost ~0.2 s of start-up per run on a loaded 2-core
# node.
import marshal
import os
import signal
import sys
import time

# Writable by everyone on a stock Linux: inside the mount namespace each becomes the run's own directory.
_SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
# The program's ids inside its own (nested) user namespace at the "userns" level: any non-zero id works; this
# one maps to the launcher's namespace root, i.e. to the trainer's uid (or the slot uid) on the host.
SANDBOX_ID = 1000

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
CLONE_NEWIPC, CLONE_NEWUTS = 0x08000000, 0x04000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
# A read-only bind remount must restate these or the kernel refuses it (they are locked in a user namespace).
_KEEP_FLAGS = {b"nosuid": MS_NOSUID, b"nodev": MS_NODEV, b"noexec": MS_NOEXEC, b"noatime": 1024,
               b"nodiratime": 2048, b"relatime": 1 << 21}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 36, 38

# Installed before a Python program's first line at the "none" level only (there is no namespace). Audit hooks
# cannot be removed from Python; ctypes is refused since it could call anything, and so is importing
# _posixsubprocess, whose fork_exec starts a process without raising any audit event. The seccomp filter is
# under it at every level (sockets of every family are refused at this one, for C programs too).
_AUDIT_PRELUDE = """\
import sys
def _ogrpo_deny(event, args):
    if (event.startswith(("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.fork", "os.system",
                          "ctypes.")) and event != "socket.gethostname") or (
            event == "import" and args[0] in ("_posixsubprocess", "_ctypes", "_xxsubinterpreters")):
        raise PermissionError("sandbox: " + event + " " + str(args[0] if args else "") + " is not allowed")
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


def _write_id_maps(inside: int, outside_uid: int, outside_gid: int) -> None:
    for name, text in (("setgroups", "deny"), ("uid_map", f"{inside} {outside_uid} 1"),
                       ("gid_map", f"{inside} {outside_gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _read_spec(fd: int) -> dict:
    """The run's spec comes on an fd, not the command line: the reaper's /proc/1/cmdline, which every program
    can read, then shows no host path (the work dir, tmp_root)."""
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    return marshal.loads(b"".join(chunks))


def _launcher_main(spec: dict) -> int:
    # Everything the launcher needs is imported now: at the "userns" level under a root trainer it soon runs as
    # the slot uid, which may not read the interpreter's library directory (a pyenv under /root).
    import codecs  # noqa: F401 - used by _read_only_except
    import json
    import resource  # noqa: F401 - used by _exec_program

    # Not at the top: run as a file (Python < 3.11, see pool.py's _launcher_cmd) the package root joins sys.path
    # only in the __main__ block below.
    from ogrpo.sandbox import landlock, seccomp  # noqa: F401 - used by _exec_program

    status_fd = int(os.environ["OGRPO_SBX_STATUS_FD"])
    report = lambda d: os.write(status_fd, json.dumps(d).encode())  # noqa: E731
    isolation, uid = spec["isolation"], spec["uid"]
    try:
        libc = _libc()
        if spec.get("cgroup"):  # before any uid change: joining needs the trainer's write access to it
            with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as f:
                f.write("0")
        # The work dir is reached through the cwd from here on: it survives the uid change whatever its parents'
        # modes, and unshare(CLONE_NEWNS) moves it onto the new namespace's copy of the mount (an fd would keep
        # pointing into the host's namespace, which the kernel refuses as a bind source).
        os.chdir(spec["work"])
        if isolation in ("root", "userns"):
            flags = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS
            if isolation == "userns" and uid is not None:
                # A root trainer: the namespace maps the slot uid, not 0, so RLIMIT_NPROC applies (it is never
                # enforced for host uid 0) and nothing of the program is host root.
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # the uid change cleared it: /proc/self/*_map must be ours
            outer_uid, outer_gid = os.getuid(), os.getgid()
            _check(libc.unshare(flags | (CLONE_NEWUSER if isolation == "userns" else 0)), "unshare")
            if isolation == "userns":  # root of this namespace: it may mount; the program will not be (below)
                _write_id_maps(0, outer_uid, outer_gid)
            # Nothing mounted here may leak back to the host's mount namespace.
            _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
            _private_dirs(libc, spec)
    except Exception as exc:
        report({"error": f"sandbox setup ({isolation}): {exc}"})
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
    if isolation == "none":
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    # Not dumpable (reset by every uid change above, so set last): a program of the same host uid (the "userns"
    # level maps it to ours; the "none" level shares it) may then neither ptrace the launcher or the reaper nor
    # open their /proc/PID/fd entries, e.g. the status pipe.
    _check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(DUMPABLE)")
    t0 = time.monotonic()
    reaper = os.fork()
    if reaper and killed:  # SIGTERM came before the fork
        os.kill(reaper, signal.SIGKILL)
    if reaper == 0:  # I: pid 1 of the new pid namespace when there is one
        if "OGRPO_SBX_LOCK_FD" in os.environ:  # the slot's lock stays with the launcher, not the program
            os.close(int(os.environ["OGRPO_SBX_LOCK_FD"]))
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # Python's own SIGINT handler would make the kernel deliver a program's kill(1, SIGINT) to this pid 1 (it
        # drops, from inside the namespace, only the signals its init leaves at their default), ending the run as
        # a sandbox error the program chose; ignored, the reaper reports the program's own result.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
            if isolation in ("root", "userns"):  # the node's processes and their command lines stay hidden
                _check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount /proc")
            os._exit(_reap(spec, status_fd, t0, report))
        except BaseException as exc:  # noqa: BLE001 - whatever happens here, the parent must get a report
            try:
                report({"error": f"sandbox reaper: {exc}"})
            finally:
                os._exit(125)
    _, status = os.waitpid(reaper, 0)
    if isolation == "none":
        _sweep(uid)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 125


def _private_dirs(libc, spec: dict) -> None:
    """/tmp and the other world-writable dirs become the run's own; every other mount turns read-only.

    A program run gets a fresh tmpfs capped in bytes and inodes, holding a copy of its source or binary: what it
    writes there costs the host no disk and needs no cleanup (it goes with the mount namespace), and a tree
    built to defeat removal never reaches the host. A compile run gets the host work dir itself, where the
    compiler's output must stay for the runs that follow."""
    hide = spec.get("hide")
    if hide and hide != "/":
        # tmp_root, where every run's work dir lives, becomes an empty read-only dir: a program (at "userns" of
        # the trainer's host uid) finds none of its concurrent siblings' files whatever TMPDIR is. The work dir
        # is still reached through the cwd (the covered mount), and the binds below come after this one. The
        # target is named from the cwd (work -> top -> tmp_root): a slot uid may not search tmp_root's parents.
        _check(libc.mount(b"tmpfs", b"../..", b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                          b"size=4k,nr_inodes=1,mode=0555"), "mount tmpfs over tmp_root")
    if spec["tmpfs"]:
        owner = spec["uid"] if spec["isolation"] == "root" and spec["uid"] is not None else 0
        lim = spec["limits"]
        opts = f"size={lim['disk_bytes']},nr_inodes={lim['inodes']},mode=0700,uid={owner},gid={owner}"
        _check(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode()), "mount tmpfs /tmp")
        for name in spec["copy"]:
            src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW)  # relative to the cwd, the work dir
            dst = os.open(os.path.join("/tmp", name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o755)
            try:
                while True:
                    chunk = os.read(src, 1 << 20)
                    if not chunk:
                        break
                    os.write(dst, chunk)
                if owner:
                    os.fchown(dst, owner, owner)
            finally:
                os.close(src)
                os.close(dst)
        source = b"/tmp"
    else:
        source = b"."
    binds = [d.encode() for d in _SHARED_TMP if os.path.isdir(d)]
    for d in binds:
        if not (spec["tmpfs"] and d == b"/tmp"):
            _check(libc.mount(source, d, None, MS_BIND, None), f"bind {d.decode()}")
    _read_only_except(libc, set(binds))


def _read_only_except(libc, writable: set[bytes]) -> None:
    """Remount every mount of this (private) mount namespace read-only except the run's own dirs: the program
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


def _reap(spec: dict, status_fd: int, t0: float, report) -> int:
    # Close-on-exec pipe: EOF means execve succeeded; a message means the sandbox, not the program, failed
    # (exit 127 alone could be either).
    exec_r, exec_w = os.pipe()
    program = os.fork()
    if program == 0:
        os.close(exec_r)
        try:
            _exec_program(spec, status_fd)
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
    out = {"returncode": code, "signal": sig, "cpu_s": round(cpu, 4), "wall_s": round(time.monotonic() - t0, 4)}
    if failed:
        out["error"] = f"sandbox: {failed}"
    report(out)
    # Returning ends pid 1 of the namespace, and the kernel SIGKILLs whatever the program left behind.
    return 0


def _tasks_of(uid: int) -> int:
    """Tasks (threads) whose real uid is `uid`, as RLIMIT_NPROC counts them (fewer under hidepid)."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
            if int(fields[b"Uid"].split()[0]) == uid:
                n += int(fields[b"Threads"])
        except (OSError, KeyError, ValueError):
            pass
    return n


def _drop_bounding_set(libc) -> None:
    """Empty the capability bounding set: nothing the program execs can gain a capability, file caps included."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"prctl(CAPBSET_DROP, {cap})")


def _exec_program(spec: dict, status_fd: int) -> None:
    import resource

    # not at the top: see _launcher_main
    from ogrpo.sandbox import landlock, seccomp

    os.close(status_fd)
    limits, isolation, uid = spec["limits"], spec["isolation"], spec["uid"]
    nproc = limits["nproc"]
    if isolation == "none" and os.getuid() != 0:  # the trainer's uid: its threads and other tasks count too
        nproc += _tasks_of(os.getuid()) - 1  # less this process, the program: it is one of its own nproc
    for res, value in ((resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1)),
                       (resource.RLIMIT_AS, (limits["memory_bytes"],) * 2),
                       (resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2),
                       (resource.RLIMIT_NPROC, (nproc,) * 2),
                       (resource.RLIMIT_NOFILE, (limits["nofile"],) * 2),  # also bounds socket-buffer memory
                       (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(res, value)
    libc = _libc()
    # The launcher's cwd is already the work dir (the "none" level's working dir), entered before any uid change.
    if isolation in ("root", "userns"):
        os.chdir("/tmp")
    if isolation == "userns":
        # The launcher is root of its namespace (it had to mount); the program gets a nested namespace where it
        # is SANDBOX_ID, mapped onto that root. A non-zero uid loses every capability at execve, and the mount,
        # pid and network namespaces belong to the outer namespace, where it never had any: remount, umount,
        # a new /proc or ptrace of the (non-dumpable) reaper all fail.
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # our own /proc/self/uid_map must be ours to write
        _check(libc.unshare(CLONE_NEWUSER), "unshare(user)")
        _write_id_maps(SANDBOX_ID, 0, 0)
        os.setresgid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
        os.setresuid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
        _drop_bounding_set(libc)  # permitted while the new namespace's capabilities last (until execve)
    elif uid is not None:  # real root ("root" level, or "none" in a container that forbids unshare)
        _drop_bounding_set(libc)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")  # setuid binaries stay unprivileged
    # After the uid change (which clears it): the program dies with its reaper even without a pid namespace.
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    # Python ignores these (and the reaper SIGINT), and ignored signals stay ignored across execve: a C program
    # writing past RLIMIT_FSIZE or into a closed pipe must die, not loop on EFBIG/EPIPE.
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    argv = list(spec["argv"])
    # Where the kernel has Landlock, reads too: the system's software, the program's own installation and dirs,
    # nothing of the host's data (the training set with the expected outputs, the user's files)
    readable = (*landlock.SYSTEM, *(spec.get("readable") or ()), *landlock.readable_for(argv[0]))
    if isolation == "none":  # no mount namespace: Landlock also keeps writes in the work dir (the cwd)
        landlock.restrict(libc, ".", readable)
    else:  # the run's own tmpfs dirs, its cwd among them
        landlock.restrict(libc, None, (*readable, *_SHARED_TMP))
    if spec["audit_hook"]:  # argv is [python, -I, -B, main.py]
        argv = [argv[0], "-I", "-B", "-c", _AUDIT_PRELUDE, argv[-1]]
    families = () if isolation == "none" else (seccomp.AF_INET, seccomp.AF_INET6)
    seccomp.install(libc, families, metadata=isolation == "none")  # last: from here on only execve
    os.execve(argv[0], argv, spec["env"])


if __name__ == "__main__":
    if not __package__:  # run as a file (Python < 3.11, see pool.py's _launcher_cmd): the package is three levels up
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(_launcher_main(_read_spec(int(os.environ["OGRPO_SBX_SPEC_FD"]))))
