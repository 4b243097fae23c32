"""A two-node job on the test cluster: `ogrpo submit --gpus 2x1xcpu --partition two` puts the vLLM server on one
node and the trainer on the other, the trainer pushes its weights across the link, and a requeue resumes it.

The cluster's second node (tests/slurm/cluster.sh) is a slurmd in its own network namespace, with its own
address on a veth pair and its own /dev/shm, so server and trainer share no loopback and no shared memory: the
trainer must reach the server at its node's NodeAddr and send the weights over TCP (the cpu_shm backend's
HTTP variant). What proves each part:
- placement: sacct's NodeList per step, and the addresses each step was given (NodeAddr of its node);
- weights pushed: the trainer says it pushes over HTTP, the server logs /update_weights from the trainer's
  node, and TRL's sampling_logp_difference stays ~1e-7 every step (without pushes it is ~0.3 from step 2:
  measured on this CPU);
- requeue: `scontrol requeue` mid-run, then the second attempt resumes from a checkpoint and the job
  completes with every step logged once. Same metrics as uninterrupted are not asserted: the restarted vLLM
  server's sampler starts afresh (see test_slurm_grpo).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from .conftest import ogrpo, read_json, sacct_state, wait_for, wait_gone

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.integration]  # a vLLM server, started twice

STEPS = 10
TINY = f"""model_name_or_path: ogrpo:tiny
dataset_name: ogrpo:tiny
reward_funcs: [tiny_letter]
seed: 42
learning_rate: 1.0e-3
lr_scheduler_type: constant
num_generations: 8
per_device_train_batch_size: 32
max_completion_length: 12
max_steps: {STEPS}
logging_steps: 1
save_steps: 2
save_total_limit: 2
report_to: none
ogrpo:
  use_vllm: true
  max_prompt_length: 64
"""


@pytest.fixture(scope="module")
def two_nodes(slurm_cluster):
    out = subprocess.run(["sinfo", "-h", "-p", "two", "-N", "-o", "%N %T"], capture_output=True, text=True)
    nodes = dict(line.split() for line in out.stdout.splitlines())
    if len(nodes) < 2:
        pytest.skip("no partition `two` with two nodes: cluster.sh brings up node2 only as root with `ip netns`")
    return sorted(nodes)


def node_addr(node: str) -> str:
    out = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True, check=True).stdout
    return re.search(r"NodeAddr=(\S+)", out).group(1)


def step_nodes(job: str) -> dict[str, set[str]]:
    """step name → nodes it ran on, over every attempt (sacct -D: the requeued attempt's steps too)."""
    out = subprocess.run(["sacct", "-n", "-P", "-D", "-j", job, "-o", "JobName,NodeList"], capture_output=True,
                         text=True, check=True).stdout
    where: dict[str, set[str]] = {}
    for line in out.splitlines():
        name, nodes = line.split("|")
        where.setdefault(name, set()).add(nodes)
    return where


def logged_steps(run: Path) -> list[dict]:
    try:
        return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    except (OSError, ValueError):
        return []


def test_server_and_trainer_on_two_nodes_push_weights_and_resume(two_nodes, tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    job_dir, run = tmp_path / "job", tmp_path / "job" / "run"
    out = ogrpo("submit", "--config", str(cfg), "--gpus", "2x1xcpu", "--partition", "two", "--time", "15",
                "-o", str(job_dir), check=True).stdout
    assert "server: nodes [0]" in out and "trainer: nodes [1]" in out, out
    job = out.splitlines()[0].split()[-1]

    wait_for(lambda: len(logged_steps(run)) >= 3, 420, "step 3")
    subprocess.run(["scontrol", "requeue", job], check=True)
    wait_gone(job, 600)
    log = (job_dir / "logs" / f"slurm-{job}.out").read_text()
    assert sacct_state(job) == "COMPLETED", log[-3000:]

    # placement: the server on one node, the trainer on the other, each addressed by its node's NodeAddr
    where = step_nodes(job)
    assert len(where["server"]) == 1 and len(where["trainer"]) == 1, where
    server_node, trainer_node = where["server"].pop(), where["trainer"].pop()
    assert {server_node, trainer_node} == set(two_nodes)
    server_addr, trainer_addr = node_addr(server_node), node_addr(trainer_node)
    assert server_addr != trainer_addr
    trainer_argv = read_json(run / "roles" / "trainer.json")["argv"]
    server_argv = read_json(run / "roles" / "server.json")["argv"]
    assert server_argv[server_argv.index("--host") + 1] == server_addr
    url = trainer_argv[trainer_argv.index("--vllm-url") + 1]
    assert url.startswith(f"http://{server_addr}:"), url

    # weights crossed the link: over HTTP from the trainer's node, loaded by the server, every step
    trainer_log = (run / "logs" / "trainer.log").read_text()
    assert f"weight push to {url}: over HTTP from http://{trainer_addr}:" in trainer_log
    server_log = (run / "logs" / "server.log").read_text()
    pushes = re.findall(rf"{re.escape(trainer_addr)}:\d+ - \"\S*POST /update_weights HTTP/1.1\S*\" \S*200", server_log)
    assert pushes, server_log[-3000:]
    rows = logged_steps(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step once, across the requeue
    gaps = [r["sampling/sampling_logp_difference/mean"] for r in rows]
    assert max(gaps) < 1e-4, gaps

    # the requeue: a second attempt that resumed from a checkpoint
    assert read_json(job_dir / "slurm" / "attempt-1.json")["restart_count"] == 1
    manifest = read_json(run / "manifest.json")
    assert manifest.get("resumed_from")
    # a separate server: the plan's default overlap, lossless, across the two nodes and the requeue
    assert manifest["overlap"]["mode"] == "lossless", manifest.get("overlap")
    # ... streamed group by group from the other node: each step's rewards were computed on the groups as they came
    stream = next(s for s in manifest["plan"]["settings"] if s["name"] == "overlap.stream")
    assert stream["value"] == "groups", stream
    assert all(r["overlap/streamed_rewards"] == 1.0 for r in rows), rows
