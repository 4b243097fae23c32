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
