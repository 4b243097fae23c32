"""The sandbox attacked as an adversary would, at every level this machine offers, as root and as a normal uid.

Each attack runs through `Sandbox.run_jobs` from a separate trainer process (root, or the unprivileged user
`ogrpo-ci`, created here when missing, through `setpriv`), and each test asserts both that the attack failed
inside the sandbox and that the host is untouched: the file not written, no connection accepted, the real exit
code reported, no process left, no work dir left. The syscall attacks are one C program (compiled once per
level) that takes the attack's name on stdin; the work-directory attacks are Python.

Levels: "root" (real root, slot uid), "userns" as root (the namespace maps the slot uid), "userns" as
`ogrpo-ci` (the cluster case), and the opt-in "none" level as root and as `ogrpo-ci`.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CI_USER = "ogrpo-ci"
# What an unprivileged trainer needs of the package: the sandbox imports nothing else.
MODULES = ("ogrpo/__init__.py", "ogrpo/errors.py", "ogrpo/sandbox/__init__.py", "ogrpo/sandbox/pool.py",
           "ogrpo/sandbox/launcher.py", "ogrpo/sandbox/seccomp.py", "ogrpo/sandbox/cleanup.py",
           "ogrpo/sandbox/landlock.py")

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("gcc") is None or shutil.which("setpriv") is None,
                                reason="needs root (to create and become the unprivileged user), gcc and setpriv")

ATTACKS_C = r"""
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ipc.h>
#include <sys/mount.h>
#include <sys/ptrace.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>
static void rep(const char *what, long r) { printf("%s %ld %d\n", what, r < 0 ? -1L : r, r < 0 ? errno : 0); }
int main(void) {
  char what[64] = {0}, arg[1024] = {0};
  if (scanf("%63s %1023s", what, arg) < 1) return 99;
  if (!strcmp(what, "remount")) {  /* then write a file of the trainer's user outside the work dir */
    rep("mount", mount(NULL, "/", NULL, MS_REMOUNT | MS_BIND, NULL));
    rep("mount2", mount("none", "/", NULL, MS_REMOUNT, NULL));
    int fd = open(arg, O_WRONLY | O_CREAT | O_APPEND, 0644);
    rep("open", fd);
    if (fd >= 0) rep("write", write(fd, "pwned\n", 6));
    return 0;
  }
  if (!strcmp(what, "umount")) {  /* uncover the node's /proc, then count the processes it shows */
    rep("umount", umount2("/proc", MNT_DETACH));
    int n = 0; DIR *d = opendir("/proc"); struct dirent *e;
    while (d && (e = readdir(d))) if (e->d_name[0] >= '0' && e->d_name[0] <= '9') n++;
    printf("procs %d\n", n);
    return 0;
  }
  if (!strcmp(what, "ptrace")) {  /* the reaper: attach, its memory, its status pipe; then forge a report */
    pid_t reaper = getppid();
    char path[64];
    rep("ptrace", ptrace(PTRACE_ATTACH, reaper, 0, 0));
    snprintf(path, sizeof path, "/proc/%d/mem", reaper); rep("mem", open(path, O_RDWR));
    for (int fd = 3; fd < 8; fd++) {
      snprintf(path, sizeof path, "/proc/%d/fd/%d", reaper, fd);
      int w = open(path, O_WRONLY);
      if (w >= 0) { dprintf(w, "{\"returncode\": 0}"); rep("statusfd", w); }
    }
    rep("fd3", dprintf(3, "{\"returncode\": 0}"));
    return 7;
  }
  if (!strcmp(what, "signal")) {  /* may it signal its reaper (outside a pid namespace: the trainer's kin)? */
    rep("kill", kill(getppid(), 0));
    return 0;
  }
  if (!strcmp(what, "creds")) {
    char line[256]; FILE *f = fopen("/proc/self/status", "r");
    while (f && fgets(line, sizeof line, f))
      if (!strncmp(line, "Uid:", 4) || !strncmp(line, "Cap", 3) || !strncmp(line, "NoNewPrivs", 10) ||
          !strncmp(line, "Seccomp:", 8)) fputs(line, stdout);
    return 0;
  }
  if (!strcmp(what, "nproc")) {
    int ok = 0;
    for (int i = 0; i < 300; i++) { pid_t p = fork(); if (p == 0) { sleep(60); _exit(0); } if (p > 0) ok++; }
    printf("forks %d\n", ok); fflush(stdout);
    return 0;
  }
  if (!strcmp(what, "unix")) {  /* a filesystem socket of the host (a session bus, an agent), then an abstract one */
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    rep("socket", s);
    struct sockaddr_un a; memset(&a, 0, sizeof a); a.sun_family = AF_UNIX;
    strncpy(a.sun_path, arg, sizeof a.sun_path - 1);
    if (s >= 0) rep("connect", connect(s, (struct sockaddr *)&a, sizeof a));
    return 0;
  }
  if (!strcmp(what, "inet")) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    rep("socket", s);
    struct sockaddr_in a; memset(&a, 0, sizeof a); a.sin_family = AF_INET; a.sin_port = htons(atoi(arg));
    a.sin_addr.s_addr = htonl(0x7f000001);
    if (s >= 0) rep("connect", connect(s, (struct sockaddr *)&a, sizeof a));
    return 0;
  }
  if (!strcmp(what, "nofile")) {
    int n = 0; while (n < 100000 && open("/dev/null", O_RDONLY) >= 0) n++;
    printf("files %d\n", n);
    return 0;
  }
  if (!strcmp(what, "fsize")) {  /* stdout is a file under RLIMIT_FSIZE: SIGXFSZ must end this */
    static char buf[65536]; memset(buf, 'x', sizeof buf);
    for (int i = 0; i < 2048; i++) if (write(1, buf, sizeof buf) < 0) { fprintf(stderr, "errno %d\n", errno); break; }
    fprintf(stderr, "survived\n");
    return 0;
  }
  if (!strcmp(what, "sigpipe")) {
    int p[2]; if (pipe(p)) return 98; close(p[0]);
    rep("write", write(p[1], "x", 1));
    fprintf(stderr, "survived\n");
    return 0;
  }
  if (!strcmp(what, "unshare")) {  /* a fresh user namespace gives back every capability */
    rep("unshare", unshare(CLONE_NEWUSER | CLONE_NEWNS));
    long c = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
    if (c == 0) _exit(0);
    rep("clone", c);
    static char params[120];
    rep("io_uring", syscall(425, 1, params));
    rep("keyctl", syscall(SYS_keyctl, 0, 0, 0, 0, 0));
    return 0;
  }
  if (!strcmp(what, "stdio")) {  /* stdio opened before unshare: a host file to reopen read-write, chmod? */
    for (int fd = 0; fd < 3; fd++) {
      char p[64], l[512] = {0};
      snprintf(p, sizeof p, "/proc/self/fd/%d", fd);
      if (readlink(p, l, sizeof l - 1) < 0) strcpy(l, "?");
      printf("fd%d %s\n", fd, l);
    }
    int w = open("/proc/self/fd/1", O_RDWR);
    rep("reopen", w);
    if (w >= 0) rep("fchmod", fchmod(w, 0666));
    return 0;
  }
  if (!strcmp(what, "sysv")) {  /* 3 GiB of shared memory past the 1 GiB RLIMIT_AS; queues, semaphores */
    long id = syscall(SYS_shmget, IPC_PRIVATE, 3UL << 30, IPC_CREAT | 0600);
    rep("shmget", id);
    if (id >= 0) syscall(SYS_shmctl, id, IPC_RMID, 0);  /* never left on the host, whatever the code under test */
    long m = syscall(SYS_msgget, IPC_PRIVATE, IPC_CREAT | 0600);
    rep("msgget", m);
    if (m >= 0) syscall(SYS_msgctl, m, IPC_RMID, 0);
    long s = syscall(SYS_semget, IPC_PRIVATE, 1, IPC_CREAT | 0600);
    rep("semget", s);
    if (s >= 0) syscall(SYS_semctl, s, 0, IPC_RMID, 0);
    return 0;
  }
  if (!strcmp(what, "procs")) {  /* other processes (the parent; at "none" the trainer's kin) and the user */
    struct rlimit z = {0, 0}, cur;
    rep("prlimit_parent", syscall(SYS_prlimit64, getppid(), RLIMIT_CORE, &z, NULL));
    rep("prlimit_self", syscall(SYS_prlimit64, 0, RLIMIT_NOFILE, NULL, &cur));
    cpu_set_t set; CPU_ZERO(&set); sched_getaffinity(0, sizeof set, &set);
    rep("affinity_parent", sched_setaffinity(getppid(), sizeof set, &set));
    rep("affinity_self", sched_setaffinity(0, sizeof set, &set));
    rep("prio_user", setpriority(PRIO_USER, 0, 19));
    rep("prio_parent", setpriority(PRIO_PROCESS, getppid(), 19));
    rep("prio_self", setpriority(PRIO_PROCESS, 0, 19));
    rep("ioprio_user", syscall(SYS_ioprio_set, 3 /* IOPRIO_WHO_USER */, 0, 3 << 13 /* idle */));
    rep("ioprio_self", syscall(SYS_ioprio_set, 1 /* IOPRIO_WHO_PROCESS */, 0, 3 << 13));
    rep("statmount", syscall(457, 0, 0, 0, 0));
    rep("listmount", syscall(458, 0, 0, 0, 0));
    return 0;
  }
  if (!strcmp(what, "meta")) {  /* setuid bits on its own file; metadata of its own file and of one outside */
    int fd = open("own", O_WRONLY | O_CREAT, 0755);
    rep("own", fd);
    rep("chmod_suid", chmod("own", 04755));
    rep("fchmod_sgid", fchmod(fd, 02755));
    rep("fchmodat_suid", fchmodat(AT_FDCWD, "own", 04755, 0));
    rep("chmod_plain", chmod("own", 0700));
    rep("chown_own", chown("own", -1, -1));
    rep("utime_own", utimensat(AT_FDCWD, "own", NULL, 0));
    rep("xattr_own", setxattr("own", "user.ogrpo", "x", 1, 0));
    struct stat st;
    if (stat(arg, &st) == 0) {  /* harmless if it passes: the same mode, owner; a timestamp */
      rep("chmod_out", chmod(arg, st.st_mode & 07777));
      rep("chown_out", chown(arg, -1, -1));
      rep("utime_out", utimensat(AT_FDCWD, arg, NULL, 0));
    }
    return 0;
  }
  if (!strcmp(what, "dgram")) {  /* a datagram pair's socket can sendto() any socket path it sees */
    int sv[2], st[2];
    rep("pair_dgram", socketpair(AF_UNIX, SOCK_DGRAM, 0, sv));
    rep("pair_seqpacket", socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv));
    long r = socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, st);  /* asyncio's: stays */
    rep("pair_stream", r);
    char c = 0;
    if (r == 0) rep("pair_stream_io", write(st[0], "x", 1) == 1 && read(st[1], &c, 1) == 1 && c == 'x' ? 0 : -1);
    if (socketpair(AF_UNIX, SOCK_DGRAM, 0, sv) == 0) {
      struct sockaddr_un a; memset(&a, 0, sizeof a); a.sun_family = AF_UNIX;
      strncpy(a.sun_path, arg, sizeof a.sun_path - 1);
      rep("sendto", sendto(sv[0], "pwned", 5, 0, (struct sockaddr *)&a, sizeof a));
    }
    return 0;
  }
  if (!strcmp(what, "memfd")) {  /* pages neither RLIMIT_AS nor the tmpfs cap counts */
    rep("memfd_create", syscall(SYS_memfd_create, "m", 0));
    rep("memfd_secret", syscall(447, 0));
    return 0;
  }
  if (!strcmp(what, "mqueue")) {  /* at "none", a queue in the host's IPC namespace that outlives the program */
    rep("mq_open", syscall(SYS_mq_open, "ogrpo-sbx-mq", O_CREAT | O_RDWR, 0600, NULL));
    rep("mq_unlink", syscall(SYS_mq_unlink, "ogrpo-sbx-mq"));
    return 0;
  }
  if (!strcmp(what, "locks")) {  /* a sibling's channel: locks and open events on the shared system files */
    int fd = open("/bin/sh", O_RDONLY);
    rep("open", fd);
    rep("flock", syscall(SYS_flock, fd, 1 /* LOCK_SH */));
    struct flock l; memset(&l, 0, sizeof l); l.l_type = F_RDLCK; l.l_whence = SEEK_SET;
    rep("setlk", fcntl(fd, F_SETLK, &l));
    rep("ofd_setlk", fcntl(fd, 37 /* F_OFD_SETLK */, &l));
    rep("getlk", fcntl(fd, F_GETLK, &l));
    rep("getfd", fcntl(fd, F_GETFD));  /* the commands every runtime uses stay */
    rep("inotify", syscall(SYS_inotify_init1, 0));
    rep("fanotify", syscall(SYS_fanotify_init, 0, 0));
    return 0;
  }
  if (!strcmp(what, "sigint")) {  /* pid 1: its reaper in a pid namespace (same uid at "userns"), else init */
    rep("kill1", kill(1, SIGINT));
    usleep(300000);
    printf("alive\n");
    return 0;
  }
  return 98;
}
"""

WORKDIR_PY = r"""
import os, sys
made = {"deep": 0, "files": 0}
fd = os.open(".", os.O_RDONLY)
try:  # ~3,000 nested directories: past PATH_MAX and Python's recursion limit
    for i in range(3000):
        os.mkdir("dddddddd", dir_fd=fd)
        child = os.open("dddddddd", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = child
        made["deep"] += 1
except OSError as exc:
    made["deep_error"] = exc.strerror
os.close(fd)
try:  # a mode-000 directory holding a symlink
    os.makedirs("locked/inner")
    os.symlink("/etc/passwd", "locked/inner/link")
    os.chmod("locked/inner", 0)
    os.chmod("locked", 0)
except OSError as exc:
    made["locked_error"] = exc.strerror
try:  # many small files
    os.mkdir("many")
    for i in range(int(sys.stdin.readline())):
        open(f"many/{i}", "w").close()
        made["files"] += 1
except OSError as exc:
    made["files_error"] = exc.strerror
print(made)
"""

BYPASS_PY = r"""
import os
try:
    import _posixsubprocess
    r, w = os.pipe()
    pid = _posixsubprocess.fork_exec([b"/bin/sh", b"-c", b"echo x > bypass_marker"], [b"/bin/sh"], True, (), None,
                                     None, -1, -1, -1, -1, -1, -1, r, w, False, False, -1, None, None, None, -1,
                                     None, True)
    os.waitpid(pid, 0)
    print("spawned", os.path.exists("bypass_marker"))
except PermissionError as exc:
    print("refused", exc)
"""

# The trainer-side driver: runs every attack at one level and prints the results as JSON. Executed by a
# separate interpreter as root or as the unprivileged user.
DRIVER = r"""
import json, os, sys, threading
sys.path.insert(0, sys.argv[1])
from ogrpo.sandbox.pool import Job, Limits, Sandbox
try:
    from ogrpo.sandbox.cleanup import CLEANER
except ImportError:
    CLEANER = None
level, target, sock, port, files, root = sys.argv[2:8]
c_src, workdir_py, bypass_py = (open(p).read() for p in sys.argv[8:11])
out = {}
with Sandbox(max_workers=2, isolation=level, tmp_root=root) as box:
    names = ["remount " + target, "umount", "ptrace", "creds", "nproc", "unix " + sock, "inet " + port, "nofile",
             "fsize", "sigpipe", "unshare", "signal", "sysv", "procs", "meta " + target, "stdio",
             "dgram " + sock + ".d", "memfd", "mqueue", "locks", "sigint"]
    limits = Limits(wall_s=10.0, file_bytes=1024 ** 2, nproc=16)
    jobs = [Job(c_src, "c", [n]) for n in names]
    results = box.run_jobs(jobs, limits=limits)
    for n, r in zip(names, results):
        run = r.runs[0] if r.runs else r.compile
        out[n.split()[0]] = {"status": run.status, "signal": run.signal, "returncode": run.returncode,
                             "stdout": run.stdout[-4000:], "stderr": run.stderr[-2000:]}
    me = threading.get_ident()
    try:  # the trainer must survive the cleanup too (RecursionError, NotImplementedError before)
        wd = box.run_jobs([Job(workdir_py, "python", [files])], limits=Limits(wall_s=60.0, cpu_s=60, nproc=16))[0]
        run = wd.runs[0]
        out["workdir"] = {"status": run.status, "stdout": run.stdout, "stderr": run.stderr[-2000:]}
    except BaseException as exc:
        out["workdir"] = {"status": "trainer raised " + type(exc).__name__, "stdout": "", "stderr": ""}
    bp = box.run(bypass_py)
    out["bypass"] = {"status": bp.status, "stdout": bp.stdout, "stderr": bp.stderr[-2000:]}
    out["isolation"] = box.isolation
    out["landlock"] = getattr(box, "landlock", 0)
    out["uids"] = box.uids()
if CLEANER is not None:
    out["drained"] = CLEANER.drain(timeout=120)
    out["cleaner_threads"] = sorted(CLEANER.removed_by)
    out["failures"] = CLEANER.failures
out["caller_thread"] = me
out["left"] = sorted(os.listdir(root))
print(json.dumps(out))
"""


def _processes_of(uids: set[int]) -> dict[int, str]:
    """pid -> "name state ppid" of the live processes of these uids (a zombie runs nothing: not counted)."""
    found = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                status = dict(line.split(":", 1) for line in Path(f"/proc/{p}/status").read_text().splitlines()
                              if ":" in line)
            except OSError:
                continue
            state = status["State"].strip()
            if int(status["Uid"].split()[1]) in uids and not state.startswith("Z"):
                found[int(p)] = f"{status['Name'].strip()} {state} ppid {status['PPid'].strip()}"
    return found


def _survivors(uids: set[int], settle_s: float = 10.0) -> dict[int, str]:
    """The processes of these uids left once the exiting ones are gone (`settle_s` at most): a process the sandbox
    killed is gone once the kernel has torn it down, which lags on a loaded machine."""
    deadline = time.monotonic() + settle_s
    while (found := _processes_of(uids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


@pytest.fixture(scope="module")
def ci_user():
    """The unprivileged trainer's account (created for this module when missing, removed afterwards)."""
    created = False
    try:
        pwd.getpwnam(CI_USER)
    except KeyError:
        if shutil.which("useradd") is None:
            pytest.skip(f"no user {CI_USER} and no useradd to create one")
        subprocess.run(["useradd", "--create-home", "--shell", "/usr/sbin/nologin", CI_USER], check=True,
                       capture_output=True)
        created = True
    entry = pwd.getpwnam(CI_USER)
    yield entry
    if created:
        subprocess.run(["userdel", "--remove", CI_USER], capture_output=True)


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """The sandbox modules in a world-readable copy: the checkout may sit under a root-only directory."""
    root = Path(tempfile.mkdtemp(prefix="ogrpo-sbx-pkg-"))
    for rel in MODULES:
        if not (REPO / rel).exists():
            continue
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, dst)
    for extra in ("attacks.c", "workdir.py", "bypass.py"):
        (root / extra).write_text({"attacks.c": ATTACKS_C, "workdir.py": WORKDIR_PY, "bypass.py": BYPASS_PY}[extra])
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    yield root
    shutil.rmtree(root)


