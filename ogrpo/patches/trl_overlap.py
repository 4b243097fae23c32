"""TRL's module-level collectives, where the overlap (ogrpo/overlap/) needs them to wait or hand over; and the
check of every TRL internal the overlap reads. The trainer's side is OgrpoGRPOTrainer's overlap layer
(ogrpo/overlap/steps.py); these two cannot be subclassed, they are functions of TRL's modules:

- `gather` of TRL's trainer module: TRL gathers the rewards across ranks at the end of `_calculate_rewards`; on
  the overlap's reward thread that collective would run beside the main thread's (DDP's, ZeRO-3's), so there it
  returns the local tensor and the main thread gathers it when it takes the rewards, where TRL would have;
- `broadcast_object_list` of TRL's generation module: where lossless streams a batch's groups to several ranks,
  the main process broadcasts each finished group first (ogrpo.overlap.pipeline.RankGroups), then TRL's own
  broadcast of the whole batch runs on every rank as before.
"""

from __future__ import annotations

import inspect
import threading

from ogrpo.patches.target import moved, problems_of, trl_generation_module

NAME = "trl_overlap"
LIBRARY = "trl"
GRPO_MODULE = "trl.trainer.grpo_trainer"
deferred = threading.local()  # set on the reward thread: TRL's gather of the rewards waits for the main thread


def check() -> None:
    gen = trl_generation_module(NAME)
    problems = problems_of({
        f"{GRPO_MODULE}:GRPOTrainer._generate": ("prompts",),
        f"{GRPO_MODULE}:GRPOTrainer._generate_and_score_completions": ("inputs",),
        f"{GRPO_MODULE}:GRPOTrainer._calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
        f"{GRPO_MODULE}:GRPOTrainer._tokenize_prompts": ("prompts",),
        f"{GRPO_MODULE}:GRPOTrainer._get_per_token_logps_and_entropies": ("model", "input_ids", "attention_mask",
                                                                     "logits_to_keep", "batch_size"),
        f"{GRPO_MODULE}:gather": None,
        f"{GRPO_MODULE}:disable_gradient_checkpointing": None,
        f"{gen}:broadcast_object_list": None,
        "trl.data_utils:is_conversational": None,
        "transformers:Trainer.get_batch_samples": ("epoch_iterator", "num_batches", "device"),
        "transformers:Trainer._get_num_items_in_batch": ("batch_samples", "device"),
        f"{gen}:VLLMGeneration.sync_weights": ("self",),
        f"{gen}:VLLMClient.generate": ("prompts",),
        f"{gen}:VLLMClient.reset_prefix_cache": ("self",),
    })
    if not problems:
        import importlib

        from trl.trainer import grpo_trainer
        from transformers import Trainer

        sources = {"GRPOTrainer._calculate_rewards": (grpo_trainer.GRPOTrainer._calculate_rewards,
                                                      "gather(rewards_per_func)"),
                   "GRPOTrainer._generate": (grpo_trainer.GRPOTrainer._generate,
                                             "return prompt_ids, completion_ids, tool_mask, completions"),
                   "Trainer.get_batch_samples": (Trainer.get_batch_samples, "next(epoch_iterator)"),
                   # every rank reaches this broadcast after the main process's request: where the groups are handed
                   # over (RankGroups), the ranks that wait in it take them first
                   "VLLMGeneration.generate": (importlib.import_module(gen).VLLMGeneration.generate,
                                               "broadcast_object_list(obj_list, from_process=0)"),
                   # the per-group passes build what TRL's batch pass reads (a mismatch only loses the overlap)
                   "GRPOTrainer._generate_and_score_completions": (
                       grpo_trainer.GRPOTrainer._generate_and_score_completions,
                       "torch.cat([prompt_ids, completion_ids], dim=1)")}
        for name, (fn, needle) in sources.items():
            if needle not in inspect.getsource(fn):
                problems.append(f"{name} no longer contains `{needle}`")
    if problems:
        raise moved(NAME, LIBRARY, problems)


def defer_reward_gather() -> None:
    """TRL gathers the rewards across ranks at the end of `_calculate_rewards`; on the reward thread that
    collective would run beside the main thread's (DDP's, ZeRO-3's): there it returns the local tensor and the
    main thread gathers it when it takes the rewards, where TRL would have. Idempotent."""
    import importlib

    mod = importlib.import_module(GRPO_MODULE)
    if getattr(mod.gather, "_ogrpo_original", None) is not None:
        return
    real = mod.gather

    def gather(tensor):
        return tensor if getattr(deferred, "on", False) else real(tensor)

    gather._ogrpo_original = real
    mod.gather = gather


def real_gather():
    import importlib

    g = importlib.import_module(GRPO_MODULE).gather
    return getattr(g, "_ogrpo_original", g)


handoff = threading.local()  # the batch whose groups the main process hands over (RankGroups), until TRL's broadcast


def hand_groups_over() -> None:
    """TRL's broadcast of the generated batch, where a batch's groups are handed over first: the main process
    ends its per-group broadcasts with None, the other ranks take groups until that None; then TRL's own
    broadcast runs on every rank as before. Idempotent."""
    import importlib

    mod = importlib.import_module(trl_generation_module(NAME))
    if getattr(mod.broadcast_object_list, "_ogrpo_original", None) is not None:
        return
    real = mod.broadcast_object_list

    def broadcast_object_list(object_list, from_process=0):
        groups, handoff.groups = getattr(handoff, "groups", None), None
        if groups is not None:
            from accelerate.state import PartialState

            if PartialState().is_main_process:
                real([None], from_process=0)
            else:
                while True:
                    item = [None]
                    real(item, from_process=0)
                    if item[0] is None:
                        break
                    groups.arrived(*item[0])
        return real(object_list, from_process=from_process)

    broadcast_object_list._ogrpo_original = real
    mod.broadcast_object_list = broadcast_object_list
