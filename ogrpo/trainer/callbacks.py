"""Callbacks every run gets. `default_callbacks` is the hook other areas extend (e.g. preemption)."""

from __future__ import annotations

from pathlib import Path

from ogrpo.trainer import quiet
from ogrpo.trainer.rundir import metrics_callback


def quiet_progress_callback():
    """TRL's tqdm bar, with the latest reward in the bar instead of a printed dict per log line."""
    from transformers.trainer_callback import ProgressCallback

    class QuietProgress(ProgressCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            with quiet.to_console():  # the bar is the one library output the user watches
                return super().on_train_begin(args, state, control, **kwargs)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and self.training_bar is not None and logs:
                post = {k: f"{logs[k]:.3f}" for k in ("reward", "loss") if isinstance(logs.get(k), (int, float))}
                if post:
                    self.training_bar.set_postfix(post, refresh=False)

    return QuietProgress


def default_callbacks(run_dir: Path) -> list:
    """Callbacks added to every trainer (the profiler attaches its own when it hooks the trainer)."""
    return [metrics_callback(Path(run_dir))]


def use_quiet_progress(trainer) -> None:
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    if trainer.args.disable_tqdm:
        return
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(quiet_progress_callback())