def _drive(level: str, user, package: Path, target: Path, files: int = 5000) -> dict:
    """Run every attack at `level` from a trainer process of `user` (None: root); host checks around it."""
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    # Work dirs on tmpfs where there is one: removing 3,000 nested dirs costs ~2 ms per rmdir on this VM's ext4
    # (11 s, rm -rf alike), which would only slow the test; the removal code is the same.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    root = Path(tempfile.mkdtemp(prefix="ogrpo-sbx-attack-", dir=shm))
    sock_dir = Path(user.pw_dir) if user else Path("/run")
    sock_path = sock_dir / f"ogrpo-sbx-{uuid.uuid4().hex[:8]}.sock"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(sock_path))
    sock_path.chmod(0o777)
    unix.listen(8)
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # a journald or /dev/log of the host
    dgram.bind(f"{sock_path}.d")
    Path(f"{sock_path}.d").chmod(0o777)
    inet = socket.socket()
    inet.bind(("127.0.0.1", 0))
    inet.listen(8)
    try:
        if user:
            os.chown(root, user.pw_uid, user.pw_gid)
            cmd = ["setpriv", "--reuid", str(user.pw_uid), "--regid", str(user.pw_gid), "--clear-groups", python]
        else:
            cmd = [python]
        cmd += ["-c", DRIVER, str(package), level, str(target), str(sock_path), str(inet.getsockname()[1]),
                str(files), str(root), str(package / "attacks.c"), str(package / "workdir.py"),
                str(package / "bypass.py")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env={"PATH": "/usr/bin:/bin", "HOME": user.pw_dir if user else "/root"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout)
        for name, srv in (("unix_accepted", unix), ("inet_accepted", inet)):  # whatever the program printed
            srv.settimeout(0.2)
            try:
                srv.accept()[0].close()
                out[name] = True
            except socket.timeout:
                out[name] = False
        dgram.setblocking(False)
        try:
            out["dgram_received"] = dgram.recv(64).decode(errors="replace")
        except BlockingIOError:
            out["dgram_received"] = None
        uids = set(out["uids"]) | ({user.pw_uid} if user else set())
        out["survivors"] = [f"{pid} {what}" for pid, what in _survivors(uids).items()]
        out["root_left"] = sorted(os.listdir(root))
        return out
    finally:
        unix.close()
        dgram.close()
        inet.close()
        sock_path.unlink(missing_ok=True)
        Path(f"{sock_path}.d").unlink(missing_ok=True)
        subprocess.run(["rm", "-rf", "--one-file-system", str(root)], capture_output=True)  # iterative, any depth


def _lines(result: dict) -> dict[str, tuple[int, int]]:
    """`what r errno` lines of the C program → {what: (r, errno)}."""
    out = {}
    for line in result["stdout"].splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = (int(parts[1]), int(parts[2]))
    return out


LEVELS = [("root", False), ("userns", False), ("userns", True), ("none", False), ("none", True)]


@pytest.fixture(scope="module", params=LEVELS, ids=[f"{lvl}-{'user' if u else 'root'}" for lvl, u in LEVELS])
def attacked(request, package):
    level, unprivileged = request.param
    user = request.getfixturevalue("ci_user") if unprivileged else None
    if unprivileged:
        target = Path(user.pw_dir) / ".bashrc"  # a file the trainer's user owns, outside any work dir
    else:
        target = (Path("/usr/local") if REPO.is_relative_to("/tmp") else REPO) / f"sbx_escape_{uuid.uuid4().hex}"
    before = target.read_bytes() if target.exists() else None
    # On a tmpfs the inode cap ends the file spree early; in the "none" level's host dir each file is real work.
    out = _drive(level, user, package, target, files=5000 if level == "none" else 20000)
    if out["isolation"] != level:
        pytest.skip(f"{level} is not available here")
    out.update(level=level, unprivileged=unprivileged, target=str(target), target_before=before,
               target_after=target.read_bytes() if target.exists() else None)
    if target.exists() and before is None:
        target.unlink()
    return out


def _contained_fs(out) -> bool:
    """False only where the level makes no filesystem promise: "none" as the trainer's own uid on a kernel
    without Landlock."""
    return not (out["level"] == "none" and out["unprivileged"] and not out["landlock"])


@pytest.mark.slow
def test_remount_and_write_outside_the_work_dir_fail(attacked):
    got = _lines(attacked["remount"])
    assert got["mount"][1] == 1 and got["mount2"][1] == 1, attacked["remount"]  # EPERM
    if _contained_fs(attacked):
        assert got["open"][0] == -1 and got["open"][1] in (13, 30), attacked["remount"]  # EACCES / EROFS
        assert attacked["target_after"] == attacked["target_before"]


def test_umount_proc_fails_and_the_node_stays_hidden(attacked):
    got = _lines(attacked["umount"])
    assert got["umount"][1] == 1, attacked["umount"]
    if attacked["level"] != "none":
        assert int(attacked["umount"]["stdout"].split("procs")[1]) <= 5  # the reaper and the program


def test_ptrace_of_the_reaper_and_a_forged_report_fail(attacked):
    res = attacked["ptrace"]
    got = _lines(res)
    assert got["ptrace"][1] == 1 and got["mem"][0] == -1 and "statusfd" not in got, res
    assert got["fd3"][1] == 9  # EBADF: the program has no status fd
    assert (res["status"], res["returncode"]) == ("error", 7)  # the reaper's report, not the forged one


def test_program_holds_no_privilege(attacked):
    fields = dict(line.split(":", 1) for line in attacked["creds"]["stdout"].splitlines())
    uid = int(fields["Uid"].split()[0])
    assert uid != 0
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapPrm"], 16) == 0
    if not (attacked["level"] == "none" and attacked["unprivileged"]):  # no CAP_SETPCAP there to drop it with
        assert int(fields["CapBnd"], 16) == 0
    assert fields["NoNewPrivs"].strip() == "1" and fields["Seccomp"].strip() == "2"
    if attacked["level"] == "userns":
        assert uid == 1000  # the nested namespace's uid


def test_nproc_is_enforced(attacked):
    forks = int(attacked["nproc"]["stdout"].split()[1])
    if attacked["level"] == "none" and attacked["unprivileged"]:
        # the trainer's uid: the budget is its task count at launch + 16, and tasks of a concurrent run (a
        # compile: up to 32) that end meanwhile leave their room to this one
        assert forks < 16 + 32, attacked["nproc"]
    else:
        assert forks < 16, attacked["nproc"]


def test_unix_sockets_are_refused(attacked):
    got = _lines(attacked["unix"])
    assert got["socket"] == (-1, 1) and "connect" not in got, attacked["unix"]
    assert not attacked["unix_accepted"]


def test_inet_reaches_nothing(attacked):
    got = _lines(attacked["inet"])
    if attacked["level"] == "none":  # no network namespace: the filter refuses every socket
        assert got["socket"] == (-1, 1), attacked["inet"]
    else:
        assert got["connect"][0] == -1, attacked["inet"]
    assert not attacked["inet_accepted"]


def test_open_files_are_bounded(attacked):
    assert int(attacked["nofile"]["stdout"].split()[1]) <= 64


def test_writing_past_the_file_size_limit_kills(attacked):
    res = attacked["fsize"]
    assert res["signal"] == signal.SIGXFSZ and "survived" not in res["stderr"], res


def test_writing_to_a_closed_pipe_kills(attacked):
    res = attacked["sigpipe"]
    assert res["signal"] == signal.SIGPIPE and "survived" not in res["stderr"], res


def test_new_namespaces_and_kernel_interfaces_are_refused(attacked):
    got = _lines(attacked["unshare"])
    assert got["unshare"] == (-1, 1) and got["clone"] == (-1, 1), attacked["unshare"]
    assert got["io_uring"][0] == -1 and got["keyctl"] == (-1, 1)


def test_hostile_work_dirs_never_leak_nor_block(attacked):
    res = attacked["workdir"]
    assert res["status"] == "ok", res
    assert attacked["drained"] and attacked["failures"] == [] and attacked["left"] == []
    assert attacked["root_left"] == []
    assert attacked["caller_thread"] not in attacked["cleaner_threads"]  # removed off the caller's path
    made = eval(res["stdout"])  # noqa: S307 - our own program's dict
    if attacked["level"] != "none":  # a capped tmpfs: its 8,192 inodes run out before 3,000 dirs + 20,000 files
        assert made["files"] < 8192 and made.get("files_error") == "No space left on device"


def test_signals_to_the_reaper_are_refused(attacked):
    got = _lines(attacked["signal"])
    if attacked["level"] == "userns":
        pytest.skip("the reaper is pid 1 of the program's pid namespace: the kernel drops its signals")
    if attacked["level"] == "none" and attacked["unprivileged"] and attacked["landlock"] < 6:
        pytest.skip("the same uid without Landlock's signal scoping (ABI 6) may signal its reaper")
    assert got["kill"] == (-1, 1), attacked["signal"]


def test_stdio_is_no_host_file(attacked):
    lines = dict(line.split(" ", 1) for line in attacked["stdio"]["stdout"].splitlines() if line.startswith("fd"))
    assert sorted(lines) == ["fd0", "fd1", "fd2"], attacked["stdio"]
    assert all(path.startswith("/memfd:") for path in lines.values()), lines  # reopened: only its own memfd


def test_sysv_ipc_is_refused(attacked):
    got = _lines(attacked["sysv"])
    assert got["shmget"] == got["msgget"] == got["semget"] == (-1, 1), attacked["sysv"]


def test_other_processes_and_the_user_are_out_of_reach(attacked):
    got = _lines(attacked["procs"])
    for call in ("prlimit_parent", "affinity_parent", "prio_user", "prio_parent", "ioprio_user", "statmount",
                 "listmount"):
        assert got[call] == (-1, 1), (call, attacked["procs"])
    assert got["prlimit_self"] == got["affinity_self"] == got["prio_self"] == got["ioprio_self"] == (0, 0), got


def test_setuid_bits_and_metadata_outside_landlock_are_refused(attacked):
    got = _lines(attacked["meta"])
    assert got["own"][0] >= 0, attacked["meta"]
    assert got["chmod_suid"] == got["fchmod_sgid"] == got["fchmodat_suid"] == (-1, 1), attacked["meta"]
    if attacked["level"] == "none":  # no Landlock rule covers these: the filter refuses the families
        for call in ("chmod_plain", "chown_own", "utime_own", "xattr_own", "chmod_out", "chown_out", "utime_out"):
            assert got.get(call, (-1, 1)) == (-1, 1), (call, attacked["meta"])
        if attacked["unprivileged"]:
            assert "utime_out" in got  # the trainer's user's own file was there to attack
    else:
        assert got["chmod_plain"] == (0, 0), attacked["meta"]


def test_datagram_pairs_are_refused_and_no_host_socket_hears_the_program(attacked):
    got = _lines(attacked["dgram"])
    assert got["pair_dgram"] == got["pair_seqpacket"] == (-1, 1), attacked["dgram"]
    assert got["pair_stream"] == got["pair_stream_io"] == (0, 0), attacked["dgram"]
    assert "sendto" not in got and attacked["dgram_received"] is None


def test_memory_no_limit_counts_is_refused(attacked):
    got = _lines(attacked["memfd"])
    assert got["memfd_create"] == got["memfd_secret"] == (-1, 1), attacked["memfd"]


def test_posix_message_queues_are_refused(attacked):
    got = _lines(attacked["mqueue"])
    assert got["mq_open"] == got["mq_unlink"] == (-1, 1), attacked["mqueue"]


def test_locks_and_file_events_siblings_could_signal_through_are_refused(attacked):
    got = _lines(attacked["locks"])
    assert got["open"][0] >= 0 and got["getfd"][1] == 0, attacked["locks"]
    for call in ("flock", "setlk", "ofd_setlk", "getlk", "inotify", "fanotify"):
        assert got[call] == (-1, 1), (call, attacked["locks"])


def test_a_signal_to_pid_1_leaves_the_run_its_own_result(attacked):
    """At "userns" pid 1 is the reaper under the program's own uid: Python's SIGINT handler let the kernel deliver
    it, and the run became a sandbox error the program chose. Elsewhere pid 1 is not the program's to signal."""
    res, got = attacked["sigint"], _lines(attacked["sigint"])
    assert res["status"] == "ok" and res["stdout"].endswith("alive\n"), res
    if attacked["level"] != "userns":
        assert got["kill1"] == (-1, 1), res


def test_no_process_survives(attacked):
    assert attacked["survivors"] == []


def test_audit_hook_bypass_through_posixsubprocess_is_closed(attacked):
    if attacked["level"] != "none":
        pytest.skip("the audit hook is the 'none' level's (namespaces and seccomp hold elsewhere)")
    assert attacked["bypass"]["stdout"].startswith("refused"), attacked["bypass"]


# ================================ the cleaner, raced (no Landlock to stop the program) ================================
# What a program of a slot's uid could do to its own earlier tree on a kernel without Landlock, while the cleaner
# is inside it: the race is made deterministic by hooks on the os functions the cleaner calls (old and new
# code alike), in a trainer process of root or of the unprivileged user.
CLEANER_DRIVER = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from ogrpo.sandbox import cleanup as sandbox_cleanup
base, scenario = sys.argv[2:4]
# base/p1/p2/tmp_root/top: the old cleaner's climb through `..` stops 3 levels above the tree's root, so even
# a broken cleaner stays inside this test's own dirs (p1 is the farthest it reaches); canaries in p1, p2 and
# tmp_root (beside the tree, beside tmp_root, in its parent)
p1, p2 = os.path.join(base, "p1"), os.path.join(base, "p1", "p2")
tmp_root = os.path.join(p2, "tmp_root")
top = os.path.join(tmp_root, "ogrpo-sbx-x")
os.makedirs(os.path.join(top, "work", "x", "y", "z"))
for d in (p1, p2, tmp_root, os.path.join(top, "work", "x", "y")):
    open(os.path.join(d, "canary"), "w").close()
canary = os.path.join(p1, "canary")
os.chmod(canary, 0o644)
real_scandir, real_stat, real_open = os.scandir, os.stat, os.open
done = []
def fd_path(fd):
    return os.readlink(f"/proc/self/fd/{fd}") if isinstance(fd, int) else fd
if scenario == "rename":  # the cleaner lists x/y; the program moves y next to the tree
    y = os.path.join(top, "work", "x", "y")
    def scandir(fd=None):
        if not done and fd is not None and fd_path(fd) == y:
            done.append(1)
            os.rename(y, os.path.join(tmp_root, "moved"))
        return real_scandir(fd)
    os.scandir = scandir
elif scenario == "symlink":  # a mode-000 directory becomes a symlink to a file outside, between check and use
    locked = os.path.join(top, "work", "locked")
    os.makedirs(os.path.join(locked, "inner"))
    os.chmod(locked, 0)
    def swap():
        if not done:
            done.append(1)
            os.rename(locked, locked + ".real")
            os.symlink(canary, locked)
    looks = []
    def stat(p, *a, dir_fd=None, **kw):  # the check right before a chmod (the old cleaner's second look)
        r = real_stat(p, *a, dir_fd=dir_fd, **kw)
        if p == "locked" and dir_fd is not None:
            looks.append(1)
            if len(looks) == 2:
                swap()
        return r
    def open_(p, *a, dir_fd=None, **kw):
        if p == "locked" and dir_fd is not None:
            swap()
        return real_open(p, *a, dir_fd=dir_fd, **kw)
    os.stat, os.open = stat, open_
elif scenario == "mount":  # a mount inside the tree (root only): never entered
    m = os.path.join(top, "work", "mnt")
    os.mkdir(m)
    assert os.system(f"mount -t tmpfs none {m} && touch {m}/inside") == 0
try:
    left = sandbox_cleanup.remove_tree(top, max_fds=2)  # a tiny fd window: the re-open path too
except TypeError:  # the old cleaner
    left = sandbox_cleanup.remove_tree(top)
os.scandir, os.stat, os.open = real_scandir, real_stat, real_open
out = {"raced": bool(done), "left": left, "canaries": [os.path.exists(os.path.join(d, "canary"))
                                                       for d in (p1, p2, tmp_root)],
       "canary_mode": oct(os.stat(canary).st_mode & 0o7777), "top": os.path.exists(top),
       "moved": os.path.isdir(os.path.join(tmp_root, "moved"))}
if scenario == "mount":
    out["inside"] = os.path.exists(os.path.join(top, "work", "mnt", "inside"))
    os.system(f"umount {os.path.join(top, 'work', 'mnt')}")
print(json.dumps(out))
"""


def _bases():
    """A tmp_root under /tmp and one outside it (a site's /scratch-like dir): throwaway dirs, never a system one."""
    return ["/tmp", ".scratch"]


@pytest.mark.parametrize("where", _bases(), ids=["under-tmp", "outside-tmp"])
@pytest.mark.parametrize("unprivileged", [False, True], ids=["root", "user"])
@pytest.mark.parametrize("scenario", ["rename", "symlink", "mount"])
def test_the_cleaner_never_leaves_its_root(scenario, unprivileged, where, package, request):
    if scenario == "mount" and unprivileged:
        pytest.skip("only root mounts")
    user = request.getfixturevalue("ci_user") if unprivileged else None
    base = Path(tempfile.mkdtemp(prefix="ogrpo-sbx-clean-", dir="/tmp" if where == "/tmp" else _outside_base()))
    try:
        cmd = [shutil.which("python3", path="/usr/bin:/bin") or sys.executable, "-c", CLEANER_DRIVER,
               str(package), str(base), scenario]
        if user:
            os.chown(base, user.pw_uid, user.pw_gid)
            cmd = ["setpriv", "--reuid", str(user.pw_uid), "--regid", str(user.pw_gid), "--clear-groups", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout)
        assert out["canaries"] == [True, True, True], out  # in tmp_root, beside it and in its parent
        assert out["canary_mode"] == "0o644", out  # no chmod through a swapped-in symlink
        if scenario == "rename":
            # the directory moved out of the tree stays where it went (what it held when the cleaner entered it
            # may go: nothing the program could not remove itself)
            assert out["raced"] and out["moved"] and not out["top"], out
        if scenario == "symlink":
            assert out["raced"], out
        if scenario == "mount":
            assert out["inside"] and out["left"], out  # the mount is not entered, and it is reported
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], capture_output=True)


