"""The sandbox against hostile programs: each is contained, fails, and leaves nothing running or written.

Runs real programs through the real kernel features (namespaces, rlimits, setuid) and the system gcc. As root
(CI containers, this machine) the strongest level is used; the few checks that only that level can pass skip
elsewhere, and the "none" level's Python audit hook is tested on its own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from ogrpo.sandbox.cleanup import CLEANER
from ogrpo.sandbox.pool import CPU_LIMIT, ERROR, OK, SIGNALED, TIMEOUT, Job, Limits, Sandbox

REPO = Path(__file__).resolve().parents[1]
SHORT = Limits(cpu_s=2, wall_s=2.0)
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs the system gcc")


@pytest.fixture(scope="module")
def work_root(tmp_path_factory):
    return tmp_path_factory.mktemp("sbx")


@pytest.fixture(scope="module")
def sb(work_root):
    with Sandbox(max_workers=2, tmp_root=str(work_root)) as box:
        yield box


def _pid_namespaces() -> dict[int, str]:
    out = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                out[int(p)] = os.readlink(f"/proc/{p}/ns/pid")
            except OSError:
                pass
    return out


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _ours_or_orphaned(pid: int, in_new_namespaces: set[int]) -> bool:
    """Whether a process in a pid namespace that appeared during the test is this test's to judge: it descends from
    this process, or it was orphaned (its first ancestor outside those namespaces is init). A sandbox that another
    process runs meanwhile (the other pytest-xdist worker's, the Slurm suite's beside this one) descends from that
    process. A leaked program also keeps its slot uid, which the check below finds wherever it was reparented."""
    first_outside = None
    while pid not in (None, 0, 1):
        if pid == os.getpid():
            return True
        parent = _ppid(pid)
        if first_outside is None and parent not in in_new_namespaces:
            first_outside = parent
        pid = parent
    return first_outside in (None, 0, 1)


def _uid_of(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


@pytest.fixture
def nothing_left(sb, work_root):
    """After the test: no process of a sandbox uid, no process in a pid namespace that appeared during the
    test, and no work dir left behind."""
    before = set(_pid_namespaces().values())
    yield
    now = _pid_namespaces()
    new_ns = {pid: ns for pid, ns in now.items() if ns not in before}
    left = {pid: ns for pid, ns in new_ns.items() if _ours_or_orphaned(pid, set(new_ns))}
    assert left == {}, f"processes left in sandbox pid namespaces: {left}"
    uids = set(sb.uids())
    assert [p for p in now if _uid_of(p) in uids] == []
    assert CLEANER.drain(timeout=60)  # work dirs are removed in the background
    assert list(work_root.iterdir()) == []


def test_probe_picks_namespaces_as_root(sb):
    # Root in this container may create namespaces; a silent fall back to "none" would lose the network and
    # file-system containment the other tests rely on.
    if os.geteuid() != 0:
        pytest.skip("the root level needs root")
    assert sb.isolation == "root"
    assert len(sb.uids()) == 2 and all(u >= 1_000_000 for u in sb.uids())


def test_normal_program_runs(sb, nothing_left):
    res = sb.run("print(input()[::-1])", stdin="abc\n")
    assert (res.status, res.stdout, res.returncode) == (OK, "cba\n", 0)
    assert 0 < res.wall_s < 5


def test_minimal_environment_and_no_inherited_fds(sb, nothing_left, monkeypatch):
    monkeypatch.setenv("OGRPO_SECRET_TOKEN", "hunter2")
    keep = open(__file__)  # an fd of the trainer that must not reach the program
    try:
        res = sb.run("import json, os\nprint(json.dumps([sorted(os.environ), sorted(os.listdir('/proc/self/fd'))]))")
    finally:
        keep.close()
    env, fds = json.loads(res.stdout)
    assert set(env) <= {"PATH", "LANG", "HOME", "TMPDIR"}
    assert fds == ["0", "1", "2", "3"]  # stdio + the fd listdir itself opened


def test_python_fork_bomb_is_contained(sb, nothing_left):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    t0 = time.perf_counter()
    res = sb.run(bomb, limits=SHORT)
    assert res.status in (TIMEOUT, CPU_LIMIT, SIGNALED, ERROR)
    assert time.perf_counter() - t0 < SHORT.wall_s + 8  # killed on time, the trainer thread never hangs


@needs_gcc
def test_c_fork_bomb_is_contained(sb, nothing_left):
    res = sb.run("#include <unistd.h>\nint main(void){for(;;) fork();}", "c", limits=SHORT)
    assert res.status != OK


def test_infinite_loop_with_a_detached_child(sb, nothing_left):
    # The child leaves the session and would outlive a plain process-group kill; the pid namespace takes it.
    src = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(300)\nwhile True:\n    pass\n"
    t0 = time.perf_counter()
    res = sb.run(src, limits=Limits(cpu_s=1, wall_s=2.0))
    assert res.status in (CPU_LIMIT, TIMEOUT)
    assert time.perf_counter() - t0 < 2.0 + 8


def test_ten_gib_allocation_fails_in_python(sb, nothing_left):
    res = sb.run("x = bytearray(10 * 1024**3)\nprint('allocated')")
    assert res.status == ERROR and "MemoryError" in res.stderr and "allocated" not in res.stdout


@needs_gcc
def test_ten_gib_allocation_fails_in_c(sb, nothing_left):
    src = ("#include <stdlib.h>\n#include <string.h>\n#include <stdio.h>\n"
           "int main(void){size_t n=10UL<<30; char*p=malloc(n); if(!p) return 3; memset(p,1,n); puts(\"ok\");}")
    res = sb.run(src, "c")
    assert res.status != OK and "ok" not in res.stdout


def test_write_outside_the_work_dir_is_impossible(sb, nothing_left):
    if sb.isolation not in ("root", "userns"):
        pytest.skip("needs a mount namespace (and, as root, the slot uid)")
    target = REPO / f"sbx_escape_{uuid.uuid4().hex}"
    res = sb.run(f"open({str(target)!r}, 'w').write('pwned')")
    # A checkout under /tmp is hidden by the private /tmp bind (no such directory there); elsewhere the
    # read-only remount or the slot uid refuses the write. Either way nothing reaches the real repository.
    assert res.status == ERROR and any(w in res.stderr for w in ("Read-only file system", "Permission denied",
                                                                 "No such file or directory")), res.stderr
    assert not target.exists()


def test_world_writable_site_dirs_are_read_only(sb, nothing_left):
    # A cluster's /scratch is often mode 1777: the uid alone would not stop a write there, the read-only
    # remount of every mount but the work dir does.
    if sb.isolation not in ("root", "userns") or not os.access("/run", os.W_OK):
        pytest.skip("needs a mount namespace and a writable /run to stand in for /scratch")
    scratch = Path("/run") / f"ogrpo-scratch-{uuid.uuid4().hex}"
    scratch.mkdir()
    try:
        scratch.chmod(0o1777)
        res = sb.run(f"open({str(scratch / 'x')!r}, 'w').write('x')")
        assert res.status == ERROR and "Read-only file system" in res.stderr
        assert list(scratch.iterdir()) == []
    finally:
        shutil.rmtree(scratch)


def test_userns_level_as_root_cannot_write_the_repository(tmp_path):
    # In a user namespace the program is a non-zero uid of its own nested namespace (the slot uid on the host
    # when the trainer is root): the read-only remount and the uid stand between it and the repository. A
    # checkout under /tmp (CI's clone) is hidden by the private /tmp, which would prove nothing about the
    # remount: then a root-writable directory outside /tmp stands in.
    base = Path("/usr/local") if REPO.is_relative_to("/tmp") else REPO
    target = base / f"sbx_escape_{uuid.uuid4().hex}"
    with Sandbox(max_workers=1, isolation="userns", tmp_root=str(tmp_path)) as box:
        if not box.run("pass").ok:
            pytest.skip("user namespaces are not allowed here")
        res = box.run(f"import os; print(os.getuid()); open({str(target)!r}, 'w')")
    assert res.stdout == "1000\n" and ("Read-only file system" in res.stderr or "Permission denied" in res.stderr)
    assert not target.exists()


def test_shared_tmp_dirs_are_private(sb, nothing_left):
    if sb.isolation not in ("root", "userns"):
        pytest.skip("needs a mount namespace")
    name = f"sbx_tmp_{uuid.uuid4().hex}"
    res = sb.run(f"for d in ('/tmp', '/var/tmp', '/dev/shm'):\n    open(d + '/{name}', 'w').write('x')\n"
                 "print('written')")
    assert res.stdout == "written\n"
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not Path(d, name).exists()  # it went to the work dir, which is gone (nothing_left checks)


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.3)
    yield srv
    srv.close()


def _no_connection(srv: socket.socket) -> bool:
    try:
        conn, _ = srv.accept()
    except socket.timeout:
        return True
    conn.close()
    return False


def test_socket_to_localhost_is_refused(sb, nothing_left, listener):
    port = listener.getsockname()[1]
    res = sb.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).send(b'hi')\n"
                 "print('connected')")
    assert res.status == ERROR and "connected" not in res.stdout
    assert _no_connection(listener)


@needs_gcc
def test_c_socket_to_localhost_is_refused(sb, nothing_left, listener):
    if sb.isolation not in ("root", "userns"):
        pytest.skip("C programs have no network containment without a network namespace")
    port = listener.getsockname()[1]
    src = ("#include <arpa/inet.h>\n#include <sys/socket.h>\n#include <string.h>\n"
           "int main(void){int s=socket(AF_INET,SOCK_STREAM,0); struct sockaddr_in a; memset(&a,0,sizeof a);"
           f"a.sin_family=AF_INET; a.sin_port=htons({port}); a.sin_addr.s_addr=htonl(0x7f000001);"
           "return connect(s,(struct sockaddr*)&a,sizeof a)==0 ? 0 : 1;}")
    res = sb.run(src, "c")
    assert res.status == ERROR
    assert _no_connection(listener)


def test_none_level_refuses_python_sockets(listener, tmp_path):
    # The fallback where the kernel allows no namespaces: an audit hook, installed before the first line.
    port = listener.getsockname()[1]
    with Sandbox(max_workers=1, isolation="none", tmp_root=str(tmp_path)) as box:
        res = box.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
        fork = box.run("import os\nos.fork()\nprint('forked')")
    assert res.status == ERROR and "not allowed" in res.stderr
    assert _no_connection(listener)
    assert fork.status == ERROR and "forked" not in fork.stdout


@needs_gcc
def test_none_level_as_root_still_contains_a_c_fork_bomb(tmp_path):
    # No namespaces (a container that forbids unshare): the slot uid's NPROC bounds the bomb, and a kill of
    # every process of that uid afterwards reaches the children that left the process group.
    if os.geteuid() != 0:
        pytest.skip("the uid drop needs root")
    bomb = "#include <unistd.h>\nint main(void){setsid(); for(;;) if(fork()==0) setsid();}"
    with Sandbox(max_workers=1, isolation="none", tmp_root=str(tmp_path)) as box:
        res = box.run(bomb, "c", limits=SHORT)
        uids = set(box.uids())
        write = box.run(f"open({str(REPO / ('sbx_escape_' + uuid.uuid4().hex))!r}, 'w')")
    assert res.status != OK and uids
    assert [p for p in _pid_namespaces() if _uid_of(p) in uids] == []
    assert write.status == ERROR and "Permission denied" in write.stderr


def test_userns_level_isolates_the_network(listener, tmp_path):
    port = listener.getsockname()[1]
    with Sandbox(max_workers=1, isolation="userns", tmp_root=str(tmp_path)) as box:
        if not box.run("pass").ok:
            pytest.skip("user namespaces are not allowed here")
        res = box.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
    assert res.status == ERROR and "unreachable" in res.stderr
    assert _no_connection(listener)


_UNPRIVILEGED_TRAINER = """
import json, os, sys, tempfile
sys.path.insert(0, sys.argv[1])
from ogrpo.sandbox.pool import Sandbox, SandboxUnavailable
root = tempfile.mkdtemp()
try:
    Sandbox(max_workers=1, tmp_root=root).close()
