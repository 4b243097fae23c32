"""ogrpo.trainer.preemption with a real transformers Trainer (a 5-parameter model, CPU, seconds): a signal
mid-run saves at the end of the step and stops with EXIT_PREEMPTED; resuming gives the same weights as an
uninterrupted run; a kill during a save leaves the previous checkpoint as the one to resume from."""

from __future__ import annotations

import json
import os
import signal

import pytest

# torch and transformers are part of the test environment (.venv, the train extra): a failure if missing.
import torch  # noqa: E402
import transformers  # noqa: E402

from ogrpo.trainer import preemption  # noqa: E402
from ogrpo.trainer.checkpoints import AtomicCheckpoints  # noqa: E402

MAX_STEPS = 12


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, labels=None):
        out = self.lin(x).squeeze(-1)
        return {"loss": ((out - labels) ** 2).mean(), "logits": out}


def data():
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(64, 4, generator=g)
    ys = xs @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1
    return [{"x": x, "labels": y} for x, y in zip(xs, ys)]


class AtomicTrainer(AtomicCheckpoints, transformers.Trainer):
    """transformers' Trainer with OgrpoGRPOTrainer's checkpoint layer: preemption's saves are the same there."""


def make_trainer(out_dir, callbacks=()):
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=4, max_steps=MAX_STEPS, save_strategy="steps",
        save_steps=4, logging_steps=1, report_to=[], seed=0, use_cpu=True, learning_rate=0.05,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    transformers.set_seed(0)
    trainer = AtomicTrainer(model=Tiny(), args=args, train_dataset=data(), callbacks=list(callbacks))
    cb = preemption.install(trainer)
    return trainer, cb


