"""Preemption and time limits: save a checkpoint on the signal, exit, and resume from the last complete one.

Slurm warns a job before its time limit (`--signal=USR2@N`, forwarded to the trainer step by the supervisor)
and sends SIGTERM on preemption, `scontrol requeue`, the time limit and `scancel`. A signal can arrive mid-step,
when the model and the optimizer are half updated, so the handler only raises a flag; the callback saves at the
end of the current step and stops training. The trainer then exits with EXIT_PREEMPTED and the job is requeued.

A cancel is the exception: a SIGTERM that `ogrpo cancel` or `scancel` sent (ogrpo.launch.stopping tells them
apart) stops the trainer at once, without a checkpoint (nothing resumes a cancelled job; its last periodic
checkpoint stays on disk), and records `cancelled` in the run's manifest.

SIGTERM comes with a deadline: SIGKILL follows after the cluster's KillWait (+ GraceTime on a preemption;
ogrpo.launch.slurm.grace). When the running step cannot finish and be saved before it, and the last finished step is
already checkpointed (the plan then checkpoints every step), the trainer exits at once instead (marker written,
EXIT_PREEMPTED): waiting could save nothing the disk does not already hold. It never saves mid-step: the state in
memory then is one the uninterrupted run never has (RNG advanced, the optimizer maybe half-stepped), and the
save's collectives would meet ranks that are inside the step's.

Checkpoints are atomic: the Trainer writes `checkpoint-N` into `<output_dir>/.staging/`, and only when every
file (model, optimizer, scheduler, RNG states of every rank, trainer_state.json) is there is the directory
renamed into place. A kill during a save leaves a half-written staging dir, never a half-written
`checkpoint-N`, so `--resume auto` always finds a complete one.

Use (training entry point):
    cb = preemption.install(trainer)          # before trainer.train()
    trainer.train(resume_from_checkpoint=preemption.resume_checkpoint(output_dir))
    preemption.exit_if_preempted(cb)           # before writing final artifacts
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

# Imported here, never inside the signal handler: a second SIGTERM (torch elastic's agent sends its own after
# Slurm's) that lands while the first handler is importing a module finds it half-initialized
# ("partially initialized module 'ogrpo.launch.stopping'").
from ogrpo.launch import run_state, stopping
from ogrpo.launch.slurm import grace
from ogrpo.launch.local.state import process_start
from ogrpo.serve import deadline

# EX_TEMPFAIL: "try again later" — the supervisor requeues the job when the trainer exits with it.
EXIT_PREEMPTED = 75
STAGING = ".staging"
MARKER = "preempted.json"
# SIGTERM → SIGKILL seconds, when not asked from the cluster (tests; sites whose compute nodes cannot run scontrol)
WINDOW_ENV = "OGRPO_SIGTERM_WINDOW_S"
_exit = os._exit  # the leave-now path (a test replaces it)


def sigterm_window_s() -> float | None:
    """Seconds between SIGTERM and SIGKILL for this process: OGRPO_SIGTERM_WINDOW_S, else (inside a Slurm job)
    the cluster's KillWait/GraceTime; None when unknown (then the trainer always waits for the step end)."""
    if os.environ.get(WINDOW_ENV):
        return float(os.environ[WINDOW_ENV])
    if not os.environ.get("SLURM_JOB_ID"):
        return None
    found = grace.query(os.environ.get("SLURM_JOB_PARTITION"))
    return float(found.window_s) if found else None


def _write_marker(output_dir: Path, signal_name: str | None, global_step: int, checkpoint: str | None,
                  **extra) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = output_dir / (MARKER + ".tmp")
    tmp.write_text(json.dumps({"signal": signal_name, "global_step": global_step, "checkpoint": checkpoint,
                               "time": time.time(),
                               "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", 0) or 0), **extra})
                   + "\n")
    os.replace(tmp, output_dir / MARKER)