# ================================ no run reads another's files (reward hacking) ================================
# Victims print the answer to a secret on their stdin and stay alive; the attacker, run beside them, looks for
# their inputs and outputs wherever a path could lead (tmp_root and its parent, the shared tmp dirs, every fd
# /proc lets it open) and for host paths on its reaper's command line. Scored as a reward would: the attacker
# "solves" a victim when it prints that victim's answer.
VICTIM_PY = """import sys, time
s = sys.stdin.read().strip()
print("ANSWER-" + s[len("SECRET-"):], flush=True)
time.sleep(2)
"""
SNOOP_PY = r"""import os, re, stat, sys, time
root = sys.stdin.read().strip()
pat = re.compile(rb"(?:SECRET|ANSWER)-[0-9a-f]{16}")
found, opened = set(), 0
def grab(path):
    global opened
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        data = os.pread(fd, 1 << 16, 0)
    except OSError:
        return
    finally:
        os.close(fd)
    opened += 1
    found.update(m.group(0).decode() for m in pat.finditer(data))
end = time.time() + 1.2
while time.time() < end:
    for top in {root, os.path.dirname(root), "/tmp", "/var/tmp", "/dev/shm", os.environ.get("TMPDIR", "/tmp")}:
        for d, _, files in os.walk(top):
            for f in files:
                grab(os.path.join(d, f))
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                grab(f"/proc/{pid}/fd/{fd}")
    time.sleep(0.2)
with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
    cmdline = f.read()
print(" ".join(sorted(found)) or "nothing")
print("cmdline", cmdline.hex())
"""
SIBLINGS_DRIVER = r"""
import json, os, secrets, sys
sys.path.insert(0, sys.argv[1])
from ogrpo.sandbox.pool import Job, Limits, Sandbox
from ogrpo.sandbox.cleanup import CLEANER
level, root, victim, snoop = sys.argv[2], sys.argv[3], open(sys.argv[4]).read(), open(sys.argv[5]).read()
keys = [secrets.token_hex(8) for _ in range(3)]
with Sandbox(max_workers=4, isolation=level, tmp_root=root) as box:
    jobs = [Job(victim, "python", ["SECRET-" + k]) for k in keys] + [Job(snoop, "python", [root])]
    res = box.run_jobs(jobs, limits=Limits(wall_s=30.0, cpu_s=20))
    uids = box.uids()
runs = [r.runs[0] for r in res]
print(json.dumps({"keys": keys, "uids": uids, "status": [r.status for r in runs], "stdout": [r.stdout for r in runs],
                  "stderr": [r.stderr[-2000:] for r in runs], "drained": CLEANER.drain(timeout=60),
                  "left": os.listdir(root)}))
"""


