"""`ogrpo train` (the real CLI entry) with the final norm returning +inf in the policy forward of step
INF_STEP: what an fp16 overflow of the logits does to the loss. Used by tests/test_nonfinite.py."""

import os
import sys

import torch

from ogrpo.cli import main
from ogrpo.trainer import assembly as run

INF_STEP = int(os.environ["OGRPO_TEST_INF_STEP"])
_build = run.build_trainer


def build_trainer(p, *args, **kwargs):
    trainer = _build(p, *args, **kwargs)
    forwards = []

    def overflow(module, inputs, output):
        # generation and scoring run without grad; the loss's policy forward (one per step here) with it
        if torch.is_grad_enabled():
            forwards.append(1)
            if len(forwards) >= INF_STEP:
                output = output.clone()
                output[..., 0] = float("inf")
                return output
        return output

    trainer.model.model.norm.register_forward_hook(overflow)
    return trainer


run.build_trainer = build_trainer
sys.argv = ["ogrpo", *sys.argv[1:]]
main()