def _checkpoint_step(path: Path) -> int | None:
    name = path.name
    if not name.startswith("checkpoint-"):
        return None
    tail = name.split("-", 1)[1]
    return int(tail) if tail.isdigit() else None


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """checkpoint-N dirs with a trainer_state.json, oldest first (staging dirs are never listed)."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(s, p) for p in out.iterdir() if p.is_dir() and (s := _checkpoint_step(p)) is not None
             and (p / "trainer_state.json").exists()]
    return [p for _, p in sorted(found)]


def resume_checkpoint(output_dir: str | Path) -> str | None:
    """The last complete checkpoint (for `--resume auto`), or None to start fresh. Drops leftover staging."""
    staging = Path(output_dir) / STAGING
    if staging.exists() and _is_main_process():
        shutil.rmtree(staging, ignore_errors=True)
    ckpts = complete_checkpoints(output_dir)
    return str(ckpts[-1]) if ckpts else None


def finished_step(checkpoint: str | Path | None, max_steps: int) -> int | None:
    """The checkpoint's step when it already holds the run's last step (`max_steps`; the checkpoint's own
    max_steps when training is counted in epochs), else None. The Trainer resumed from such a checkpoint runs one
    more step past max_steps (its loop checks the bound only after a step): a requeue that lands after the last
    save must train nothing."""
    if checkpoint is None:
        return None
    try:
        state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return None
    step = int(state.get("global_step") or 0)
    bound = int(max_steps) if max_steps and int(max_steps) > 0 else int(state.get("max_steps") or 0)
    return step if bound > 0 and step >= bound else None


def _is_main_process() -> bool:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0) == 0


def _fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_checkpoints_atomic(trainer) -> None:
    """Route the Trainer's `_save_checkpoint` through a staging dir and rename the finished checkpoint (the
    trainer's AtomicCheckpoints layer, ogrpo/trainer/checkpoints.py)."""
    trainer.stage_checkpoints(STAGING, _publish)


def _publish(src: Path, run_dir: Path) -> None:
    """Rank 0, every rank's files written: the staged checkpoint, synced, renamed into the run dir."""
    dst = run_dir / src.name
    _fsync_tree(src)
    if dst.exists():  # same step saved twice (e.g. the signal arrived on a save_steps boundary)
        old = run_dir / f".old-{src.name}-{time.time_ns()}"
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
    _fsync_dir(run_dir)


