"""SIGTERM, SIGINT or SIGHUP to an O-GRPO command that started a server leaves no process behind.
(The supervisor's own signal test is in test_supervisor.py.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.test_bench_rollout import TINY


def _is_server(proc: psutil.Process) -> bool:
    try:
        argv = proc.cmdline()
        # `ogrpo serve` execs into vLLM's server (`-m ogrpo.serve.vllm_api`): either form is the server
        return argv[1:4] == ["-m", "ogrpo", "serve"] or argv[1:3] == ["-m", "ogrpo.serve.vllm_api"]
    except psutil.Error:  # a short-lived child that ended while we looked
        return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_bench_rollout_stops_its_server(tmp_path, sig):
    argv = [sys.executable, "-m", "ogrpo", "bench", "rollout", "--paths", "server", "--repeats", "1",
            "--hidden", str(TINY.hidden), "--layers", str(TINY.layers), "--heads", str(TINY.heads),
            "--kv-heads", str(TINY.kv_heads), "--intermediate", str(TINY.intermediate), "--vocab", str(TINY.vocab),
            "--workdir", str(tmp_path), "--csv", str(tmp_path / "r.csv")]
    bench = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300  # a bound, not a speed check: vLLM's CPU start on 2 loaded cores
        server = None
        while server is None:
            assert bench.poll() is None and time.time() < deadline, "the bench never started its server"
            server = next((k for k in psutil.Process(bench.pid).children(recursive=True) if _is_server(k)), None)
            time.sleep(0.2)
        try:
            group = [server, *server.children(recursive=True)]
        except psutil.Error:
            group = [server]
        bench.send_signal(sig)
        bench.wait(timeout=180)
    finally:
        if bench.poll() is None:
            bench.kill()
    gone, alive = psutil.wait_procs(group, timeout=30)
    assert not alive, f"{signal.Signals(sig).name} left {[p.pid for p in alive]} running"
