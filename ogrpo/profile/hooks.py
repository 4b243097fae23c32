"""The profiler's two layers of the trainer class (OgrpoGRPOTrainer, ogrpo/trainer/grpo.py), where it sits in it:

- `StageTiming`: times TRL's stages (generation, rewards, the log-prob passes while scoring, training_step) into
  the attached StageProfiler. Above the overlap: what it times is what the trainer waits for, a result the overlap
  computed ahead included.
- `PassCounting`: counts the positions each log-prob forward computes and those its mask keeps (`pad_share`).
  Beneath the overlap: where `lossless` scores the streamed groups, their own forwards are what is counted, and
  TRL's call for the whole batch, which the overlap then answers without a forward, is not.

Without a profiler attached (`stage_profiler` None) each method is TRL's. `profiled(base)` gives a plain
GRPOTrainer only these two layers: the benchmarks' plain-TRL anchor, timed as O-GRPO's runs are.
"""

from __future__ import annotations


class StageTiming:
    stage_profiler = None  # ogrpo.profile.profiler.StageProfiler, set by its attach
    timeline = None  # ogrpo.profile.profiler.Timeline (server mode): the overlap pipeline records into it too

    def _generate(self, *args, **kwargs):
        p = self.stage_profiler
        return super()._generate(*args, **kwargs) if p is None else p.generation(super()._generate, *args, **kwargs)

    def _calculate_rewards(self, *args, **kwargs):
        p, inner = self.stage_profiler, super()._calculate_rewards
        return inner(*args, **kwargs) if p is None else p.timed("reward", inner, *args, **kwargs)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        p, inner = self.stage_profiler, super()._get_per_token_logps_and_entropies
        return inner(*args, **kwargs) if p is None else p.logprob_pass(inner, *args, **kwargs)

    def _generate_and_score_completions(self, *args, **kwargs):
        p, inner = self.stage_profiler, super()._generate_and_score_completions
        return inner(*args, **kwargs) if p is None else p.scoring(inner, *args, **kwargs)

    def training_step(self, *args, **kwargs):
        p, inner = self.stage_profiler, super().training_step
        return inner(*args, **kwargs) if p is None else p.training_step(inner, *args, **kwargs)


class PassCounting:
    stage_profiler = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        p, inner = self.stage_profiler, super()._get_per_token_logps_and_entropies
        if p is None:
            return inner(*args, **kwargs)
        packing = getattr(self, "packing", None)  # ogrpo.trainer.packing: a packed pass computes fewer positions
        return p.counted_pass(inner, *args, computed=(lambda: packing.positions) if packing else None, **kwargs)


def profiled(base: type) -> type:
    """`base` (a GRPOTrainer class) with only the profiler's layers."""
    return type(f"Profiled{base.__name__}", (StageTiming, PassCounting, base), {})
