"""The images' TRL line (1.9.2): the old policy from the loss forward trains exactly as TRL's separate pass, per
loss type and importance-sampling mode (tests/old_policy_checks.py; the server run of test_trl19_overlap.py holds
lossless with it to off with TRL's pass under DDP)."""

from __future__ import annotations

import pytest

from old_policy_checks import CASES, assert_same_training


@pytest.mark.parametrize("case", list(CASES))
def test_trl19_the_loss_forwards_old_policy_trains_exactly_as_trls_separate_pass(tmp_path, case):
    assert_same_training(tmp_path, case)
