"""The only contact OgrpoGRPOTrainer (ogrpo/trainer/grpo.py) has with TRL's and transformers' internals: the
methods its layers override, with the parameters each override passes or reads by name, and the attribute names
its layers keep their state in (which TRL's class must not have). `check()` holds the installed TRL line to it:
a release that renames, drops or reshapes one of them fails here, one line per change, before any run starts
(`ogrpo doctor`, tests/test_patches.py, and for TRL 1.9.2 tests/trl19). Importing this module imports no library.
"""

from __future__ import annotations

from ogrpo.patches.target import moved, problems_of, resolve

NAME = "trl_trainer_overrides"
LIBRARY = "trl"
TRAINER = "trl.trainer.grpo_trainer:GRPOTrainer"

# method -> (the layers that override it, outermost first; the parameters they pass or read by name)
OVERRIDES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "_get_per_token_logps_and_entropies": (("nonfinite", "old_policy", "profiler", "overlap", "passes",
                                            "padding_free", "linear_logprobs"),
                                           ("model", "input_ids", "attention_mask", "logits_to_keep",
                                            "batch_size", "compute_entropy", "compute_aux_loss")),
    "training_step": (("nonfinite", "profiler"), ("model", "inputs", "num_items_in_batch")),
    "_generate": (("profiler", "overlap"), ("prompts",)),
    "_generate_and_score_completions": (("rank_balance", "old_policy", "profiler", "overlap"), ("inputs",)),
    "_compute_loss": (("old_policy", "overlap"), ("model", "inputs")),
    "_calculate_rewards": (("profiler", "overlap"), ("inputs", "prompts", "completions", "completion_ids_list")),
    "get_batch_samples": (("overlap",), ("epoch_iterator", "num_batches", "device")),
    "_log_completion_extra": (("overlap",), ("column", "values")),
    "_log_metric": (("overlap",), ("name", "value")),
    # transformers' Trainer calls these once per checkpoint (save) and on resume (load): the generation stream's
    # state travels with the checkpoint
    "_save_rng_state": (("stream_checkpoints",), ("output_dir",)),
    "_load_rng_state": (("stream_checkpoints",), ("checkpoint",)),
    "_save_checkpoint": (("atomic_checkpoints",), ("model", "trial")),
    "_get_output_dir": (("atomic_checkpoints",), ("trial",)),
}
# what a TRL method must still do for an override to mean what it says (method -> text in its source)
SOURCES = {
    # the staging redirect holds every file the save writes only while the Trainer builds its paths this way
    "_save_checkpoint": "self._get_output_dir(trial=trial)",
}
# the layers' state on the trainer: TRL's class must not use these names for its own
STATE = ("rank_balance", "old_policy", "packing", "overlap", "overlap_pipeline", "timeline", "stage_profiler", "nonfinite_guard", "logprobs_scorer",
         "_checkpoint_staging", "_staged_dir")


def check() -> None:
    """TRL's GRPOTrainer has every overridden method with the parameters named, and none of the state names."""
    problems = problems_of({f"{TRAINER}.{method}": params for method, (_, params) in OVERRIDES.items()})
    try:
        trainer = resolve(TRAINER)
    except (ImportError, AttributeError):
        trainer = None  # already a problem for every method
    if trainer is not None:
        import inspect

        for method, needle in SOURCES.items():  # GRPOTrainer's may add to transformers' Trainer's and call it
            sources = [inspect.getsource(vars(c)[method]) for c in trainer.__mro__ if method in vars(c)]
            if not any(needle in source for source in sources):
                problems.append(f"{TRAINER}.{method} no longer contains `{needle}` (in any class it inherits from)")
        problems += [f"{TRAINER} has its own `{name}`, a name OgrpoGRPOTrainer keeps state in" for name in STATE
                     if hasattr(trainer, name)]
    if problems:
        raise moved(NAME, LIBRARY, problems)