def _outside_base() -> Path:
    """A throwaway dir outside /tmp and the other shared tmp dirs (a site's /scratch): under the checkout."""
    base = REPO / ".scratch"
    base.mkdir(exist_ok=True)
    return base


@pytest.mark.parametrize("where", ["under-tmp", "outside-tmp"])
@pytest.mark.parametrize("level,unprivileged", LEVELS, ids=[f"{lvl}-{'user' if u else 'root'}" for lvl, u in LEVELS])
def test_no_run_reads_its_siblings_files(level, unprivileged, where, package, request):
    user = request.getfixturevalue("ci_user") if unprivileged else None
    base = Path(tempfile.mkdtemp(prefix="ogrpo-sbx-sib-", dir="/tmp" if where == "under-tmp" else _outside_base()))
    root = base / "p1" / "p2" / "tmp_root"  # deep: a broken cleaner stays inside this test's own dirs
    root.mkdir(parents=True)
    (package / "victim.py").write_text(VICTIM_PY)
    (package / "snoop.py").write_text(SNOOP_PY)
    for p in (package / "victim.py", package / "snoop.py"):
        p.chmod(0o644)
    try:
        python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
        cmd = [python, "-c", SIBLINGS_DRIVER, str(package), level, str(root), str(package / "victim.py"),
               str(package / "snoop.py")]
        if user:
            for p in (base, base / "p1", base / "p1" / "p2", root):
                os.chown(p, user.pw_uid, user.pw_gid)
            cmd = ["setpriv", "--reuid", str(user.pw_uid), "--regid", str(user.pw_gid), "--clear-groups", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout)
        if out["status"][:3] != ["ok"] * 3 and "unshare" in " ".join(out["stderr"]):
            pytest.skip(f"{level} is not available here")
        assert out["status"] == ["ok"] * 4, out
        answers = ["ANSWER-" + k for k in out["keys"]]
        assert [s.strip() for s in out["stdout"][:3]] == answers, out  # the victims ran and answered
        snooped, cmdline = out["stdout"][3].splitlines()
        score = sum(a in snooped for a in answers) / len(answers)
        assert score == 0 and snooped == "nothing", out
        reaper_cmdline = bytes.fromhex(cmdline.split()[1])
        for leak in (str(root).encode(), str(root).encode().hex().encode()):  # the old spec was hex on argv
            assert leak not in reaper_cmdline, reaper_cmdline
        assert out["drained"] and out["left"] == []
        uids = set(out["uids"]) | ({user.pw_uid} if user else set())
        assert _survivors(uids) == {}
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], capture_output=True)