class SignalAt(transformers.TrainerCallback):
    """Deliver a real signal to this process in the middle of step `step` (as Slurm would); `while_logging`:
    after that step ended, while it is logged, before its periodic save if it has one."""

    def __init__(self, step, sig, while_logging=False):
        self.step, self.sig, self.while_logging = step, sig, while_logging

    def _deliver(self, state, logging):
        if state.global_step == self.step and logging == self.while_logging:
            os.kill(os.getpid(), self.sig)

    def on_step_begin(self, args, state, control, **kw):
        self._deliver(state, False)

    def on_log(self, args, state, control, **kw):
        self._deliver(state, True)


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    trainer, cb = make_trainer(tmp_path_factory.mktemp("ref"))
    trainer.train()
    assert not cb.preempted
    return weights(trainer), trainer.state.log_history[-2]["loss"]


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTERM])
def test_signal_saves_stops_and_resume_matches(tmp_path, reference, sig):
    trainer, cb = make_trainer(tmp_path, [SignalAt(5, sig)])
    trainer.train()
    # the signal came during step 6 (global_step 5 → 6): saved at its end, and stopped there
    assert cb.preempted and trainer.state.global_step == 6 and cb.saved_step == 6
    assert [p.name for p in preemption.complete_checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-6"]
    marker = json.loads((tmp_path / preemption.MARKER).read_text())
    assert marker["signal"] == signal.Signals(sig).name and marker["checkpoint"] == "checkpoint-6"
    with pytest.raises(SystemExit) as exc:
        preemption.exit_if_preempted(cb)
    assert exc.value.code == preemption.EXIT_PREEMPTED
    assert signal.getsignal(sig) is not cb._on_signal  # handlers restored after training

    resumed, cb2 = make_trainer(tmp_path)
    resumed.train(resume_from_checkpoint=preemption.resume_checkpoint(tmp_path))
    assert resumed.state.global_step == MAX_STEPS and not cb2.preempted
    ref_weights, ref_loss = reference
    for k, v in weights(resumed).items():
        torch.testing.assert_close(v, ref_weights[k], rtol=0, atol=1e-6)
    assert resumed.state.log_history[-2]["loss"] == pytest.approx(ref_loss, abs=1e-6)


@pytest.mark.parametrize(("step", "saved"), [(4, 4), (5, 6)])
def test_a_signal_after_the_step_end_stops_after_the_save_that_holds_every_step(tmp_path, reference, step, saved):
    """The step had ended when the signal came. At a periodic save (step 4 of save_steps 4) that save holds every
    finished step: stop after it rather than train and save one more step. Otherwise (step 5) the next step's end
    saves, as for a signal mid-step."""
    trainer, cb = make_trainer(tmp_path, [SignalAt(step, signal.SIGUSR2, while_logging=True)])
    trainer.train()
    assert cb.preempted and trainer.state.global_step == saved and cb.saved_step == saved
    assert [p.name for p in preemption.complete_checkpoints(tmp_path)][-1] == f"checkpoint-{saved}"
    assert json.loads((tmp_path / preemption.MARKER).read_text())["checkpoint"] == f"checkpoint-{saved}"
    resumed, cb2 = make_trainer(tmp_path)
    resumed.train(resume_from_checkpoint=preemption.resume_checkpoint(tmp_path))
    assert resumed.state.global_step == MAX_STEPS and not cb2.preempted
    for k, v in weights(resumed).items():
        torch.testing.assert_close(v, reference[0][k], rtol=0, atol=1e-6)


def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer, _ = make_trainer(tmp_path)
    original = trainer._save_rng_state

    def dies_at_step_8(output_dir):
        if trainer.state.global_step == 8:
            raise KeyboardInterrupt("killed mid-save")  # model and optimizer written, RNG state not yet
        return original(output_dir)

    monkeypatch.setattr(trainer, "_save_rng_state", dies_at_step_8)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert (tmp_path / preemption.STAGING / "checkpoint-8" / "model.safetensors").exists()  # the half save
    assert not (tmp_path / "checkpoint-8").exists()
    ckpt4 = tmp_path / "checkpoint-4"
    assert {"trainer_state.json", "optimizer.pt", "rng_state.pth"} <= {p.name for p in ckpt4.iterdir()}
    assert preemption.resume_checkpoint(tmp_path) == str(ckpt4)
    assert not (tmp_path / preemption.STAGING).exists()  # leftovers dropped before resuming


def test_checkpoint_rotation_still_applies(tmp_path):
    trainer, _ = make_trainer(tmp_path)
    trainer.args.save_total_limit = 1
    trainer.train()
    assert [p.name for p in preemption.complete_checkpoints(tmp_path)] == [f"checkpoint-{MAX_STEPS}"]


@pytest.mark.parametrize("marker", ["fresh", "stale"])
def test_a_cancel_stops_at_once_without_a_checkpoint(tmp_path, monkeypatch, marker):
    """`ogrpo cancel` marks the run before its SIGTERM: the trainer stops mid-step, saves nothing and records
    `cancelled`. A marker older than the process (an earlier run in the directory) is no cancel: the SIGTERM is
    then handled as a preemption."""
    from ogrpo.launch import stopping

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    (tmp_path / "manifest.json").write_text(json.dumps({"status": "running"}))
    stopping.request_cancel(tmp_path)
    if marker == "stale":
        path = stopping.marker_path(tmp_path)
        path.write_text(json.dumps({**json.loads(path.read_text()), "time": 0}))

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(preemption, "_exit", exit_now)
    trainer, cb = make_trainer(tmp_path, [SignalAt(5, signal.SIGTERM)])
    manifest = tmp_path / "manifest.json"
    if marker == "stale":
        trainer.train()
        assert cb.preempted and cb.saved_step == 6
        assert json.loads(manifest.read_text())["status"] == "preempted"
        return
    with pytest.raises(SystemExit) as exc:
        trainer.train()
    assert exc.value.code == 128 + signal.SIGTERM
    assert [p.name for p in preemption.complete_checkpoints(tmp_path)] == ["checkpoint-4"]  # nothing new saved
    assert not (tmp_path / preemption.MARKER).exists()  # no "preempted" marker: nothing is to be requeued
    data = json.loads(manifest.read_text())
    assert data["status"] == "cancelled" and data["stop_reason"].startswith("cancelled")


def test_sigterm_reasons_as_slurm_reports_them():
    """`scontrol show job -o` while the SIGTERM is delivered, as recorded on the test cluster (Slurm 22.05), for
    an attempt that started as restart 0."""
    from ogrpo.launch.slurm.parse import key_values
    from ogrpo.launch.stopping import CANCEL, REQUEUE, STEPS, TIMEOUT, classify

    seen = {
        "JobId=7 JobState=COMPLETING Reason=None Dependency=(null) Requeue=1 Restarts=0": CANCEL,  # scancel
        "JobId=8 JobState=COMPLETING Reason=None Requeue=1 Restarts=1": REQUEUE,  # scontrol requeue
        "JobId=9 JobState=COMPLETING Reason=TimeLimit Requeue=1 Restarts=0": TIMEOUT,
        "JobId=3 JobState=RUNNING Reason=None Requeue=1 Restarts=0": STEPS,  # scancel --signal=TERM
    }
    for text, reason in seen.items():
        assert classify(key_values(text), 0) == reason, text
    # the second attempt of a requeued job, cancelled: its own restart count is the baseline
    assert classify(key_values("JobState=COMPLETING Reason=None Restarts=1"), 1) == CANCEL


def test_a_second_sigterm_inside_the_handler_is_absorbed_and_nothing_is_imported_there(tmp_path, monkeypatch):
    """torch elastic's agent sends its own SIGTERM right after Slurm's: it can land while the first handler runs
    (here, deterministically, from inside the controller query). It must neither re-enter the handler nor import
    anything there (a module half-imported by the first handler raised AttributeError: manifest `failed`)."""
    import builtins

    from ogrpo.launch import stopping

    cb = preemption.PreemptionCallback(tmp_path)
    asked, imported, watching = [], [], [True]
    real_import = builtins.__import__

    def watched_import(name, *args, **kwargs):
        if watching[0]:
            imported.append(name)
        return real_import(name, *args, **kwargs)

    def reason(run_dir, since):
        asked.append(run_dir)
        if len(asked) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the second TERM, delivered inside the first handler
            for _ in range(1000):  # Python runs the pending handler at the next bytecodes of this thread
                pass
        return stopping.STEPS

    monkeypatch.setattr(stopping, "sigterm_reason", reason)
    monkeypatch.setattr(builtins, "__import__", watched_import)
    cb.install_handlers()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
            pass
        watching[0] = False
    finally:
        cb.restore_handlers()
        from ogrpo.serve import deadline

        deadline.stopping.clear()  # the process-wide flag the handler set: no other test may inherit it
    assert len(asked) == 1  # decided once, for both signals
    assert cb.signal_name == "SIGTERM" and cb.reason == stopping.STEPS and cb.then() == " for requeue"
    assert imported == []


@pytest.mark.parametrize("reason", ["steps", "cancel"])
def test_a_sigterm_after_the_warning_still_decides(tmp_path, monkeypatch, reason):
    """The supervisor forwards the time-limit warning (SIGUSR2) to a trainer that Slurm's SIGTERM reaches too, in
    either order (seen on the test cluster: USR2 first, then the TERM that took the server). The TERM must still
    decide: a cancel stops at once; otherwise the process is stopping, so a step whose server went away leaves
    for requeue with the last checkpoint instead of failing the run (the TERM used to be ignored after USR2)."""
    from ogrpo.launch import stopping
    from ogrpo.serve import deadline

    exits = []
    monkeypatch.setattr(stopping, "sigterm_reason", lambda run_dir, since: getattr(stopping, reason.upper()))
    monkeypatch.setattr(preemption, "_exit", exits.append)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    deadline.stopping.clear()
    cb = preemption.PreemptionCallback(tmp_path)
    cb.install_handlers()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert cb.signal_name == "SIGUSR2" and not deadline.stopping.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        if reason == "cancel":
            assert exits == [128 + signal.SIGTERM]
        else:
            assert exits == [] and deadline.stopping.is_set()
            assert cb.signal_name == "SIGTERM" and cb.then() == " for requeue"
    finally:
        cb.restore_handlers()
        deadline.stopping.clear()


def test_a_resume_from_the_last_checkpoint_trains_nothing(tmp_path):
    """A requeue that lands after the last save: the Trainer would run step MAX_STEPS + 1 and save it (a 30-step
    run with a checkpoint-31); `finished_step` tells ogrpo.trainer.assembly to train nothing."""
    trainer, _ = make_trainer(tmp_path)
    trainer.train()
    last = preemption.resume_checkpoint(tmp_path)
    assert last.endswith(f"checkpoint-{MAX_STEPS}")
    assert preemption.finished_step(last, MAX_STEPS) == MAX_STEPS
    assert preemption.finished_step(last, MAX_STEPS + 4) is None  # a longer run resumes from it
    assert preemption.finished_step(last, -1) == MAX_STEPS  # counted in epochs: the checkpoint's own bound
    assert preemption.finished_step(str(tmp_path / "checkpoint-4"), MAX_STEPS) is None
    assert preemption.finished_step(None, MAX_STEPS) is None
    # why the check is needed: left to itself, the Trainer trains past max_steps
    again, _ = make_trainer(tmp_path)
    again.train(resume_from_checkpoint=last)
    assert again.state.global_step == MAX_STEPS + 1


class ServerGoneAt(transformers.TrainerCallback):
    """The job's SIGTERM reaches the trainer in step `step`, and the server, which got it too, is gone: the
    step's next request fails (what ogrpo.serve.deadline raises)."""

    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)
            from ogrpo.serve import deadline

            raise deadline.ServerGone("POST /v1/completions: the job is stopping and the server no longer answers")


