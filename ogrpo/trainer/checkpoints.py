"""Atomic checkpoints: written aside and published whole (ogrpo.trainer.preemption: a kill during a save must never
leave a half-written `checkpoint-N` for `--resume auto` to pick). A layer of OgrpoGRPOTrainer.

The Trainer's `_save_checkpoint(model, trial)` builds every path it writes (model, optimizer, scheduler, RNG
states, trainer_state.json) and its checkpoint rotation from `self._get_output_dir(trial=trial)`: for the duration
of the Trainer's own save, `_get_output_dir` answers the staging directory, so the checkpoint lands there complete;
then every rank waits, rank 0 hands it to `publish` (the rename into place), and the rotation the Trainer ran in the
staging directory (one entry there: it deletes nothing) runs again in the real one through transformers'
`rotate_checkpoints`. ogrpo/trainer/overrides.py checks that the Trainer still builds its paths that way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable


class AtomicCheckpoints:
    """The trainer's checkpoint saves, staged (on once `stage_checkpoints` is called; ogrpo.trainer.preemption)."""

    _checkpoint_staging: tuple[str, Callable[[Path, Path], None]] | None = None
    _staged_dir: str | None = None  # while the Trainer's own save runs: where it writes

    def stage_checkpoints(self, staging: str, publish: Callable[[Path, Path], None]) -> None:
        """Route checkpoint saves through `<run dir>/<staging>/checkpoint-N`; rank 0 then calls
        `publish(staged checkpoint, run dir)`, which must move it to `<run dir>/checkpoint-N`."""
        self._checkpoint_staging = (staging, publish)

    def _get_output_dir(self, *args, **kwargs):
        return self._staged_dir if self._staged_dir is not None else super()._get_output_dir(*args, **kwargs)

    def _save_checkpoint(self, model, trial, *args, **kwargs):
        if self._checkpoint_staging is None:
            return super()._save_checkpoint(model, trial, *args, **kwargs)
        import shutil

        staging, publish = self._checkpoint_staging
        run_dir = Path(super()._get_output_dir(trial=trial))
        staged = run_dir / staging / f"checkpoint-{self.state.global_step}"
        if self.is_world_process_zero():
            shutil.rmtree(staged, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self._staged_dir = str(staged.parent)
        try:
            super()._save_checkpoint(model, trial, *args, **kwargs)
        finally:
            self._staged_dir = None
        self.accelerator.wait_for_everyone()  # every rank wrote its RNG state / shards
        if self.is_world_process_zero():
            publish(staged, run_dir)
            rotate(self, run_dir)
        self.accelerator.wait_for_everyone()


def rotate(trainer, run_dir: Path) -> None:
    """Apply save_total_limit in the real run dir (the Trainer's own pass looked at the staging dir)."""
    if not trainer.args.should_save or not trainer.args.save_total_limit:
        return
    from transformers.trainer_utils import rotate_checkpoints

    rotate_checkpoints(output_dir=str(run_dir), save_total_limit=trainer.args.save_total_limit,
                       best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=False)