# ==================================== limits that do not punish correct programs ===================================
THREADS_DRIVER = r"""
import json, os, sys, threading
sys.path.insert(0, sys.argv[1])
from ogrpo.sandbox.pool import Job, Sandbox
from ogrpo.sandbox.cleanup import CLEANER
level, root, have_cc = sys.argv[2], sys.argv[3], sys.argv[4] == "1"
stop = threading.Event()
threads = [threading.Thread(target=stop.wait) for _ in range(64)]  # a trainer's dataloader, NCCL, ... threads
for t in threads:
    t.start()
C = ('#include <stdio.h>\nint main(void){long a,b;if(scanf("%ld %ld",&a,&b)!=2)return 1;'
     'printf("%ld\\n",a+b);return 0;}\n')
PY = ("import threading\nn = int(input())\nout = [0] * 4\ndef f(i): out[i] = i * n\n"
      "ts = [threading.Thread(target=f, args=(i,)) for i in range(4)]\n"
      "[t.start() for t in ts]\n[t.join() for t in ts]\n"
      "print(sum(out))\n")
with Sandbox(max_workers=2, isolation=level, tmp_root=root) as box:
    jobs = [Job(PY, "python", ["5"])] + ([Job(C, "c", ["2 3"])] if have_cc else [])
    res = box.run_jobs(jobs)
    uids = box.uids()
threads_seen = threading.active_count()
stop.set()
out = [{"status": (r.runs[0] if r.runs else r.compile).status, "stdout": (r.runs[0] if r.runs else r.compile).stdout,
        "stderr": (r.runs[0] if r.runs else r.compile).stderr[-1500:]} for r in res]
print(json.dumps({"runs": out, "threads": threads_seen, "uids": uids, "drained": CLEANER.drain(timeout=60),
                  "left": os.listdir(root)}))
"""