except SandboxUnavailable:  # fail closed: no silent fall back to "none"
    print(json.dumps(["unavailable", "", "", "", "ok", []]))
    sys.exit(0)
with Sandbox(max_workers=1, tmp_root=root) as box:
    net = box.run("import socket; socket.create_connection(('127.0.0.1', int(input())), timeout=2)", stdin=sys.argv[2])
    ns = box.run("import os; print(os.getpid())")
    # A mode-000 dir with content: a plain rmtree by the (non-root) trainer could not remove it.
    locked = box.run("import os; os.makedirs('a/b'); open('a/b/f', 'w').close(); os.chmod('a', 0)")
left = os.listdir(root)
os.rmdir(root)
print(json.dumps([box.isolation, net.status, net.stderr, ns.stdout, locked.status, left]))
"""


def test_unprivileged_trainer_gets_namespaces(listener):
    # The cluster case: the trainer is not root. Run a trainer-side process as `nobody` through the real
    # probe; with user namespaces allowed it must pick "userns", cut the network and get a pid namespace.
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or shutil.which("setpriv") is None or python is None:
        pytest.skip("needs root (to become nobody), setpriv and a system python3")
    out = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", python,
                          "-c", _UNPRIVILEGED_TRAINER, str(REPO), str(listener.getsockname()[1])],
                         capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    isolation, status, stderr, pid, locked, left = json.loads(out.stdout)
    assert (locked, left) == (OK, [])  # the work dir is gone even when the program locked parts of it
    if isolation == "unavailable":
        pytest.skip("this kernel allows no unprivileged user namespaces")
    assert isolation == "userns"
    assert status == ERROR and "unreachable" in stderr
    assert pid.strip() == "2"  # pid 1 is the reaper of its own pid namespace
    assert _no_connection(listener)


@needs_gcc
def test_segfault_in_c(sb, nothing_left):
    res = sb.run("int main(void){volatile int *p = 0; return *p;}", "c")
    assert (res.status, res.signal) == (SIGNALED, signal.SIGSEGV)


def test_output_is_bounded_by_the_file_size_limit(sb, nothing_left):
    res = sb.run("import sys\nsys.stdout.write('x' * (64 * 1024**2))", limits=Limits(file_bytes=1024**2))
    assert res.status != OK and len(res.stdout) <= 1024**2


@needs_gcc
def test_compile_error_is_reported(sb, nothing_left):
    res = sb.run("int main( {", "c")
    assert res.status == "compile_error" and "error" in res.stderr


def test_job_stops_after_a_listed_status(sb, nothing_left):
    # code_reward stops a completion's test cases at its first timeout, as open-r1's script does.
    job = Job("import time\nif input() == 'slow':\n    time.sleep(60)\nprint('fast')", inputs=["fast", "slow", "fast"],
              stop_on=(TIMEOUT,))
    res = sb.run_jobs([job], limits=Limits(wall_s=1.0))[0]
    assert [r.status for r in res.runs] == [OK, TIMEOUT]


def test_sandbox_survives_everything_above(sb):
    # Module order runs this last: after the bombs, loops and crashes, the same pool still runs programs.
    assert sb.run("print(6 * 7)").stdout == "42\n"


def test_parallel_sleepers_finish_together(tmp_path):
    # 8 programs that each sleep 1 s: serially 8 s; with 8 workers about 1 s plus start-up.
    with Sandbox(max_workers=8, tmp_root=str(tmp_path)) as box:
        t0 = time.perf_counter()
        results = box.run_jobs([Job("import time\ntime.sleep(1)\nprint('done')") for _ in range(8)])
        elapsed = time.perf_counter() - t0
    assert [r.runs[0].stdout for r in results] == ["done\n"] * 8
    assert elapsed < 5.0, f"8 x 1 s sleepers took {elapsed:.1f} s"


def test_cpu_bound_programs_scale_with_cores(tmp_path):
    """Two programs of one batch run at the same time, not one after the other: each prints when (on the system-wide
    monotonic clock) it started and ended its loop, and the two spans overlap for most of their length. A ratio of
    wall times told the same on an idle machine but not beside another busy test (one core left for both)."""
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("needs 2 cores")
    busy = ("import time\na = time.monotonic()\ns = 0\nfor i in range(4_000_000):\n    s += i\n"
            "print(a, time.monotonic())")
    before = set(_pid_namespaces().values())
    with Sandbox(max_workers=2, tmp_root=str(tmp_path)) as box:
        box.run(busy)  # warm the page cache
        two = box.run_jobs([Job(busy), Job(busy)])
        uids = set(box.uids())
    assert all(r.runs[0].ok for r in two)
    now = _pid_namespaces()  # nothing of the programs is left: in their pid namespaces, nor under a slot uid
    new_ns = {pid: ns for pid, ns in now.items() if ns not in before}
    assert {pid: ns for pid, ns in new_ns.items() if _ours_or_orphaned(pid, set(new_ns))} == {}
    assert [pid for pid in now if _uid_of(pid) in uids] == []
    (a1, b1), (a2, b2) = (map(float, r.runs[0].stdout.split()) for r in two)
    shared = min(b1, b2) - max(a1, a2)
    assert shared > 0.5 * min(b1 - a1, b2 - a2), f"spans {a1:.3f}-{b1:.3f} and {a2:.3f}-{b2:.3f} barely overlap"


@pytest.mark.gpu
def test_sandbox_in_a_process_with_a_cuda_context(tmp_path, monkeypatch):
    # The trainer's situation: CUDA is initialised before the first reward. Programs start from pool threads
    # (vfork + exec, no Python fork), and the trainer's CUDA context keeps working afterwards.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    import torch

    x = torch.arange(1024, device="cuda", dtype=torch.float32)
    with Sandbox(max_workers=4, tmp_root=str(tmp_path)) as box:
        results = box.run_jobs([Job("import os\nprint('CUDA_VISIBLE_DEVICES' in os.environ)")] * 8)
    assert [r.runs[0].stdout for r in results] == ["False\n"] * 8  # and no trainer environment leaked in
    assert float((x * 2).sum().item()) == 2 * sum(range(1024))


def test_a_python_that_cannot_start_in_it_is_refused_at_once(tmp_path):
    """Every program of a Python that cannot start under the sandbox (its install unreadable, say) would score 0
    without a word: the pool runs one at start-up and refuses, naming the interpreter."""
    from ogrpo.sandbox.pool import SandboxUnavailable

    with pytest.raises(SandboxUnavailable, match="Python programs do not start in it .*/bin/false"):
        Sandbox(max_workers=1, isolation="none", python="/bin/false", tmp_root=str(tmp_path))


def test_a_program_reads_its_interpreters_install_and_nothing_of_the_checkout(sb, nothing_left):
    """Reads are confined (ogrpo/sandbox/landlock.py) to the system's software and what the interpreter reads:
    the standard library and a venv's site-packages import, the checkout around them does not read."""
    from ogrpo.sandbox import landlock

    if landlock.abi() < 1:
        pytest.skip("no Landlock in this kernel")
    readme = Path(__file__).resolve().parents[1] / "README.md"
    src = ("import json, decimal, sqlite3, os\ntry:\n    open(%r).read()\n    print('read')\n"
           "except OSError:\n    print('denied')\nprint(json.dumps(sorted(os.listdir('/usr'))[:1]))\n"
           % str(readme))
    res = sb.run(src, "python")
    assert res.status == OK and res.stdout.splitlines()[0] == "denied", res


def test_readable_for_takes_the_install_above_bin_and_a_venvs_root(tmp_path):
    from ogrpo.sandbox.landlock import readable_for

    base = tmp_path / "python-3.11"
    (base / "bin").mkdir(parents=True)
    (base / "bin" / "python3.11").write_text("")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(base / "bin" / "python3.11")
    assert readable_for(str(venv / "bin" / "python")) == [str(venv), str(base)]
    assert readable_for(str(tmp_path / "work" / "prog")) == []  # a program built in the work dir adds nothing
