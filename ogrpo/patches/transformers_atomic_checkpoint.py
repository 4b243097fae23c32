"""transformers: a Trainer's checkpoints are written aside and published whole (ogrpo.train.preemption: a kill
during a save must never leave a half-written `checkpoint-N` for `--resume auto` to pick).

The Trainer's `_save_checkpoint(model, trial)` builds every path it writes (model, optimizer, scheduler, RNG
states, trainer_state.json) and its checkpoint rotation from `self._get_output_dir(trial=trial)`. `install`
replaces `_save_checkpoint` on the one trainer instance: for the duration of the Trainer's own save,
`_get_output_dir` answers the staging directory, so the checkpoint lands there complete; then every rank waits,
rank 0 hands it to `publish` (the rename into place), and the rotation the Trainer ran in the staging directory
(one entry there: it deletes nothing) runs again in the real one through transformers' `rotate_checkpoints`.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Callable

from ogrpo.patches.target import moved, problems_of

NAME = "transformers_atomic_checkpoint"
LIBRARY = "transformers"
TARGETS = {
    "transformers:Trainer._save_checkpoint": ("model", "trial"),
    "transformers:Trainer._get_output_dir": ("trial",),
    "transformers.trainer_utils:rotate_checkpoints": ("output_dir", "save_total_limit", "best_model_checkpoint",
                                                      "use_mtime"),
}
# what `_save_checkpoint` must still do for the staging redirect to hold every file it writes
_SAVE_NEEDS = "self._get_output_dir(trial=trial)"


def check() -> None:
    problems = problems_of(TARGETS)
    if not problems:
        from transformers import Trainer

        if _SAVE_NEEDS not in inspect.getsource(Trainer._save_checkpoint):
            problems.append(f"Trainer._save_checkpoint no longer builds its paths from `{_SAVE_NEEDS}`")
    if problems:
        raise moved(NAME, LIBRARY, problems)


def install(trainer, staging: str, publish: Callable[[Path, Path], None]) -> None:
    """Route `trainer`'s checkpoint saves through `<run dir>/<staging>/checkpoint-N`; rank 0 then calls
    `publish(staged checkpoint, run dir)`, which must move it to `<run dir>/checkpoint-N`. Idempotent."""
    if getattr(trainer, "_ogrpo_atomic", False):
        return
    check()
    import shutil

    original_save = trainer._save_checkpoint
    original_output_dir = trainer._get_output_dir

    def save(model, trial, *args, **kwargs):
        run_dir = Path(original_output_dir(trial=trial))
        staged = run_dir / staging / f"checkpoint-{trainer.state.global_step}"
        if trainer.is_world_process_zero():
            shutil.rmtree(staged, ignore_errors=True)
        trainer.accelerator.wait_for_everyone()
        trainer._get_output_dir = lambda trial=None: str(staged.parent)
        try:
            original_save(model, trial, *args, **kwargs)
        finally:
            del trainer._get_output_dir  # back to the class method
        trainer.accelerator.wait_for_everyone()  # every rank wrote its RNG state / shards
        if trainer.is_world_process_zero():
            publish(staged, run_dir)
            rotate(trainer, run_dir)
        trainer.accelerator.wait_for_everyone()

    trainer._save_checkpoint = save
    trainer._ogrpo_atomic = True


def rotate(trainer, run_dir: Path) -> None:
    """Apply save_total_limit in the real run dir (the Trainer's own pass looked at the staging dir)."""
    if not trainer.args.should_save or not trainer.args.save_total_limit:
        return
    from transformers.trainer_utils import rotate_checkpoints

    rotate_checkpoints(output_dir=str(run_dir), save_total_limit=trainer.args.save_total_limit,
                       best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=False)