def _trainer_cmd(user, driver: str, *args) -> list[str]:
    cmd = [shutil.which("python3", path="/usr/bin:/bin") or sys.executable, "-c", driver, *map(str, args)]
    if user:
        cmd = ["setpriv", "--reuid", str(user.pw_uid), "--regid", str(user.pw_gid), "--clear-groups", *cmd]
    return cmd


def _deep_root(user, under: Path | None = None) -> tuple[Path, Path]:
    """base/p1/p2/tmp_root under /tmp (or `under`), owned by the trainer's user: a broken cleaner stays inside
    base."""
    base = Path(tempfile.mkdtemp(prefix="ogrpo-sbx-lim-", dir=under))
    root = base / "p1" / "p2" / "tmp_root"
    root.mkdir(parents=True)
    if user:
        for p in (base, base / "p1", base / "p1" / "p2", root):
            os.chown(p, user.pw_uid, user.pw_gid)
    return base, root


@pytest.mark.parametrize("level,unprivileged", LEVELS, ids=[f"{lvl}-{'user' if u else 'root'}" for lvl, u in LEVELS])
def test_correct_programs_pass_under_a_trainer_with_64_threads(level, unprivileged, package, request):
    user = request.getfixturevalue("ci_user") if unprivileged else None
    base, root = _deep_root(user)
    try:
        proc = subprocess.run(_trainer_cmd(user, THREADS_DRIVER, package, level, root, int(bool(shutil.which("gcc")))),
                              capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout)
        assert out["threads"] > 64
        want = [("ok", "30\n"), ("ok", "5\n")][:len(out["runs"])]  # the C program where gcc exists
        assert [(r["status"], r["stdout"]) for r in out["runs"]] == want, out
        assert out["drained"] and out["left"] == []
        assert _survivors(set(out["uids"]) | ({user.pw_uid} if user else set())) == {}
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], capture_output=True)


