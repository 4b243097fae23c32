"""O-GRPO's kernels in the trainer: the innermost layer of its log-prob passes (OgrpoGRPOTrainer).

`use_linear_logprobs` teaches the models the kernel's scoring mode (ogrpo.patches.trl_linear_logprobs, a patch of
the models' forward) and from then on the trainer's scoring calls go through its Scorer, which falls back to TRL's
own path call by call where the kernel does not apply. Beneath every other layer: the pass counting, the overlap,
the profiler and the inf/NaN guard see the kernel's pass as TRL's.
"""

from __future__ import annotations

from ogrpo.patches import trl_linear_logprobs


class KernelScoring:
    logprobs_scorer = None  # ogrpo.patches.trl_linear_logprobs.Scorer

    def use_linear_logprobs(self) -> dict:
        """Route this trainer's scoring through linear_logprobs; returns what was done, for the manifest."""
        installed, self.logprobs_scorer = trl_linear_logprobs.install(self)
        return installed

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        scorer, inner = self.logprobs_scorer, super()._get_per_token_logps_and_entropies
        return inner(*args, **kwargs) if scorer is None else scorer(self, inner, *args, **kwargs)