def test_a_step_that_loses_its_server_to_the_sigterm_exits_for_requeue_with_the_last_checkpoint(tmp_path,
                                                                                                 monkeypatch):
    """`scancel --signal=TERM` or a preemption with a server: the step in flight cannot finish. The run is not
    `failed`: the trainer exits with EXIT_PREEMPTED, its marker naming the last complete checkpoint (what the
    supervisor requeues on); a failure without that SIGTERM is still a failure."""
    from ogrpo.serve import deadline

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    (tmp_path / "manifest.json").write_text(json.dumps({"status": "running"}))
    trainer, cb = make_trainer(tmp_path, [ServerGoneAt(5)])
    try:
        with pytest.raises(deadline.ServerGone) as failed:
            trainer.train()
        assert deadline.stopping.is_set()  # the handler marked the process as stopping
        with pytest.raises(SystemExit) as exc:
            preemption.leave_after_failed_step(cb, failed.value)
    finally:
        cb.restore_handlers()
        deadline.stopping.clear()
    assert exc.value.code == preemption.EXIT_PREEMPTED
    marker = json.loads((tmp_path / preemption.MARKER).read_text())
    assert marker["checkpoint"] == "checkpoint-4" and marker["left_mid_step"] and marker["signal"] == "SIGTERM"
    assert json.loads((tmp_path / "manifest.json").read_text())["status"] == "preempted"
    # no SIGTERM: the same error fails the run (the caller raises it)
    other, cb2 = make_trainer(tmp_path / "plain")
    assert preemption.leave_after_failed_step(cb2, RuntimeError("boom")) is None
