"""Padding-free log-prob passes (ogrpo/trainer/packing.py): TRL's padded rows packed end to end, each sequence's
positions from 0, the completion tokens' log-probs put back where TRL's layout has them; the plan turns it on, the
trainer keeps TRL's padded pass where packing would not be exact; and a packed run trains as TRL's padded one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import yaml

from lossless_checks import CASES, assert_same_training
from ogrpo.trainer.packing import (Costs, balanced_bins, choose_capacity, first_fit_decreasing, pack, prompt_families,
                                   why_not, why_not_share)


def test_first_fit_decreasing_fills_bins_up_to_the_capacity_longest_first():
    assert first_fit_decreasing([3, 7, 2, 5, 1], 8) == [[1, 4], [0, 3], [2]]
    assert first_fit_decreasing([9, 2], 8) == [[0], [1]]  # a row longer than a bin stands alone
    lengths = [5, 1, 8, 3, 3, 6, 2, 7]
    bins = first_fit_decreasing(lengths, 8)
    assert sorted(r for b in bins for r in b) == list(range(8))
    assert all(sum(lengths[r] for r in b) <= 8 for b in bins)


def test_balanced_bins_need_no_more_bins_and_leave_little_filler():
    lengths = [300, 280, 250, 100, 90, 60, 40, 30, 20, 10]  # 1,180 tokens; TRL pads 10 rows to 310
    count = len(first_fit_decreasing(lengths, 310))
    bins = balanced_bins(lengths, 310)
    assert len(bins) == count == 4 and sorted(r for b in bins for r in b) == list(range(10))
    longest = max(sum(lengths[r] for r in b) for b in bins)
    assert longest <= 310 and 1 - sum(lengths) / (len(bins) * longest) < 0.05  # filler share, not TRL's 62%


def test_the_bin_length_is_the_cheapest_and_rows_of_one_length_keep_trls_pass():
    qwen05 = Costs.of(SimpleNamespace(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                      vocab_size=151936, num_attention_heads=14, num_key_value_heads=2))
    # a reasoning batch: a few completions at the cap, most short -> longer bins than a row, far below the padding
    lengths = [1100, 1024, 300, 250, 200, 180, 150, 120, 100, 90, 80, 60, 50, 40, 30, 20]
    capacity = choose_capacity(lengths, 1100, qwen05)
    assert capacity is not None and capacity >= 1100
    bins = balanced_bins(lengths, capacity)
    packed = qwen05.of_rows(len(bins), max(sum(lengths[r] for r in b) for b in bins))
    assert packed < 0.5 * qwen05.of_rows(len(lengths), 1100)
    assert choose_capacity([96] * 32, 96, qwen05) is None  # no padding: nothing to gain, TRL's causal pass runs
    # attention-heavy (a tiny model): bins stay short, even where one row would hold everything
    tiny = Costs.of(SimpleNamespace(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=64))
    assert choose_capacity(lengths, 1100, tiny) < sum(lengths)
    assert choose_capacity(lengths, 1100, None) == 1100  # no shape known: bins of TRL's row
    ids = torch.tensor([[0, 7, 8, 9], [5, 6, 1, 0], [4, 3, 2, 1]])
    p = pack(ids, (ids != 0).long(), logits_to_keep=2, capacity=10)
    assert p.input_ids.tolist() == [[7, 8, 9, 5, 6, 1, 4, 3, 2, 1]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1, 2, 3]]


def test_pack_keeps_each_rows_real_tokens_in_order_with_positions_from_zero():
    # three rows of width 6, the last 3 columns the completion; 0 marks padding
    ids = torch.tensor([[0, 0, 11, 12, 13, 0],
                        [0, 21, 22, 23, 24, 25],
                        [31, 32, 33, 34, 0, 0]])
    mask = (ids != 0).long()
    p = pack(ids, mask, logits_to_keep=3)
    assert p.input_ids.shape[1] <= 6  # no bin longer than TRL's padded row
    rows = {}
    for b in range(p.input_ids.size(0)):  # split each bin into its sequences by the positions
        seq = []
        for token, position in zip(p.input_ids[b].tolist(), p.position_ids[b].tolist()):
            if position == 0 and seq:
                rows.setdefault(b, []).append(seq)
                seq = []
            seq.append(token)
        rows.setdefault(b, []).append(seq)
    sequences = sorted(s for seqs in rows.values() for s in seqs if s[0] != 0)
    assert sequences == [[11, 12, 13], [21, 22, 23, 24, 25], [31, 32, 33, 34]]
    assert p.positions == p.input_ids.numel() < ids.numel()
    # the scored tokens: each row's completion tokens, at their place in TRL's [rows, 3] layout
    b, c = p.scored
    got = {(r, t): int(p.input_ids[bb, cc])
           for bb, cc, r, t in zip(b.tolist(), c.tolist(), p.dest[0].tolist(), p.dest[1].tolist())}
    assert got == {(0, 0): 12, (0, 1): 13, (1, 0): 23, (1, 1): 24, (1, 2): 25, (2, 0): 34}
    # a completion token's predictor is the token before it in its own sequence
    assert all(int(p.position_ids[bb, cc]) >= 1 for bb, cc in zip(b.tolist(), c.tolist()))


def test_pack_leaves_to_trl_a_completion_without_a_prompt_token_and_a_pass_with_nothing_to_score():
    ids = torch.tensor([[0, 0, 5, 6], [1, 2, 3, 4]])
    assert pack(ids, (ids != 0).long(), logits_to_keep=2) is None
    masked = torch.tensor([[1, 2, 0, 0], [3, 4, 0, 0]])  # mask_truncated_completions masked both completions
    assert pack(masked, (masked != 0).long(), logits_to_keep=2) is None


def _qwen2_config(attention="sdpa", **extra):
    import transformers

    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=50,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      **extra)
    config._attn_implementation = attention
    return config


def _qwen2():
    import transformers

    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(_qwen2_config())


# six rows of width 10, the last 5 columns the completion, 0 padding: rows 0-2 share the prompt [3, 4, 5] (row 2's
# completion at the cap), rows 3-4 share [7, 8], row 5 shares with nobody, row 6 has a 1-token prompt
SHARED_IDS = torch.tensor([[0, 0, 3, 4, 5, 11, 12, 13, 0, 0],
                           [0, 0, 3, 4, 5, 14, 15, 0, 0, 0],
                           [0, 0, 3, 4, 5, 16, 17, 18, 19, 20],
                           [0, 0, 0, 7, 8, 21, 22, 0, 0, 0],
                           [0, 0, 0, 7, 8, 23, 0, 0, 0, 0],
                           [0, 9, 9, 9, 9, 24, 25, 26, 0, 0],
                           [0, 0, 0, 0, 6, 27, 28, 0, 0, 0],
                           [0, 0, 0, 0, 6, 29, 0, 0, 0, 0]])


def _padded_logps(model, ids, mask, keep):
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -keep - 1:-1]
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -keep:, None])[..., 0] * mask[:, -keep:]


def _packed_logps(model, packed, rows, keep):
    from ogrpo.trainer.packing import _inputs

    b, c = packed.scored
    logits = model(**_inputs(packed)).logits[b, c - 1]
    logps = torch.log_softmax(logits, -1).gather(-1, packed.input_ids[b, c][:, None])[:, 0]
    return logps.new_zeros(rows, keep).index_put(packed.dest, logps)


def test_rows_that_share_a_prompt_compute_it_once_with_the_same_log_probs_and_gradients():
    ids, keep = SHARED_IDS, 5
    mask = (ids != 0).long()
    families = prompt_families(ids, mask, keep)
    assert families == [[0, 1, 2], [3, 4]]  # a 1-token prompt has nothing to share: rows 6, 7 stay whole
    model = _qwen2()
    weights = torch.randn(ids.size(0), keep)  # a loss that weighs every scored token differently
    reference = _padded_logps(model, ids, mask, keep)
    grads = torch.autograd.grad((reference * weights).sum(), list(model.parameters()))
    for capacity in (8, 10, 16, 64):  # families split to fill bins (8, 10) .. everything in one bin (64)
        packed = pack(ids, mask, keep, capacity, families)
        assert packed.attention_mask is not None and packed.attention_mask.shape[-1] == packed.input_ids.size(1)
        # [3, 4] and [7] once per family (or per part of it), each row's last prompt token with its completion
        # never more than the rows' real tokens (split to one row per part at 8), fewer once a part holds two
        assert packed.real <= int(mask.sum()) and packed.real <= packed.positions
        assert capacity < 16 or packed.real < int(mask.sum())
        logps = _packed_logps(model, packed, ids.size(0), keep)
        torch.testing.assert_close(logps, reference, rtol=0, atol=1e-5)
        got = torch.autograd.grad((logps * weights).sum(), list(model.parameters()))
        for g, want in zip(got, grads):
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)
    split = pack(ids, mask, keep, 8, families)
    assert split.input_ids.size(1) <= 8 and split.real > pack(ids, mask, keep, 16, families).real  # prefix twice
    whole = pack(ids, mask, keep, 64, families)
    assert whole.input_ids.size(0) == 1 and whole.real == int(mask.sum()) - 2 * 2 - 1 * 1 + 0
    # no family: positions alone say where each sequence starts, as before
    assert pack(ids, mask, keep, 64).attention_mask is None


def test_families_split_to_fill_the_bins_so_little_filler_is_computed():
    """A reasoning-like batch (4 prompts x 8, completions long-tailed up to 256): whole families would leave bins
    part empty; split (each part repeating its prompt) they fill them."""
    from ogrpo.trainer.packing import Family, _shared_cost, bin_lengths, fill_bins

    gen = torch.Generator().manual_seed(3)
    prompt, cap = 32, 256
    lengths = (torch.empty(32).exponential_(1 / 73, generator=gen).long().clamp(1, cap)).tolist()
    width = prompt + max(lengths)
    ids = torch.randint(5, 900, (32, width), generator=gen)
    mask = torch.zeros_like(ids)
    for r in range(32):
        ids[r, :prompt] = ids[r // 8 * 8, :prompt]
        mask[r, :prompt + lengths[r]] = 1
    keep = width - prompt
    costs = Costs.of(SimpleNamespace(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, vocab_size=1024,
                                     num_attention_heads=4, num_key_value_heads=2))
    families = prompt_families(ids, mask, keep)
    _, capacity = _shared_cost(mask, keep, families, costs)
    packed = pack(ids, mask, keep, capacity, families)
    assert packed.positions < 0.9 * int(mask.sum())  # fewer positions than the rows' real tokens
    assert 1 - packed.real / packed.positions < 0.05  # and almost no filler
    # every row once, no bin over the capacity; a family too long for one bin's room is split
    fams = [Family(3, {1: 4, 2: 4, 3: 4})]
    bins = fill_bins({0: 5}, fams, 11)
    assert sorted(r for b in bins for _, rows in b for r in rows) == [0, 1, 2, 3]
    assert max(bin_lengths(bins, {0: 5}, fams)) <= 11 and sum(len(b) for b in bins) > 2


def test_a_shared_prompt_needs_sdpa_without_a_sliding_window():
    assert why_not_share(_qwen2().config) is None
    assert "custom mask" in why_not_share(_qwen2_config("eager"))
    assert "custom mask" in why_not_share(_qwen2_config("flash_attention_2"))
    sliding = _qwen2_config(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert "sliding" in why_not_share(sliding)


def test_the_cost_model_shares_a_prompt_where_it_saves_compute():
    from ogrpo.trainer.packing import _shared_cost

    def cost(hidden, prompt, completion, n=8):
        costs = Costs.of(SimpleNamespace(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=8,
                                         vocab_size=4096, num_attention_heads=8, num_key_value_heads=2))
        ids = torch.randint(1, 100, (n, prompt + completion))
        ids[:, :prompt] = ids[0, :prompt]
        mask = torch.ones_like(ids)
        shared, _ = _shared_cost(mask, completion, prompt_families(ids, mask, completion), costs)
        return shared / costs.of_rows(n, prompt + completion)

    assert cost(512, 32, 64) < 0.85  # the bench's default shape: a third of every row is its group's prompt
    assert cost(512, 256, 64) < 0.5  # a long prompt, short answers
    assert cost(64, 4, 256) > 0.95  # attention-heavy and almost no prompt: the rows stay apart


@pytest.mark.slow
@pytest.mark.parametrize(("case", "kernel"), [("grpo-beta", False), ("dapo-masked", False), ("bnpo", False),
                                             ("grpo-accumulated", False), ("grpo-beta", True)])
def test_a_run_that_computes_each_prompt_once_trains_as_trls_padded_passes(tmp_path, case, kernel):
    """Every pass computes each prompt once for its generations (TRL 1.16's fused head, or linear_logprobs with
    the old policy from the loss)."""
    assert_same_training(tmp_path, case, kernel=kernel, packed=True, shared=True, from_loss=kernel)


def test_packing_is_kept_off_for_models_whose_positions_are_absolute():
    rotary = SimpleNamespace(config=SimpleNamespace(rope_parameters={"rope_theta": 1e6}))
    assert why_not(rotary) is None
    gpt2 = SimpleNamespace(config=SimpleNamespace(n_positions=1024))
    assert "no rotary position embeddings" in why_not(gpt2)


def _plan(tmp_path, ogrpo=None, gpus="cpu"):
    from ogrpo.config import load_run_config
    from ogrpo.plan import plan_from_config

    cfg = tmp_path / "r.yaml"
    cfg.write_text(yaml.safe_dump({"model_name_or_path": "ogrpo:tiny", "dataset_name": "ogrpo:tiny",
                                   "reward_funcs": ["tiny_letter"], "ogrpo": ogrpo or {}}))
    return plan_from_config(load_run_config(str(cfg)), gpus=gpus)


def test_the_plan_packs_the_passes_unless_the_run_config_says_off(tmp_path):
    plan = _plan(tmp_path)
    assert plan.padding_free and "no padding is computed" in plan.reason_of("padding_free")
    assert _plan(tmp_path, gpus="2xcpu", ogrpo={"use_vllm": True}).padding_free
    off = _plan(tmp_path, ogrpo={"padding_free": "off"})
    assert not off.padding_free and "ogrpo.padding_free: off" in off.reason_of("padding_free")
    rows = _plan(tmp_path, ogrpo={"padding_free": "rows"})  # packed, no prompt shared (what memory plans for)
    assert rows.padding_free and rows.padding_free_layout == "rows" and "own prompt" in rows.reason_of(
        "padding_free")
    assert plan.padding_free_layout is None and off.padding_free_layout is None


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_packed_run_trains_as_trls_padded_passes(tmp_path, case):
    """Per loss type and importance-sampling mode (tests/lossless_checks.py), on TRL 1.16's fused head."""
    assert_same_training(tmp_path, case, packed=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["grpo-beta", "grpo-accumulated"])
def test_packed_through_the_kernel_with_the_old_policy_from_the_loss(tmp_path, case):
    """Both lossless layers together, the passes scored by linear_logprobs on packed rows."""
    assert_same_training(tmp_path, case, kernel=True, packed=True, from_loss=True)