def _trainer_callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class PreemptionCallback(_trainer_callback_base()):
    """Flag on SIGUSR2/SIGTERM; at the end of the step: save a checkpoint and stop training. A signal that lands
    after a step ended and before its save finished stops after that save."""

    SIGNALS = (signal.SIGUSR2, signal.SIGTERM)

    def __init__(self, output_dir: str | Path, trainer=None):
        self.output_dir = Path(output_dir)
        self.trainer = trainer  # for the cross-rank agreement; None in a single process
        self.signal_name: str | None = None
        self.reason: str | None = None  # why SIGTERM came (ogrpo.launch.stopping); None for USR2
        # a cancel marker older than this process belongs to an earlier run in the same directory
        self.started = process_start(os.getpid()) or time.time()
        self.saved_step: int | None = None
        self._previous: dict[int, object] = {}
        # held while a handler runs: a signal that lands inside it (Python runs handlers between any two
        # bytecodes of the main thread, the handler's own included) returns at once instead of re-entering
        self._handling = threading.Lock()
        # for the SIGTERM deadline: measured step and save times, and whether the last finished step is on disk
        self.window_s = sigterm_window_s()
        self.step = 0  # finished steps (state.global_step at the running step's start)
        self.last_saved = -1  # the step of the newest checkpoint this run has on disk
        self._step_began: float | None = None
        self._step_ended: float | None = None
        self._step_times: list[float] = []
        self._save_s: float | None = None

    # -- signals
    def install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers (and Python runs them there)
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore_handlers(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        # A SIGTERM after the time-limit warning still decides: it may be a cancel (stop now) or the preemption
        # that takes the server too (a step that cannot finish then leaves for requeue). The supervisor forwards
        # the warning to a trainer that Slurm's SIGTERM reaches too, and the two arrive in either order.
        later_term = signum == signal.SIGTERM and self.signal_name not in (None, "SIGTERM")
        if (self.signal_name is not None and not later_term) or not self._handling.acquire(blocking=False):
            return  # already decided, or deciding: the first signal's handler answers for this one too
        try:
            self._decide(signum)
        finally:
            self._handling.release()

    def _decide(self, signum) -> None:
        if signum == signal.SIGTERM:
            self.reason = stopping.sigterm_reason(self.output_dir, self.started)
            if self.reason == stopping.CANCEL:
                self._cancel_now()
                return
            # the job is stopping: a server of the job got the same SIGTERM, so a request to it that is left
            # unanswered fails fast (ogrpo.serve.deadline), and a lossless push at this step's end is skipped
            deadline.stopping.set()
            if self._leave_now():
                return
        self.signal_name = signal.Signals(signum).name
        print(f"[ogrpo] {self.signal_name}{self.why()}: checkpoint at the end of this step, then exit"
              f"{self.then()}", file=sys.stderr, flush=True)

    def why(self) -> str:
        """What the signal meant, for the log: ` (Slurm is requeueing the job)`, or nothing when unknown."""
        if self.signal_name == "SIGUSR2":
            return " (time-limit or preemption warning)"
        if self.reason in (None, stopping.UNKNOWN):
            return ""
        return f" ({stopping.DESCRIBE[self.reason]})"

    def then(self) -> str:
        """What follows the exit: a requeue only where one comes (USR2, Slurm's requeue, the supervisor's)."""
        if self.signal_name == "SIGUSR2" or self.reason in (stopping.REQUEUE, stopping.STEPS):
            return " for requeue"
        return "; --resume auto continues from it"

    def _cancel_now(self) -> None:
        """The job was cancelled: stop now. Waiting for the step end and saving would only delay the stop the
        user asked for (and Slurm's SIGKILL); the last periodic checkpoint stays for a resubmission."""
        self.signal_name = "SIGTERM"
        last = complete_checkpoints(self.output_dir)
        kept = f"the last checkpoint is {last[-1].name}" if last else "no checkpoint was saved"
        print(f"[ogrpo] SIGTERM: the job was cancelled; stopping now without a checkpoint ({kept})",
              file=sys.stderr, flush=True)
        if _is_main_process():
            run_state.record_status(self.output_dir, "cancelled", f"cancelled during step {self.step + 1}")
        sys.stdout.flush()
        _exit(128 + signal.SIGTERM)

    @property
    def preempted(self) -> bool:
        return self.signal_name is not None

    def step_estimate_s(self) -> float | None:
        recent = sorted(self._step_times[-5:])
        return recent[len(recent) // 2] if recent else None

    def _leave_now(self) -> bool:
        """SIGTERM: exit at once (ogrpo.launch.slurm.grace.leave_now) when waiting for the step end cannot save more."""
        if self._step_began is None or (self._step_ended is not None and self._step_ended >= self._step_began):
            return False  # between steps: a save may be running, and it may still make it
        elapsed = time.monotonic() - self._step_began
        if not grace.leave_now(elapsed_s=elapsed, step_s=self.step_estimate_s(), save_s=self._save_s or grace.SAVE_FIXED_S,
                         window_s=self.window_s, last_step_saved=self.last_saved == self.step):
            return False
        self.signal_name = "SIGTERM"
        print(f"[ogrpo] SIGTERM with SIGKILL due in {self.window_s:g} s: step {self.step + 1} cannot finish and be "
              f"saved by then; exiting now, checkpoint-{self.step} holds every finished step", file=sys.stderr,
              flush=True)
        if _is_main_process():
            _write_marker(self.output_dir, "SIGTERM", self.step, f"checkpoint-{self.step}", left_mid_step=True)
        sys.stdout.flush()
        _exit(EXIT_PREEMPTED)
        return True

    # -- TrainerCallback events
    def on_train_begin(self, args, state, control, **kwargs):
        if not self._previous:
            self.install_handlers()
        self.step = state.global_step
        if state.global_step:  # resumed: the checkpoint it came from is on disk
            self.last_saved = state.global_step
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step
        self._step_began = time.monotonic()
        return control

    def _any_rank_preempted(self) -> bool:
        """Every rank must stop at the same step (the save has collectives), but the signal reaches the ranks
        at slightly different times: agree on it with one all-reduce per step."""
        acc = getattr(self.trainer, "accelerator", None)
        if acc is None or acc.num_processes <= 1:
            return self.preempted
        import torch

        flag = torch.tensor([1.0 if self.preempted else 0.0], device=acc.device)
        if acc.reduce(flag, reduction="sum").item() > 0 and not self.preempted:
            self.signal_name = "peer"
        return self.preempted

    def on_step_end(self, args, state, control, **kwargs):
        self._step_ended = time.monotonic()
        if self._step_began is not None:
            self._step_times.append(self._step_ended - self._step_began)
        if self._any_rank_preempted():
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        self.last_saved = self.step = state.global_step
        if self._step_ended is not None:
            self._save_s = time.monotonic() - self._step_ended  # the save and the step-end logging before it
        # A signal that landed after this step's end (while it was logged or saved) finds every finished step in
        # this checkpoint: stop here instead of training one more step to save it again. Agreed across ranks,
        # as at the step end: every rank saves this step, so every rank reaches this all-reduce.
        if self._any_rank_preempted():
            self.saved_step = state.global_step
            control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.preempted and state.is_world_process_zero:
            ckpt = f"checkpoint-{self.saved_step}" if self.saved_step else None
            _write_marker(self.output_dir, self.signal_name, state.global_step, ckpt, reason=self.reason)
            run_state.record_status(self.output_dir, "preempted", f"{self.signal_name}{self.why()}; saved {ckpt}")
        self.restore_handlers()
        return control


def install(trainer, output_dir: str | Path | None = None) -> PreemptionCallback:
    """Make the trainer's checkpoints atomic and add the preemption callback (signal handlers set now)."""
    make_checkpoints_atomic(trainer)
    cb = PreemptionCallback(output_dir or trainer.args.output_dir, trainer)
    cb.install_handlers()
    trainer.add_callback(cb)
    return cb


def leave_after_failed_step(cb: PreemptionCallback, exc: BaseException) -> None:
    """The running step failed after a SIGTERM that is not a cancel: the job is stopping and its server went away
    with the same signal (a preemption, `scancel --signal=TERM`), so the step could not finish. Its state is
    half-updated and never saved; the last complete checkpoint holds every step before it: exit for requeue
    (EXIT_PREEMPTED, marker written) instead of failing the run. Returns (to let the caller raise) otherwise."""
    if cb.signal_name != "SIGTERM" or not deadline.stopping.is_set():
        return
    last = complete_checkpoints(cb.output_dir)
    ckpt = last[-1].name if last else None
    why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    print(f"[ogrpo] SIGTERM{cb.why()}: step {cb.step + 1} could not finish ({why}); exiting with "
          f"{ckpt or 'no checkpoint'}{cb.then()}", file=sys.stderr, flush=True)
    if _is_main_process():
        _write_marker(cb.output_dir, "SIGTERM", cb.step, ckpt, reason=cb.reason, left_mid_step=True)
        run_state.record_status(cb.output_dir, "preempted", f"SIGTERM{cb.why()}; step {cb.step + 1} lost; kept {ckpt}")
    sys.exit(EXIT_PREEMPTED)


def exit_if_preempted(cb: PreemptionCallback) -> None:
    """After trainer.train(): leave with EXIT_PREEMPTED so the job requeues instead of finishing."""
    if cb.preempted:
        print(f"[ogrpo] stopped on {cb.signal_name}{cb.why()}; saved checkpoint-{cb.saved_step}; exiting"
              f"{cb.then()}", file=sys.stderr, flush=True)
        sys.exit(EXIT_PREEMPTED)
