"""SIGTERM while the job runs on, on the test cluster, with a real vLLM server in every overlap mode and without
a server. One job per placement/mode, signalled twice:

- attempt 0: `scancel --signal=TERM JOB` (what a preemption sends every step before KillWait; here nobody
  SIGKILLs): the server exits (vLLM exits 0 on SIGTERM), which is the job's stop, not a failure; the trainer
  saves what it can (the step, or its last complete checkpoint when the step needed the server) and the job
  requeues. Before: "server exited mid-run", the trainer killed before it saved, FAILED.
- attempt 1: `scancel -b --signal=TERM JOB` (the batch step only): the supervisor has the trainer save the step
  it is in, as on the time-limit warning (the server keeps answering), and the job requeues. Before: every step
  stopped at once, the step lost, no requeue.
- attempt 2 runs to max_steps: every step logged once, no step and no checkpoint past max_steps, the manifest
  `finished`, nothing of the job left.

The trainer step is held (SIGSTOP) while each signal is sent, so that it lands mid-run at any machine speed;
pausing computes nothing.

Beside each signalled job runs the same job uninterrupted: the resumed run must train on the same batches
(`batch_sha`, the profiler's digest of a step's prompts and completions) with the same losses, step by step. The
requests are seeded the way users run (the run's seed and the client's per-call counter, which a checkpoint
carries), not with a fixed `generation_kwargs.seed` that would hide a counter restarting at 0; the server runs one
sequence at a time without a prefix cache (tests/overlap_jobs.py), so a completion is a function of the prompt,
the seed and the weights only, across server restarts.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from .conftest import (processes_of_job, read_json, read_jsonl, render_job, sacct_state, venv_env, wait_for,
                       wait_gone)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]
STEPS = 8


def _rows(run: Path) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in _rows(run)]


def _trainer_step(job: str, run: Path, attempt: int) -> str:
    def record():
        try:
            rec = read_json(run / "roles" / "trainer.step.json")
        except (OSError, ValueError):
            return None
        return rec if rec.get("restart_count") == attempt else None

    return f"{job}.{wait_for(record, 600, f'the trainer step of attempt {attempt}')['slurm_step_id']}"


def checkpoint_step(checkpoint: str | Path) -> int:
    from ogrpo.trainer.rundir import checkpoint_step  # transformers: not at collection

    return checkpoint_step(checkpoint)


def _hold_and_signal(job: str, run: Path, attempt: int, after: int, scancel: list[str],
                     trainer_signal: signal.Signals) -> tuple[int, int]:
    """Once step `after` is logged in attempt `attempt`: hold the trainer, send `scancel` args, let it go on
    once `trainer_signal` (what they send the trainer) is pending in it.
    Returns (the last step logged, the last step checkpointed) when the signal was sent. With a checkpoint every
    step, the step the trainer is in is the one after its last checkpoint: it may have logged that step already
    (the Trainer logs a step, then saves it), so the logged step alone does not say which."""
    step = _trainer_step(job, run, attempt)
    # this attempt's steps: a resumed attempt moves the rows its checkpoint does not hold out of metrics.jsonl
    # (rewriting it) only once it has loaded; until then the file still shows the steps the attempt before logged
    # past its checkpoint. Written since this attempt's trainer started: rewound, or this attempt's rows.
    started = (run / "roles" / "trainer.step.json").stat().st_mtime

    def reached() -> bool:
        try:
            written = (run / "metrics.jsonl").stat().st_mtime >= started
        except OSError:
            return False
        return written and max(_steps(run), default=0) >= after

    wait_for(reached, 900, f"step {after} (attempt {attempt})")
    subprocess.run(["scancel", "--signal=STOP", step], check=True)
    logged = max(_steps(run))
    assert logged < STEPS, "the job ran to its end before the signal: nothing was tested"
    from ogrpo.trainer.preemption import complete_checkpoints  # transformers: not at collection

    ckpts = complete_checkpoints(run)  # renamed into place whole: a held trainer leaves none half-listed
    checkpointed = checkpoint_step(ckpts[-1]) if ckpts else 0
    try:
        subprocess.run(["scancel", *scancel, job], check=True)
        # the trainer runs on only once the signal waits for it: on a loaded machine the supervisor's USR2 can
        # take seconds to reach it, by which time a running trainer could be a step further
        wait_for(lambda: _pending_in_held_trainer(job, trainer_signal), 120,
                 f"{trainer_signal.name} to reach the trainer")
    finally:
        subprocess.run(["scancel", "--signal=CONT", step], check=False)
    return logged, checkpointed


def _pending_in_held_trainer(job: str, sig: signal.Signals) -> bool:
    """Every stopped process of the job that handles `sig` (the trainer's workers) has it pending."""
    bit = 1 << (sig - 1)
    held = []
    for pid in processes_of_job(job):
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        except (OSError, ValueError):
            continue
        if fields["State"].strip().startswith("T") and int(fields["SigCgt"], 16) & bit:
            held.append((int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)) & bit)
    return bool(held) and all(held)