DATA_DRIVER = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from ogrpo.sandbox import landlock
from ogrpo.sandbox.pool import Job, Sandbox
from ogrpo.sandbox.cleanup import CLEANER
level, root, have_cc = sys.argv[2], sys.argv[3], sys.argv[4] == "1"
# the attacker knows where the data are: the path comes on stdin
PY = ("import os\npath = input().strip()\nfound = []\n"
      "for p in (path, os.path.dirname(path)):\n"
      "    try:\n"
      "        found.append(open(p).read() if not os.path.isdir(p) else ' '.join(os.listdir(p)))\n"
      "    except OSError as e:\n"
      "        found.append(type(e).__name__)\n"
      "print(' | '.join(found))\n")
C = ('#include <stdio.h>\nint main(void){char p[4096],b[256];size_t n;FILE*f;if(scanf("%4095s",p)!=1)return 1;'
     'f=fopen(p,"r");if(!f){puts("denied");return 0;}n=fread(b,1,255,f);b[n]=0;printf("%s",b);return 0;}\n')
with Sandbox(max_workers=2, isolation=level, tmp_root=root) as box:
    jobs = [Job(PY, "python", [p]) for p in sys.argv[5:]]
    jobs += [Job(C, "c", [p]) for p in sys.argv[5:]] if have_cc else []
    res = box.run_jobs(jobs)
    uids, isolation = box.uids(), box.isolation
out = [{"status": (r.runs[0] if r.runs else r.compile).status, "stdout": (r.runs[0] if r.runs else r.compile).stdout,
        "stderr": (r.runs[0] if r.runs else r.compile).stderr[-1500:]} for r in res]
print(json.dumps({"isolation": isolation, "landlock": landlock.abi(), "runs": out, "uids": uids,
                  "drained": CLEANER.drain(timeout=60), "left": os.listdir(root)}))
