"""Supervisor and local backend with lightweight fake roles (a tiny HTTP server answering /health, a trainer
that polls it), so the fault paths run in seconds. The real vLLM server + TRL trainer run in
test_serve_integration.py."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from ogrpo.jobspec import JobSpec, Step
from ogrpo.launch.local import load_jobspec, run_local, run_local_result
from ogrpo.launch.supervisor import fill

FAKE_SERVER = r"""
import http.server, sys, time
host, port, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
health = sys.argv[4] if len(sys.argv) > 4 else "/health"  # trl vllm-serve answers only "/health/"
time.sleep(delay)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == health else 404); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): print("GET", self.path, flush=True)
print("fake server on", host, port, flush=True)
http.server.HTTPServer((host, port), H).serve_forever()
"""

# Polls the server like TRL's client does, then "trains" for a while; exits 1 if the server goes away.
FAKE_TRAINER = r"""
import sys, time, urllib.request
url, seconds = sys.argv[1], float(sys.argv[2])
health = sys.argv[3] if len(sys.argv) > 3 else "/health"
deadline = time.time() + 60
while True:
    try:
        urllib.request.urlopen(url + health, timeout=1); break
    except Exception:
        if time.time() > deadline: sys.exit(3)
        time.sleep(0.2)
end = time.time() + seconds
while time.time() < end:
    time.sleep(0.2)
print("trained", flush=True)
"""


def fake_job(tmp_path: Path, *, server_delay=0.0, train_s=1.0, server_argv=None, trainer_argv=None) -> JobSpec:
    server = server_argv or [sys.executable, "-c", FAKE_SERVER, "{server_host}", "{server_port}", str(server_delay)]
    trainer = trainer_argv or [sys.executable, "-c", FAKE_TRAINER, "http://{server_host}:{server_port}", str(train_s)]
    return JobSpec(name="fake", job_dir=str(tmp_path), health_timeout_s=30, steps=[
        Step(role="server", nodes=[0], gpus=[], ntasks=1, argv=server),
        Step(role="trainer", nodes=[0], gpus=[], ntasks=1, argv=trainer, env={"OGRPO_JOB": "{job_dir}"}),
    ])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _role(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / "run" / "roles" / f"{name}.json").read_text())


def test_fill_replaces_only_placeholders():
    values = {"server_host": "127.0.0.1", "server_port": "1234", "job_dir": "/j"}
    assert fill("http://{server_host}:{server_port}/x", values) == "http://127.0.0.1:1234/x"
    # JSON in an argument (vLLM's --weight-transfer-config) must survive untouched
    assert fill('{"backend": "nccl"}', values) == '{"backend": "nccl"}'
    assert fill("{rendezvous_port}", values) == "{rendezvous_port}"


def test_trainer_end_tears_server_down(tmp_path):
    out = io.StringIO()
    res = run_local_result(fake_job(tmp_path), out=out)
    assert res.rc == 0, out.getvalue()
    server, trainer = _role(tmp_path, "server"), _role(tmp_path, "trainer")
    assert not _alive(server["pid"]) and not _alive(trainer["pid"])
    assert "trained" in (tmp_path / "run" / "logs" / "trainer.log").read_text()
    assert "healthy" in out.getvalue() and "trainer finished; server stopped" in out.getvalue()
    # loopback only, and placeholders filled in argv and env
    assert server["argv"][3] == "127.0.0.1" and server["argv"][4].isdigit()


def test_health_wait_uses_the_jobspec_path_of_trl_vllm_serve(tmp_path):
    """TRL 1.9's server answers only `/health/`: the supervisor polls the path the JobSpec names."""
    from ogrpo import compat

    path = compat.health_path(compat.TRL_VLLM_SERVE)
    job = fake_job(tmp_path, server_argv=[sys.executable, "-c", FAKE_SERVER, "{server_host}", "{server_port}", "0",
                                          path],
                   trainer_argv=[sys.executable, "-c", FAKE_TRAINER, "http://{server_host}:{server_port}", "0.5",
                                 path])
    job.health_path = path
    out = io.StringIO()
    res = run_local_result(job, out=out)
    assert res.rc == 0, out.getvalue()
    assert f":{_role(tmp_path, 'server')['argv'][4]}{path} after" in out.getvalue()  # "server healthy at …"


