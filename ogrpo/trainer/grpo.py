"""OgrpoGRPOTrainer: TRL's GRPOTrainer with O-GRPO's layers, one class.

Each concern is one layer (a mixin in its feature's module) that overrides the TRL methods it needs and calls
`super()`; the class's bases are the layers' order, outermost first, so what wraps what is Python's MRO and
nothing else:

| layer | module | overrides |
|---|---|---|
| nonfinite | ogrpo.trainer.guard.Guarded | the log-prob passes (notes inf/NaN), training_step (stops on an inf/NaN loss) |
| rank_balance | ogrpo.trainer.rank_balance.RankBalanced | scoring (the ranks exchange scored rows to hold even tokens) |
| old_policy | ogrpo.trainer.old_policy.OldPolicyFromLoss | scoring, the log-prob passes, the loss (the old policy from the loss forward) |
| profiler | ogrpo.profile.hooks.StageTiming | generation, rewards, scoring, log-prob passes, training_step (times them) |
| overlap | ogrpo.overlap.steps.Overlapped | batch lookahead, generation, scoring, rewards, log-prob passes, the loss (hands TRL what was computed ahead, the groups' losses included) |
| passes | ogrpo.profile.hooks.PassCounting | the log-prob passes that run (`pad_share`) |
| padding_free | ogrpo.trainer.packing.PaddingFree | the log-prob passes (packed rows, no padding computed) |
| linear_logprobs | ogrpo.trainer.kernels.KernelScoring | the log-prob passes (through the kernel) |
| stream_checkpoints | ogrpo.overlap.resume.StreamCheckpoints | the checkpoint's RNG save/load (the generation stream's state) |
| atomic_checkpoints | ogrpo.trainer.checkpoints.AtomicCheckpoints | the checkpoint save (staged, published whole) |

Every layer is off until the run's assembly (ogrpo.trainer.assembly) turns it on, and off it is TRL's method. The methods
overridden and the state names are listed in ogrpo/trainer/overrides.py, whose `check()` holds each TRL line to
them. Importing this module imports TRL.
"""

from __future__ import annotations

from trl import GRPOTrainer

from ogrpo.overlap.resume import StreamCheckpoints
from ogrpo.overlap.steps import Overlapped
from ogrpo.profile.hooks import PassCounting, StageTiming
from ogrpo.trainer.checkpoints import AtomicCheckpoints
from ogrpo.trainer.guard import Guarded
from ogrpo.trainer.kernels import KernelScoring
from ogrpo.trainer.old_policy import OldPolicyFromLoss
from ogrpo.trainer.packing import PaddingFree
from ogrpo.trainer.rank_balance import RankBalanced

# outermost first: the bases of OgrpoGRPOTrainer and the layer names of ogrpo/trainer/overrides.py
LAYERS = {"nonfinite": Guarded, "rank_balance": RankBalanced, "old_policy": OldPolicyFromLoss, "profiler": StageTiming, "overlap": Overlapped,
          "passes": PassCounting, "padding_free": PaddingFree, "linear_logprobs": KernelScoring,
          "stream_checkpoints": StreamCheckpoints, "atomic_checkpoints": AtomicCheckpoints}


class OgrpoGRPOTrainer(Guarded, RankBalanced, OldPolicyFromLoss, StageTiming, Overlapped, PassCounting, PaddingFree, KernelScoring,
                       StreamCheckpoints, AtomicCheckpoints, GRPOTrainer):
    """TRL's GRPOTrainer, constructed as TRL's; O-GRPO's layers are turned on by the run's assembly."""