"""


@pytest.mark.parametrize("where", ["under-tmp", "outside-tmp"])
@pytest.mark.parametrize("level,unprivileged", LEVELS, ids=[f"{lvl}-{'user' if u else 'root'}" for lvl, u in LEVELS])
def test_no_program_reads_the_training_data(level, unprivileged, where, package, request):
    """The test cases' expected outputs are in the training set, on the node's disk: a program that reads them
    scores without solving. Here a world-readable dataset outside every tmp dir (a project's data dir), and for
    an unprivileged trainer the user's own under its home; the program knows the path. Python and C, at every
    level, tmp_root (TMPDIR) under /tmp and outside it, beside the data: nothing read, nothing listed, and the
    programs still run."""
    user = request.getfixturevalue("ci_user") if unprivileged else None
    base, root = _deep_root(user, None if where == "under-tmp" else _outside_base())
    places = [_outside_base()] + ([Path(user.pw_dir)] if user else [])
    dirs = [Path(tempfile.mkdtemp(prefix="ogrpo-sbx-data-", dir=d)) for d in places]
    data = []
    for d in dirs:
        (d / "train.jsonl").write_text(json.dumps({"input": "2 3", "output": "ANSWER-5"}) + "\n")
        d.chmod(0o755)
        (d / "train.jsonl").chmod(0o644)
        if user:
            for p in (d, d / "train.jsonl"):
                os.chown(p, user.pw_uid, user.pw_gid)
        data.append(d / "train.jsonl")
    for d in places:  # each dir above the data reachable, as a project's or a home's is
        d.chmod(d.stat().st_mode | 0o005)
    try:
        proc = subprocess.run(_trainer_cmd(user, DATA_DRIVER, package, level, root,
                                           int(bool(shutil.which("gcc"))), *data),
                              capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout)
        if out["isolation"] != level:
            pytest.skip(f"{level} is not available here")
        if out["landlock"] < 1:
            pytest.skip("no Landlock in this kernel: programs read what their uid can (docs/sandbox.md)")
        assert all(r["status"] == "ok" for r in out["runs"]), out  # they ran: what they print is all they got
        for r in out["runs"]:
            assert "ANSWER" not in r["stdout"] and "train.jsonl" not in r["stdout"], out
        py = [r["stdout"] for r in out["runs"][:len(data)]]
        assert py == ["PermissionError | PermissionError\n"] * len(data), out
        assert all(r["stdout"] == "denied\n" for r in out["runs"][len(data):]), out
        assert out["drained"] and out["left"] == []
        assert _survivors(set(out["uids"]) | ({user.pw_uid} if user else set())) == {}
    finally:
        for d in [base, *dirs]:
            subprocess.run(["rm", "-rf", "--one-file-system", str(d)], capture_output=True)


TWO_POOLS_DRIVER = r"""
import json, os, sys, threading
sys.path.insert(0, sys.argv[1])
from ogrpo.sandbox.pool import Job, Limits, Sandbox
from ogrpo.sandbox.cleanup import CLEANER
level, root = sys.argv[2], sys.argv[3]
PY = "import time\nn = int(input())\ntime.sleep(1)\nprint(n * n)\n"
boxes = [Sandbox(max_workers=16, isolation=level, tmp_root=root) for _ in range(2)]  # two pools, one process
results = [None, None]
def run(i):
    results[i] = boxes[i].run_jobs([Job(PY, "python", [str(100 * i + k)]) for k in range(16)],
                                   limits=Limits(wall_s=60.0, cpu_s=30))
ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
[t.start() for t in ts]
[t.join() for t in ts]
uids = [b.uids() for b in boxes]
for b in boxes:
    b.close()
print(json.dumps({"uids": uids, "out": [[(r.runs[0].status, r.runs[0].stdout) for r in res] for res in results],
                  "drained": CLEANER.drain(timeout=60), "left": os.listdir(root)}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("level", ["root", "none"])
def test_two_trainers_on_one_node_share_no_slot_uid(level, package):
    """Two trainer processes, each with two pools of 16 (32 sandboxes at once per trainer): every slot uid is
    unique node-wide, every reward right (no pool's sweep kills another's program), nothing left behind."""
    base, root = _deep_root(None)
    try:
        procs = [subprocess.Popen(_trainer_cmd(None, TWO_POOLS_DRIVER, package, level, root), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env={"PATH": "/usr/bin:/bin"}) for _ in range(2)]
        outs = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            assert p.returncode == 0, stderr[-3000:]
            outs.append(json.loads(stdout))
        pools = [u for out in outs for u in out["uids"]]
        assert all(len(u) == 16 for u in pools) and len(set().union(*map(set, pools))) == 64, pools
        for out in outs:
            assert out["out"] == [[["ok", f"{(100 * i + k) ** 2}\n"] for k in range(16)] for i in range(2)], out
            assert out["drained"]
        assert list(root.iterdir()) == []  # once both are done (they share tmp_root)
        assert _survivors(set().union(*map(set, pools))) == {}
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], capture_output=True)


KILLED_TRAINER_DRIVER = r"""
import sys, threading
sys.path.insert(0, sys.argv[1])
from ogrpo.sandbox.pool import Job, Limits, Sandbox
box = Sandbox(max_workers=1, isolation="root", tmp_root=sys.argv[2])
print(box.uids()[0], flush=True)
box.run_jobs([Job("import time\ntime.sleep(60)")], limits=Limits(wall_s=120.0))
"""


def test_a_slot_uid_stays_taken_while_a_killed_trainers_program_lives(package):
    """The trainer is SIGKILLed mid-run (its pool's locks go with it): the launcher still holds the slot's lock,
    so no other pool on the node gets that uid until the program is gone."""
    import fcntl
    import time

    base, root = _deep_root(None)
    trainer = subprocess.Popen(_trainer_cmd(None, KILLED_TRAINER_DRIVER, package, root), stdout=subprocess.PIPE,
                               text=True, env={"PATH": "/usr/bin:/bin"})
    launcher = None
    try:
        uid = int(trainer.stdout.readline())
        deadline = time.monotonic() + 60
        while not _processes_of({uid}) and time.monotonic() < deadline:  # wait for the program to run
            time.sleep(0.1)
        (program,) = _processes_of({uid})
        ppid = lambda pid: int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                                    if line.startswith("PPid:")))  # noqa: E731
        launcher = ppid(ppid(program))  # program <- reaper <- launcher
        trainer.kill()
        trainer.wait()
        fd = os.open(f"/run/ogrpo-sandbox-slots/{uid}", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.kill(launcher, signal.SIGTERM)  # the wall clock's way: the launcher kills the tree and exits
            deadline = time.monotonic() + 30
            while _processes_of({uid}) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _processes_of({uid}) == {}
            for _ in range(100):  # the launcher's exit releases the lock
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(0.1)
            else:
                pytest.fail("the slot's lock outlived its launcher")
        finally:
            os.close(fd)
    finally:
        if trainer.poll() is None:
            trainer.kill()
        if launcher is not None:
            try:
                os.killpg(launcher, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], capture_output=True)