def test_server_killed_mid_run_stops_job(tmp_path):
    out = io.StringIO()
    job = fake_job(tmp_path, train_s=300)
    box = {}
    t = threading.Thread(target=lambda: box.update(res=run_local_result(job, out=out)))
    t.start()
    log = tmp_path / "run" / "logs" / "server.log"
    deadline = time.time() + 30
    while time.time() < deadline and "server healthy" not in out.getvalue():
        time.sleep(0.2)
    server_pid = _role(tmp_path, "server")["pid"]
    killed_at = time.monotonic()
    os.kill(server_pid, signal.SIGKILL)
    t.join(timeout=60)
    assert not t.is_alive()
    elapsed = time.monotonic() - killed_at
    res = box["res"]
    assert elapsed < 30
    assert res.rc != 0
    assert str(log) in res.message and "mid-run" in res.message
    assert not _alive(_role(tmp_path, "trainer")["pid"])


@pytest.mark.slow
def test_server_never_healthy_times_out(tmp_path):
    out = io.StringIO()
    # `sleep` never answers /health; the trainer would wait 60 s for it
    job = fake_job(tmp_path, server_argv=["sleep", "600"])
    t0 = time.monotonic()
    res = run_local_result(job, health_timeout_s=3, out=out)
    assert time.monotonic() - t0 < 25
    assert res.rc == 1 and "not healthy" in res.message and "server.log" in res.message
    assert not _alive(_role(tmp_path, "server")["pid"]) and not _alive(_role(tmp_path, "trainer")["pid"])


def test_trainer_failure_names_trainer_log(tmp_path):
    job = fake_job(tmp_path, trainer_argv=[sys.executable, "-c", "import sys; print('boom'); sys.exit(7)"])
    res = run_local_result(job, out=io.StringIO())
    assert res.rc == 7 and "trainer.log" in res.message and "boom" in res.message
    assert not _alive(_role(tmp_path, "server")["pid"])