def _sbatch(job_dir: Path) -> str:
    out = subprocess.run(["sbatch", "--parsable", str(job_dir / "job.sbatch")], env=venv_env(OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().split(";")[0]


# One job per mode, signalled twice, and its uninterrupted twin submitted beside it: every assertion below reads
# these two finished jobs. The modes with a server share the supervisor and client path (a server that exits on
# TERM, a bounded request) but not what a resume restores (one-step's batch in flight, lossless's requests sent
# again at the seed they took).
@pytest.fixture(scope="module", params=["off", "lossless", "one-step", "no-server"])
def termed_job(request, slurm_cluster, tmp_path_factory):
    """(mode, job id, job dir, {attempt: (last step logged, last step checkpointed) when signalled}, twin's job dir)
    of a finished, twice-signalled job and its finished uninterrupted twin."""
    mode = request.param
    tmp = tmp_path_factory.mktemp(f"term-{mode}")
    recipe = yaml.safe_load((REPO / "ogrpo" / "recipes" / "tiny.yaml").read_text())
    recipe.update({"max_steps": STEPS, "num_generations": 4, "per_device_train_batch_size": 8, "save_steps": 1,
                   "save_total_limit": 2})
    recipe["ogrpo"].update({"time": "30", "max_prompt_length": 64})
    gpus = "cpu"
    if mode != "no-server":
        gpus = "2xcpu"
        recipe["ogrpo"].update({"gpus": gpus, "use_vllm": True, "overlap": mode})
    job_dir, twin_dir = tmp / "job", tmp / "twin"
    for d in (job_dir, twin_dir):
        render_job(recipe, d, gpus, deterministic_server=mode != "no-server")
    twin = _sbatch(twin_dir)
    job = _sbatch(job_dir)
    run = job_dir / "run"
    try:
        signalled = {0: _hold_and_signal(job, run, 0, 2, ["--signal=TERM"], signal.SIGTERM)}
        wait_for(lambda: (job_dir / "slurm" / "requeue-0.json").exists(), 300, "the requeue after the TERM")
        resumed = checkpoint_step(read_json(job_dir / "slurm" / "requeue-0.json")["checkpoint"])
        signalled[1] = _hold_and_signal(job, run, 1, resumed + 1, ["-b", "--signal=TERM"],
                                         signal.SIGUSR2)
        wait_for(lambda: (job_dir / "slurm" / "requeue-1.json").exists(), 300, "the requeue after the batch TERM")
        wait_gone(job, 1200)
        wait_gone(twin, 1200)
    finally:
        subprocess.run(["scancel", job, twin], check=False)
    assert sacct_state(twin) == "COMPLETED", "".join(p.read_text()[-3000:] for p in (twin_dir / "logs").glob("*.out"))
    wait_for(lambda: not processes_of_job(twin), 30, f"processes of job {twin} to disappear")
    return mode, job, job_dir, signalled, twin_dir


def test_a_term_while_the_job_runs_on_saves_requeues_and_resumes(termed_job):
    mode, job, job_dir, signalled, _ = termed_job
    run = job_dir / "run"
    log = "".join(p.read_text() for p in sorted((job_dir / "logs").glob(f"slurm-{job}*.out")))
    assert sacct_state(job) == "COMPLETED", log[-4000:]
    assert "server exited" not in log and "mid-run" not in log and "job failed" not in log, log[-4000:]
    wait_for(lambda: not processes_of_job(job), 30, f"processes of job {job} to disappear")
    first, second = (read_json(job_dir / "slurm" / f"requeue-{i}.json") for i in (0, 1))
    assert first["requeued"] and second["requeued"] and first["signal"] == "SIGTERM"
    saved = [checkpoint_step(r["checkpoint"]) for r in (first, second)]
    (logged0, checkpointed0), (logged1, checkpointed1) = signalled[0], signalled[1]
    # the batch step's TERM: the trainer saved the step it was in (the one after its last checkpoint), the server
    # answering meanwhile, and lost no step it had logged. Held inside a save (its checkpoint already in place,
    # the save not yet ended), it stops after that save, which holds every step it logged. one-step: a step's
    # save waits for the batch in flight; held between logging a step and saving it, the trainer may train that
    # next batch and save its step
    assert max(checkpointed1, logged1) <= saved[1] <= checkpointed1 + 1 + (mode == "one-step"), (saved, signalled)
    assert saved[1] >= logged1, (saved, signalled)
    assert second["signal"] == "SIGUSR2", second
    if mode == "no-server":  # the steps' TERM: the same
        assert saved[0] == checkpointed0 + 1 and saved[0] >= logged0, (saved, signalled)
    else:
        # the steps' TERM took the server too: a step that still needed it is not saved; every step logged before
        # the signal is kept (one-step: its save waits for the batch in flight, which the server took with it,
        # so the one before)
        assert saved[0] >= logged0 - (mode == "one-step"), (saved, signalled)
    assert read_json(job_dir / "slurm" / "attempt-2.json")["restart_count"] == 2
    manifest = read_json(run / "manifest.json")
    assert manifest["status"] == "finished" and manifest["global_step"] == STEPS
    assert manifest["resumed_from"].endswith(f"checkpoint-{saved[1]}")
    if mode != "no-server":
        assert manifest["overlap"]["mode"] == mode if mode != "off" else "overlap" not in manifest
    assert _steps(run) == list(range(1, STEPS + 1))  # each step once across both requeues, none past max_steps
    assert max(int(p.name.rsplit("-", 1)[1]) for p in run.glob("checkpoint-*")) == STEPS


def test_the_resumed_job_trains_on_the_batches_of_its_uninterrupted_twin(termed_job):
    """Two requeues later, every step trained on the batch the uninterrupted run trained on, with its loss and
    reward: the resume restores the data order, the RNG, the client's seed counter and (one-step) the batch in
    flight, whatever the signal took with it."""
    mode, _, job_dir, signalled, twin_dir = termed_job
    got, want = (read_jsonl(d / "run" / "profile.jsonl") for d in (job_dir, twin_dir))
    assert [p["step"] for p in got] == [p["step"] for p in want] == list(range(1, STEPS + 1))
    assert len({p["batch_sha"] for p in want}) == STEPS  # a digest per step that tells the steps apart
    assert [p["batch_sha"] for p in got] == [p["batch_sha"] for p in want], (mode, signalled)
    if mode == "one-step":
        assert [p["staleness"] for p in got] == [p["staleness"] for p in want] == [0] + [1] * (STEPS - 1)
    rows, twin_rows = (_rows(d / "run") for d in (job_dir, twin_dir))
    for r, t in zip(rows, twin_rows, strict=True):
        assert r["loss"] == pytest.approx(t["loss"], rel=1e-4, abs=1e-5), (mode, r["step"])
        assert r["reward"] == pytest.approx(t["reward"], rel=1e-5, abs=1e-6), (mode, r["step"])
