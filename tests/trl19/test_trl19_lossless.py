"""The images' TRL line (1.9.2, its logits path): the old policy from the loss forward and the packed passes each
train exactly as TRL's own passes, per loss type and importance-sampling mode, and so do groups trained ahead
(tests/lossless_checks.py; the server
run of test_trl19_overlap.py holds lossless with both to off with TRL's old-policy pass under DDP)."""

from __future__ import annotations

import pytest

from lossless_checks import CASES, assert_same_training


@pytest.mark.parametrize("case", list(CASES))
def test_trl19_the_loss_forwards_old_policy_trains_exactly_as_trls_separate_pass(tmp_path, case):
    assert_same_training(tmp_path, case, from_loss=True)


@pytest.mark.parametrize("case", list(CASES))
def test_trl19_a_packed_run_trains_as_trls_padded_passes(tmp_path, case):
    assert_same_training(tmp_path, case, packed=True)


@pytest.mark.parametrize("case", ["grpo-beta", "dr_grpo", "vespo", "dapo-chunked"])
def test_trl19_groups_trained_ahead_train_exactly_as_trls_micro_batches(tmp_path, case):
    """Each streamed group's loss forward/backward as it arrives (ogrpo/overlap/train_ahead.py), on TRL 1.9.2's
    loss and its transformers' accumulation scaling: a mean loss, a fixed denominator, a sum over the batch's
    tokens in chunks (tests/test_train_ahead.py runs every case on TRL 1.16)."""
    assert_same_training(tmp_path, case, from_loss=True, packed=True, ahead=True)


@pytest.mark.parametrize("stage", [2, 3])
def test_trl19_groups_trained_ahead_under_zero_train_as_trls_micro_batches(tmp_path, stage):
    """Under DeepSpeed ZeRO-2/3 (ogrpo/overlap/deepspeed_ahead.py), on the images' TRL, transformers, accelerate
    and DeepSpeed: each group's chunks through the engine, the replayed micro-batches closing the step, and a batch
    that differs from the groups' dropping their gradients (tests/zero_lossless.py)."""
    from zero_lossless import assert_trained_ahead_as_trl

    assert_trained_ahead_as_trl(tmp_path, stage)


def test_trl19_completions_forwarded_as_each_ends_train_exactly_as_trls_micro_batches(tmp_path):
    """Each completion's reference pass and loss forward as it ends, the backward once its group is whole, on
    TRL 1.9.2's logits path (its server keeps whole groups: this holds the trainer's side)."""
    assert_same_training(tmp_path, "grpo-beta", from_loss=True, packed=True, ahead=True, completions=True)


@pytest.mark.parametrize("case", ["grpo-beta", "dapo-masked"])
def test_trl19_the_last_groups_completions_run_their_backward_as_they_end(tmp_path, case):
    """Group after group: once one group is left, each of its completions runs its backward as it ends
    (ogrpo/overlap/early_backward.py), on TRL 1.9.2's loss: the KL term into the gradients, the advantage's term
    into two sums the group's mean and scale close."""
    assert_same_training(tmp_path, case, from_loss=True, packed=True, ahead=True, completions="interleaved")


@pytest.mark.parametrize(("case", "kernel"), [("grpo-beta", False), ("dapo-masked", False), ("grpo-beta", True)])
def test_trl19_a_run_that_computes_each_prompt_once_trains_as_trls_padded_passes(tmp_path, case, kernel):
    """TRL 1.9.2's logits path (and linear_logprobs) with every prompt computed once for its generations."""
    assert_same_training(tmp_path, case, kernel=kernel, packed=True, shared=True, from_loss=kernel)


def test_trl19_packed_through_the_kernel_with_the_old_policy_from_the_loss(tmp_path):
    assert_same_training(tmp_path, "grpo-accumulated", kernel=True, packed=True, from_loss=True)