@pytest.mark.slow
def test_two_local_jobs_get_distinct_ports(tmp_path):
    results, outs = {}, {}
    def go(name):
        outs[name] = io.StringIO()
        results[name] = run_local_result(fake_job(tmp_path / name, server_delay=1.0, train_s=2.0), out=outs[name])
    threads = [threading.Thread(target=go, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert all(r.rc == 0 for r in results.values()), outs
    ports = [_role(tmp_path / n, "server")["argv"][4] for n in ("a", "b")]
    assert ports[0] != ports[1]


def _non_loopback_address() -> str | None:
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect(("10.255.255.255", 1))  # no packet is sent; this only picks the outgoing interface
        addr = s.getsockname()[0]
        s.close()
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


def test_local_server_not_reachable_off_loopback(tmp_path):
    addr = _non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    probe = r"""
import socket, sys, time, urllib.request
port = int(sys.argv[2])
for _ in range(100):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1); break
    except OSError:
        time.sleep(0.2)
s = socket.socket(); s.settimeout(2)
r = s.connect_ex((sys.argv[1], port)); print("connect", r, flush=True)
sys.exit(0 if r else 9)
"""
    job = fake_job(tmp_path, trainer_argv=[sys.executable, "-c", probe, addr, "{server_port}"])
    res = run_local_result(job, out=io.StringIO())
    log = (tmp_path / "run" / "logs" / "trainer.log").read_text()
    assert res.rc == 0, log  # the server answered on loopback, and connecting on the other address was refused


def test_run_local_from_job_dir(tmp_path, capsys):
    job = fake_job(tmp_path)
    (tmp_path / "jobspec.json").write_text(json.dumps(job.to_dict()))
    assert load_jobspec(tmp_path).steps[1].env == {"OGRPO_JOB": "{job_dir}"}
    assert run_local(tmp_path) == 0
    assert "trainer finished" in capsys.readouterr().err


def test_a_job_without_a_server_does_not_report_stopping_one(tmp_path):
    job = fake_job(tmp_path, trainer_argv=[sys.executable, "-c", "print('trained')"])
    job.steps = [s for s in job.steps if s.role == "trainer"]
    out = io.StringIO()
    assert run_local_result(job, out=out).rc == 0
    assert "trainer finished" in out.getvalue() and "server stopped" not in out.getvalue()


@pytest.mark.slow
def test_supervise_cli_exit_codes(tmp_path, run_cli):
    ok = tmp_path / "ok"
    (ok / "run").mkdir(parents=True)
    (ok / "jobspec.json").write_text(json.dumps(fake_job(ok).to_dict()))
    run_cli("supervise", ok, check_rc=0)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "jobspec.json").write_text(json.dumps(fake_job(bad, server_argv=["sleep", "600"]).to_dict()))
    proc = run_cli("supervise", bad, "--health-timeout", "2")
    assert proc.returncode == 1 and "not healthy" in proc.stderr and "server.log" in proc.stderr
    missing = run_cli("supervise", tmp_path / "nowhere")
    assert missing.returncode == 2 and "no job spec" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_to_the_supervisor_leaves_no_process_behind(tmp_path, sig):
    import subprocess

    job = tmp_path / "job"
    (job / "run").mkdir(parents=True)
    (job / "jobspec.json").write_text(json.dumps(fake_job(job, train_s=120).to_dict()))
    sup = subprocess.Popen([sys.executable, "-m", "ogrpo", "supervise", str(job)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not all((job / "run" / "roles" / f"{r}.json").is_file() for r in ("server", "trainer")):
            assert time.time() < deadline and sup.poll() is None, "roles did not start"
            time.sleep(0.2)
        time.sleep(0.5)
        pids = [_role(job, r)["pid"] for r in ("server", "trainer")]
        assert all(_alive(p) for p in pids)
        sup.send_signal(sig)
        rc = sup.wait(timeout=60)
    finally:
        if sup.poll() is None:
            sup.kill()
    assert rc != 0  # stopped, not finished
    assert not any(_alive(p) for p in pids), f"left running after {signal.Signals(sig).name}"


# A launcher like accelerate's one-process launcher: it dies of SIGTERM at once, while its worker (which got the
# same SIGTERM) finishes its step and saves first.
LAUNCHER = r"""
import subprocess, sys
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]]).wait()
"""
WORKER = r"""
import os, pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
stop = []
signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
(out / "worker.pid").write_text(str(os.getpid()))
while not stop:
    time.sleep(0.05)
time.sleep(1.5)  # the end of the step, the checkpoint
(out / "saved").write_text("ok")
"""


def _wait_file(path: Path, timeout: float = 60, text: bool = True) -> str:
    """The file's text once it has some (a script's plain write may be seen created but still empty); with
    text=False, once it exists (a marker file, empty by design)."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and (not text or path.read_text().strip())):
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)
    time.sleep(0.1)
    return path.read_text()


def test_stop_waits_for_a_worker_that_outlives_its_launcher(tmp_path):
    """Stopping a step waits for its whole process group, not only for the launcher that leads it (which
    used to get the worker SIGKILLed at once, before it could save)."""
    from ogrpo.launch.supervisor import Supervisor

    spec = fake_job(tmp_path, trainer_argv=[sys.executable, "-c", LAUNCHER, WORKER, str(tmp_path)])
    spec.steps = [s for s in spec.steps if s.role == "trainer"]
    sup = Supervisor(spec, {"job_dir": str(tmp_path)}, out=io.StringIO())
    sender = threading.Thread(target=lambda: (_wait_file(tmp_path / "worker.pid"), os.kill(os.getpid(),
                                                                                           signal.SIGTERM)))
    sender.start()
    result = sup.run()
    sender.join()
    assert result.rc == 128 + signal.SIGTERM
    assert (tmp_path / "saved").exists(), "the worker was killed before it could save"
    assert not _alive(int((tmp_path / "worker.pid").read_text()))


def _wrapper(tmp_path: Path, *cmd: str, stop_file: Path | None = None):
    import subprocess

    argv = [sys.executable, "-m", "ogrpo.launch.slurm", "step", "--role", "trainer", "--job-dir", str(tmp_path),
            "--ignore-usr2", *(["--stop-file", str(stop_file)] if stop_file else []), "--", *cmd]
    return subprocess.Popen(argv, start_new_session=True)


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_step_wrapper_keeps_a_launchers_orphans_and_returns_after_them(tmp_path):
    """What Slurm does to a step on scancel: SIGTERM to every process of it. accelerate's launcher dies; its
    worker must stay under the step (reparented to the wrapper, not PID 1, where Slurm's tracking loses it)
    and the step must end only after the worker did."""
    from ogrpo.launch.reaper import descendants

    wrapper = _wrapper(tmp_path, sys.executable, "-c", LAUNCHER, WORKER, str(tmp_path))
    try:
        worker = int(_wait_file(tmp_path / "worker.pid"))
        record = json.loads(_wait_file(tmp_path / "run" / "roles" / "trainer.step.json"))
        assert record["pid"] == wrapper.pid and record["pgid"] == _ppid(worker) and record["boot_id"]
        for pid in [wrapper.pid, *descendants(wrapper.pid)]:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _alive(record["pgid"]):  # the launcher dies at once
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert _ppid(worker) == wrapper.pid  # adopted by the wrapper (child subreaper), inside the step
        rc = wrapper.wait(timeout=60)
        assert (tmp_path / "saved").exists() and not _alive(worker)  # it returned after the worker, not before
        assert rc == 128 + signal.SIGTERM  # the launcher's death, as srun reports it
    finally:
        if wrapper.poll() is None:
            os.killpg(wrapper.pid, signal.SIGKILL)


def test_step_wrapper_stop_file_ends_the_step_with_0_and_its_death_takes_the_command(tmp_path):
    stop = tmp_path / "server.stop"
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    wrapper = _wrapper(tmp_path, *sleeper, stop_file=stop)
    record = json.loads(_wait_file(tmp_path / "run" / "roles" / "trainer.step.json"))
    stop.write_text("now\n")  # what the supervisor writes once the trainer has finished
    assert wrapper.wait(timeout=30) == 0 and not _alive(record["pgid"])

    stop.unlink()
    (tmp_path / "run" / "roles" / "trainer.step.json").unlink()
    wrapper = _wrapper(tmp_path, *sleeper, stop_file=stop)
    record = json.loads(_wait_file(tmp_path / "run" / "roles" / "trainer.step.json"))
    wrapper.kill()  # PR_SET_PDEATHSIG: the command dies with its wrapper
    wrapper.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _alive(record["pgid"]):
        assert time.monotonic() < deadline, "the command outlived its killed wrapper"
        time.sleep(0.05)


def test_a_step_that_states_its_error_is_summarized_by_that_one_line(tmp_path):
    """A GPU plan on a node without CUDA: the trainer prints one `error:` line, then its launcher reports the
    child's exit with a traceback (~40 lines). The job's summary (result.json, `ogrpo status`, the supervisor's
    `job failed:` line) is the trainer's line, not the traceback."""
    noise = "\n".join(["Traceback (most recent call last):", *[f'  File "launch.py", line {i}, in run' for i in
                                                                 range(38)], "subprocess.CalledProcessError: 1"])
    refuse = (f"import sys; print('loading'); print('error: trainer: the plan is for 2xV100 but this process sees "
              f"no CUDA device', file=sys.stderr); print({noise!r}); sys.exit(2)")
    job = fake_job(tmp_path, trainer_argv=[sys.executable, "-c", refuse])
    res = run_local_result(job, out=io.StringIO())
    log = tmp_path / "run" / "logs" / "trainer.log"
    assert res.rc == 2 and res.message == (f"trainer exited with code 2: error: trainer: the plan is for 2xV100 but "
                                           f"this process sees no CUDA device (log: {log})")
    # a server that refuses the same way: its line, too
    job = fake_job(tmp_path / "srv", server_argv=[sys.executable, "-c", refuse.replace("trainer:", "server:")])
    res = run_local_result(job, out=io.StringIO())
    assert res.rc == 1 and len(res.message.splitlines()) == 1 and "error: server: the plan is for 2xV100" in \
        res.message and "before becoming healthy" in res.message


def test_a_server_step_that_exits_0_on_sigterm_reports_the_signal(tmp_path):
    """vLLM exits 0 on SIGTERM. Slurm delivers a step's signal to every process of it (`scancel --signal=TERM`):
    the server's wrapper reports 143, so the supervisor sees the job's stop (and requeues), not a server that
    ended by itself mid-run."""
    from ogrpo.launch.reaper import descendants

    exits_0 = [sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: "
               "sys.exit(0)); open(sys.argv[1], 'w').close(); time.sleep(600)", str(tmp_path / "up")]
    wrapper = _wrapper(tmp_path, *exits_0, stop_file=tmp_path / "server.stop")
    try:
        _wait_file(tmp_path / "up", text=False)
        for pid in [wrapper.pid, *descendants(wrapper.pid)]:
            os.kill(pid, signal.SIGTERM)
        assert wrapper.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if wrapper.poll() is None:
            os.killpg(wrapper.pid, signal.SIGKILL)


@pytest.mark.slow
def test_the_signal_hook_may_take_the_signal_over(tmp_path):
    """Slurm's hook answers a SIGTERM to the batch step while the job runs on (`scancel -b --signal=TERM`) with a
    checkpoint and a requeue: it runs before the stop is recorded, its own wait is not cut short, and it ends the
    run by raising."""
    from ogrpo.launch.supervisor import Supervisor

    class TookOver(Exception):
        pass

    seen = {}

    def hook(signum):
        seen["signalled"] = sup.signalled  # what the USR2/TERM checkpoint wait looks at
        raise TookOver()

    job = fake_job(tmp_path, train_s=300)
    out = io.StringIO()
    from ogrpo.launch.ports import free_ports

    port = free_ports(1)[0]
    sup = Supervisor(job, {"server_host": "127.0.0.1", "server_port": str(port)}, out=out, on_signal=hook)
    threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(TookOver):
        sup.run()
    assert seen == {"signalled": None}
    assert all(not _alive(r.proc.pid) for r in sup.running)  # and the run's teardown still ran
