"""Training while the server generates (ogrpo/overlap/train_ahead.py): under `lossless`, with the batch streamed
group by group, each finished group's loss forward and backward run as it arrives; TRL's micro-batches then log
their losses from the groups' forwards without one of their own. The plan says where this applies and why not
elsewhere; where it applies the trainer trains exactly as TRL's own passes, per loss type (in one process, the
groups handed over in a scrambled order; tests/test_overlap.py holds a real server job to `off`)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import yaml

from lossless_checks import CASES, CHUNKED, UNCHECKPOINTED, assert_same_training

# every case of tests/lossless_checks.py whose loss can be trained ahead (bnpo and the entropy mask cannot)
AHEAD = [c for c in CASES if c not in ("bnpo", "grpo-accumulated")] + list(CHUNKED)


def _planned(tmp_path, gpus="2xcpu", ogrpo=None, **trl):
    from ogrpo.config import load_run_config
    from ogrpo.plan import plan_from_config

    cfg = tmp_path / "r.yaml"
    cfg.write_text(yaml.safe_dump({"model_name_or_path": "ogrpo:tiny", "dataset_name": "ogrpo:tiny",
                                   "reward_funcs": ["tiny_letter"], "num_generations": 4,
                                   "per_device_train_batch_size": 16, **trl,
                                   "ogrpo": {"use_vllm": True, **(ogrpo or {})}}))
    return plan_from_config(load_run_config(str(cfg)), gpus=gpus)


def _plan(tmp_path, gpus="2xcpu", ogrpo=None, **trl):
    plan = _planned(tmp_path, gpus, ogrpo, **trl)
    return plan.train_ahead, plan.reason_of("overlap.train_ahead")


def _early(tmp_path, gpus="2xcpu", ogrpo=None, **trl):
    plan = _planned(tmp_path, gpus, ogrpo, **trl)
    return plan.early_backward, plan.reason_of("overlap.early_backward")


def test_the_plan_trains_ahead_exactly_where_a_rows_share_of_the_gradient_is_fixed(tmp_path):
    on, why = _plan(tmp_path)  # the default: dapo, lossless, streamed, the old policy from the loss forward
    assert on is True and "while the server generates" in why and "not bit for bit" in why
    for loss in ("grpo", "dr_grpo", "sapo", "cispo", "vespo"):
        assert _plan(tmp_path, loss_type=loss)[0] is True, loss
    assert _plan(tmp_path, loss_type="luspo", importance_sampling_level="sequence")[0] is True
    for keys, words in ((dict(loss_type="bnpo"), "bnpo"), (dict(scale_rewards="batch"), "whole batch"),
                        (dict(multi_objective_aggregation="normalize_then_sum"), "whole batch"),
                        (dict(top_entropy_quantile=0.5), "top_entropy_quantile"),
                        (dict(entropy_coef=0.01), "entropy bonus"),
                        (dict(full_determinism=True), "reruns are identical"),
                        (dict(ogrpo={"old_policy_pass": "separate"}), "separate pass"),
                        (dict(ogrpo={"train_ahead": "off"}), "run config"),
                        (dict(ogrpo={"strategy": "zero3_offload"}, loss_type="grpo"), "offloaded"),
                        (dict(gpus="4xV100-32G", ogrpo={"strategy": "zero2"}), "dapo under DeepSpeed in fp16")):
        on, why = _plan(tmp_path, **keys)
        assert on is False and words in why, (keys, why)
    # fp16 (V100): a mean loss's gradients keep their size; trained ahead through the engine
    on, why = _plan(tmp_path, gpus="4xV100-32G", ogrpo={"strategy": "zero2"}, loss_type="grpo")
    assert on is True and "reduced by DeepSpeed" in why, why
    # under ZeRO-2/3 every loss trains ahead, each chunk's backward through DeepSpeed's engine; no completion runs
    # its backward before its group is whole (the engine reduces each backward into its partitions)
    for strategy, loss in (("zero2", "grpo"), ("zero3", "grpo"), ("zero2", "dapo"), ("zero3", "vespo")):
        on, why = _plan(tmp_path, ogrpo={"strategy": strategy}, loss_type=loss)
        assert on is True and "DeepSpeed's engine" in why, (strategy, loss, why)
        on, why = _early(tmp_path, ogrpo={"strategy": strategy}, loss_type=loss)
        assert on is False and "DeepSpeed" in why and "partitions" in why, (strategy, why)
    on, why = _plan(tmp_path, gpus="3xcpu", ogrpo={"strategy": "zero2"}, loss_type="dr_grpo")
    assert on is True and "2 trainer processes" in why and "as many chunks" in why and "reduced by DeepSpeed" in why
    # completions run their backward as they end, before their group is whole, where the loss is linear in the
    # advantage and the two gradient sums fit: of every open group, where the tiny model's sums all fit
    assert _early(tmp_path)[0] is True and "as it ends" in _early(tmp_path)[1]
    planned = _planned(tmp_path, "2xcpu", None)
    groups = planned.batch.prompts_per_generation
    assert groups >= 2 and planned.early_backward_groups == groups and "every open group" in _early(tmp_path)[1]
    terms = planned.trainer.memory_terms["terms"]
    assert terms["early_backward_sums"] == pytest.approx(2 * groups * terms["gradients"], abs=1e-5)
    # a plan written before the groups setting budgeted the last group's sums only: one group at a time
    planned.settings[:] = [x for x in planned.settings if x.name != "overlap.early_backward_groups"]
    assert planned.early_backward is True and planned.early_backward_groups == 1
    assert _early(tmp_path, loss_type="cispo")[0] is True
    on, why = _early(tmp_path, ogrpo={"early_backward": "off"})  # costly rewards: a completion scored alone too
    assert on is False and "ogrpo.early_backward: off" in why
    for keys, words in ((dict(loss_type="vespo"), "importance-sampling correction"),
                        (dict(off_policy_mask_threshold=0.5), "off-policy mask"), (dict(delta=1.0), "delta")):
        assert _plan(tmp_path, **keys)[0] is True, keys
        on, why = _early(tmp_path, **keys)
        assert on is False and "waits for the whole group" in why and words in why, (keys, why)
    # sapo's temperature reads the advantage's sign, its slope at a ratio of 1 does not; vespo's weight is 1 there
    # for either sign unless the sampler's ratio moves it
    for keys in (dict(loss_type="sapo"), dict(loss_type="vespo", vllm_importance_sampling_correction=False)):
        assert _early(tmp_path, **keys)[0] is True, keys
    on, why = _plan(tmp_path, gpus="3xcpu")  # two trainer processes under DDP: each trains its own groups
    assert on is True and "2 trainer processes" in why and "averaged once" in why
    on, why = _early(tmp_path, gpus="3xcpu", ogrpo={"early_backward": "auto"})  # the ranks take whole groups
    assert on is False and "2 trainer processes" in why and "whole groups" in why, why
    on, why = _early(tmp_path, gpus="2xA40")  # a GPU job runs TRL 1.9.2, whose own server answers whole groups
    assert on is False and "before TRL 1.16" in why, why
    # nothing to train ahead where nothing streams: one-step, off, no server
    assert _plan(tmp_path, ogrpo={"overlap": "one-step"}) == (None, None)
    assert _plan(tmp_path, gpus="cpu") == (None, None)
    # without the importance-sampling correction TRL runs no old-policy pass: nothing stands in the way
    assert _plan(tmp_path, vllm_importance_sampling_correction=False)[0] is True


def test_the_early_backward_holds_as_many_groups_sums_as_fit_and_is_off_where_none_fit():
    from ogrpo.planner.train_ahead import decide_early_backward

    trl_get = {"loss_type": "dapo", "off_policy_mask_threshold": None, "delta": None}.get
    on, why, held = decide_early_backward(None, trl_get, sums_gib=2.0, room_gib=1.5, groups=4)
    assert (on, held) == ("off", 0) and "2.00 GiB" in why and "1.50 GiB" in why
    on, why, held = decide_early_backward("auto", trl_get, sums_gib=1.0, room_gib=1.5, groups=4)
    assert (on, held) == ("on", 1) and "1 of the batch's 4 groups" in why and "1.00 GiB" in why
    on, why, held = decide_early_backward("auto", trl_get, sums_gib=1.0, room_gib=3.5, groups=4)
    assert (on, held) == ("on", 3) and "3 of the batch's 4 groups" in why and "3.00 GiB" in why
    on, why, held = decide_early_backward(None, trl_get, sums_gib=1.0, room_gib=64.0, groups=4)
    assert (on, held) == ("on", 4) and "every open group" in why


def test_the_trainer_keeps_trls_order_where_only_it_sees_why():
    import torch

    from ogrpo.overlap.train_ahead import why_not

    def trainer(**kw):
        base = dict(loss_type="dapo", scale_rewards="group", multi_objective_aggregation="sum_then_normalize",
                    top_entropy_quantile=1.0, accelerator=SimpleNamespace(num_processes=1), reward_funcs=[len],
                    beta=0.0, ref_model=None, use_vllm=True, vllm_importance_sampling_correction=True,
                    old_policy=object(), model=torch.nn.Linear(2, 2), args=SimpleNamespace(optim="adamw_torch"))
        base.update(kw)
        return SimpleNamespace(**base)

    assert why_not(trainer()) is None
    assert "dropout" in why_not(trainer(model=torch.nn.Sequential(torch.nn.Dropout(0.1))))

    class AttentionDropout(torch.nn.Linear):  # applied functionally: no module, only the config says so
        config = SimpleNamespace(to_dict=lambda: {"attention_dropout": 0.1, "use_cache": True})

    assert "dropout" in why_not(trainer(model=AttentionDropout(2, 2)))
    assert "reward model" in why_not(trainer(reward_funcs=[torch.nn.Linear(1, 1)]))
    assert "PEFT" in why_not(trainer(beta=0.04))  # no reference model of its own: adapters disabled
    assert why_not(trainer(beta=0.04, ref_model=torch.nn.Linear(2, 2))) is None
    assert "separate pass" in why_not(trainer(old_policy=None))
    assert why_not(trainer(old_policy=None, vllm_importance_sampling_correction=False)) is None
    assert "LOMO" in why_not(trainer(args=SimpleNamespace(optim="lomo")))
    assert "aux loss" in why_not(trainer(aux_loss_enabled=True))


def test_a_group_trains_in_chunks_of_a_micro_batchs_positions_never_fewer_rows():
    from ogrpo.overlap.train_ahead import chunk_rows

    # TRL's micro-batch: 2 rows, planned at a 5-token prompt and 10-token completions: 30 positions
    assert chunk_rows(2, 5, 10, 10) == 2  # the group's longest is the cap: TRL's rows
    assert chunk_rows(2, 5, 2, 10) == 4  # short completions: 4 rows of 7 positions fit in 30
    assert chunk_rows(8, 100, 300, 256) == 8  # longer than planned (a prompt over its budget): still TRL's rows
    assert chunk_rows(4, 0, 0, 0) == 4


def test_completions_forwarded_as_they_end_hold_graphs_only_within_a_micro_batchs_positions():
    """A completion's loss forward runs as it ends only while the graphs held leave room, inside the positions a
    group's chunk holds at the cap (TRL's micro-batch, or the group if smaller), for one more row at the cap: a
    chunk always fits beside them, and the peak stays where it was."""
    import torch

    from ogrpo.overlap.train_ahead import TrainAhead

    forwards = []

    def logps_beneath(model, ids, mask, length, compute_entropy=False):
        forwards.append(ids.size(1))
        return torch.zeros(ids.size(0), length, requires_grad=True), torch.zeros(ids.size(0), length), None

    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    trainer = SimpleNamespace(
        args=SimpleNamespace(per_device_train_batch_size=3), max_completion_length=4, num_generations=4,
        accelerator=SimpleNamespace(num_processes=1, device="cpu"), processing_class=tok, eos_token_ids=[1],
        mask_truncated_completions=False, overlap=SimpleNamespace(forwards_answered=0, timeline=None),
        model_wrapped=None, compute_loss_context_manager=contextlib.nullcontext, logps_beneath=logps_beneath)
    ahead = TrainAhead(trainer, work=None, prompt_ids=[[7, 8]] * 8, width=2)
    assert ahead.budget == 3 * (2 + 4)  # 18 positions; one row at the cap takes 6
    ahead.part_arrived(0, 0, {"completion_ids": [[5, 1]]})  # 4 positions: 4 + 6 <= 18
    ahead.part_arrived(1, 2, {"completion_ids": [[5, 5, 5, 1]]})  # 6 more: 10 + 6 <= 18
    ahead.part_arrived(0, 1, {"completion_ids": [[5, 1]]})  # 4 more would leave 16 + 6 > 18: not now
    assert forwards == [4, 6] and ahead.held == 10
    trainer.args.per_device_train_batch_size = 8  # more rows than a group's: the group's 4 rows bound it
    assert TrainAhead(trainer, work=None, prompt_ids=[[7, 8]] * 8, width=2).budget == 4 * 6
    assert sorted(ahead.forwards) == [0, 1] and list(ahead.forwards[1]) == [2]
    assert ahead.forwards[0][0].logps.requires_grad  # its graph kept for the group's backward


@pytest.mark.slow
@pytest.mark.parametrize("case", AHEAD)
def test_groups_trained_ahead_train_exactly_as_trls_micro_batches(tmp_path, case):
    """Per loss type and importance-sampling mode, chunked groups and shuffled micro-batches: every logged value and
    the final weights as TRL's own passes, with every group of every batch trained ahead (the plan's defaults:
    the old policy from the loss forward, packed passes)."""
    assert_same_training(tmp_path, case, from_loss=True, packed=True, ahead=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["grpo-beta", "dapo-chunked"])
def test_groups_trained_ahead_computing_their_prompt_once_train_as_trls_micro_batches(tmp_path, case):
    """A group trained ahead is one prompt's generations: its passes compute that prompt once."""
    assert_same_training(tmp_path, case, from_loss=True, packed=True, ahead=True, shared=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["grpo-beta", "dapo-chunked"])
def test_completions_scored_as_each_ends_train_exactly_as_trls_micro_batches(tmp_path, case):
    """Each group's completions come back one by one (ogrpo.serve.client.group_calls per_completion): the
    reference pass runs on each as it ends, the group's pass only on its last; the run trains as TRL's."""
    assert_same_training(tmp_path, case, from_loss=True, packed=True, ahead=True, completions=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["grpo-beta", "dr_grpo", "dapo-masked", "cispo", "luspo", "grpo-chunked",
                                  "grpo-checkpointed", "sapo", "vespo", "vespo-uncorrected"])
def test_completions_run_their_backward_as_they_end_and_train_as_trls_micro_batches(tmp_path, case):
    """Group after group: each completion but a group's last runs its backward as it ends, with its own rewards
    (the gradient is linear in the advantage: ogrpo/overlap/early_backward.py, sapo's too), and the run trains as
    TRL's; vespo with vLLM's importance-sampling correction weighs a row by its advantage's sign, so there the
    group's backward waits for the group (checked: no row ran early), without it every row but the last runs
    (and TRL runs no old-policy pass to take from the loss forward)."""
    assert_same_training(tmp_path, case, from_loss=case != "vespo-uncorrected", packed=True, ahead=True,
                         completions="interleaved")


@pytest.mark.slow
@pytest.mark.parametrize("early_groups", [None, 1])
def test_completions_of_groups_open_together_run_their_backward_as_they_end(tmp_path, monkeypatch, early_groups):
    """Every group's completions end in one scrambled order, as a server's batch ends them: each but a group's
    last runs its backward as it ends, its group's two gradient sums held beside the other open groups'; where the
    plan fits the sums of one group only, no more are ever held at once (another group's rows wait for them to
    close). Both train as TRL's."""
    from ogrpo.overlap.train_ahead import TrainAhead

    held = []
    real = TrainAhead.summing

    def summing(self, group):
        out = real(self, group)
        held.append(len(self.summed))
        return out

    monkeypatch.setattr(TrainAhead, "summing", summing)
    assert_same_training(tmp_path, "grpo-beta", from_loss=True, packed=True, ahead=True, completions=True,
                         early_groups=early_groups)
    assert max(held) == (early_groups or 2), held  # the tiny batch's 2 groups


@pytest.mark.slow
def test_kl_terms_still_waiting_when_their_group_closes_run_before_it_and_train_as_trl(tmp_path, monkeypatch):
    """An early row's KL term (beta > 0) is a second backward that waits for the trainer's next free moment; where
    none comes before its group is whole, the group runs them first, and the run still trains as TRL's."""
    from ogrpo.overlap import train_ahead

    waiting = []
    real_train, real_waiting_on = train_ahead.TrainAhead._train, train_ahead.TrainAhead.waiting_on

    def _train(self, *args):
        waiting.append(len(self.kl))
        return real_train(self, *args)

    monkeypatch.setattr(train_ahead.TrainAhead, "_train", _train)
    # never free: the scripted server wakes the trainer only for rewards
    monkeypatch.setattr(train_ahead.TrainAhead, "waiting_on",
                        lambda self: [f for f in real_waiting_on(self) if f is not train_ahead.DONE])
    assert_same_training(tmp_path, "grpo-beta", from_loss=True, packed=True, ahead=True, completions="interleaved")
    assert max(waiting) >= 1, waiting


@pytest.mark.slow
def test_a_batch_other_than_the_groups_drops_their_gradients_and_trains_as_trl(tmp_path, monkeypatch):
    """Fails closed: where TRL's batch differs from what the groups trained on (here: every group's advantages
    are off by 1), the groups' gradients are dropped and TRL's own micro-batches train, as under `off`."""
    import math

    from lossless_checks import run
    from ogrpo.overlap import train_ahead

    real = train_ahead.advantages
    monkeypatch.setattr(train_ahead, "advantages", lambda *a: real(*a) + 1.0)
    theirs, _, _, _ = run(tmp_path / "trl", "grpo-beta")
    ours, _, _, trainer = run(tmp_path / "ahead", "grpo-beta", from_loss=True, ahead=True)
    assert [r["overlap/trained_ahead"] for r in ours] == [0.0, 0.0]
    assert len(trainer.overlap.train_ahead_fallbacks) == 2
    assert all("differs" in why for why in trainer.overlap.train_ahead_fallbacks)
    for x, y in zip(theirs, ours):
        for key in ("loss", "grad_norm", "reward", "entropy"):
            assert math.isclose(y[key], x[key], rel_tol=1e-5, abs_tol=1e-6), (key, x[key], y[key])


@pytest.mark.slow
def test_a_reward_that_reads_its_batch_runs_the_early_rows_again_and_trains_as_trl(tmp_path, monkeypatch):
    """Early rows take their rewards from the reward function on each completion alone; one
    that reads its batch gives the group other rewards (here: scaled by the batch's size up to a group's, so that
    the groups streamed still score as TRL's batch). Those rows' advantage terms then run again from a fresh
    forward with the group's advantages, and the run still trains as TRL's."""
    import functools
    import math

    from lossless_checks import PACKED, run
    from ogrpo import tiny

    real = tiny.letter_reward

    @functools.wraps(real)
    def by_batch(*args, **kwargs):
        values = real(*args, **kwargs)
        return [v * min(len(values), 4) for v in values]

    monkeypatch.setattr(tiny, "letter_reward", by_batch)
    theirs = run(tmp_path / "trl", "grpo-beta")[0]
    ours, _, _, trainer = run(tmp_path / "ahead", "grpo-beta", from_loss=True, packed=True, ahead=True,
                              completions="interleaved")
    for x, y in zip(theirs, ours):
        for key in ("loss", "grad_norm", "reward", "entropy", "kl"):
            assert math.isclose(y[key], x[key], rel_tol=PACKED["rel"], abs_tol=PACKED["abs"]), (key, x[key], y[key])
    groups = trainer.args.generation_batch_size // trainer.num_generations
    assert [r["overlap/backward_early"] for r in ours] == [3.0 * groups] * 2
    assert len(trainer.overlap.early_backward_redone) == 2 * groups, trainer.overlap.early_backward_redone
    assert all("differ from their group's" in why for why in trainer.overlap.early_backward_redone)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_groups_trained_ahead_under_zero_train_as_trl_and_drop_their_gradients_where_its_batch_differs(tmp_path,
                                                                                                     stage):
    """Under DeepSpeed ZeRO-2/3 (ogrpo/overlap/deepspeed_ahead.py) each group's chunks (2 rows, 4 micro-batches a
    step, dapo: the batch's token count divides the gradients at the step, through the engine's loss scale) run
    their backward through the engine as the group arrives; the replayed micro-batches close the accumulation and
    step: TRL's losses, grad norms and metrics. Where TRL's batch differs from what the groups trained on (every
    advantage off by 1), the engine's gradients are dropped and TRL's micro-batches train, as under `off`."""
    from zero_lossless import assert_trained_ahead_as_trl

    assert_trained_ahead_as_trl(tmp_path, stage)


def test_the_replaying_engine_steps_once_at_the_boundary_divides_there_and_stops_on_a_lost_gradient():
    """ogrpo/overlap/deepspeed_ahead.py's wrapper, against a recording engine: a replayed micro-batch before the
    boundary runs nothing; the one at the boundary runs one backward and the step, the loss scale multiplied by the
    divisor only during the step; a step whose norm is 0 where the groups had advantages stops the run; a
    micro-batch that is not replayed goes through accelerate's own wrapper."""
    import torch

    from ogrpo.overlap import deepspeed_ahead
    from ogrpo.overlap.pipeline import OverlapError

    class Engine:
        def __init__(self, norm):
            self.calls, self.norm = [], norm
            self.optimizer = SimpleNamespace(loss_scaler=SimpleNamespace(cur_scale=1.0))
            self.module = torch.nn.Linear(2, 2)

        def set_gradient_accumulation_boundary(self, is_boundary):
            self.calls.append(("boundary", is_boundary))

        def backward(self, loss, **kwargs):
            self.calls.append(("backward", float(loss)))

        def step(self):
            self.calls.append(("step", self.optimizer.loss_scaler.cur_scale))

        def zero_optimization_stage(self):
            return 2

        def get_global_grad_norm(self):
            return self.norm

    state = SimpleNamespace(replayed=True, gradient_divisor=7.0, trained_norm_expected=True)
    engine = Engine(norm=3.0)
    wrapper = deepspeed_ahead.ReplayingEngine(engine, state)
    wrapper.backward(torch.tensor(5.0), sync_gradients=False)
    assert engine.calls == [] and state.replayed is False
    state.replayed = True
    wrapper.backward(torch.tensor(5.0), sync_gradients=True)
    assert engine.calls == [("boundary", True), ("backward", 5.0), ("step", 7.0)]
    assert engine.optimizer.loss_scaler.cur_scale == 1.0
    lost = Engine(norm=0.0)
    state.replayed = True
    with pytest.raises(OverlapError, match="no gradient"):
        deepspeed_ahead.ReplayingEngine(lost, state).backward(torch.tensor(1.0), sync_gradients=True)
    plain = Engine(norm=3.0)
    deepspeed_ahead.ReplayingEngine(plain, state).backward(torch.tensor(2.0), sync_gradients=True)
    assert plain.calls == [("boundary", True), ("backward", 2.0), ("step", 1.0)]  # accelerate's: no divisor


@pytest.mark.parametrize("case", ["grpo-beta", "dapo-chunked", *UNCHECKPOINTED])
def test_completions_scored_on_their_prefixes_as_they_stream_train_exactly_as_trls_micro_batches(tmp_path, case):
    """Each completion's reference pass runs in pieces on its tokens so far while it generates
    (ogrpo/overlap/prefixes.py), the rest when it ends, and without gradient checkpointing its loss forward too,
    its graph kept through the cache: the run trains as TRL's."""
    assert_same_training(tmp_path, case, from_loss=True, packed=True, ahead=True, completions="interleaved",
                         prefixes=True)


def test_loss_forwards_on_prefixes_through_the_linear_logprobs_kernel_train_exactly_as_trls_micro_batches(tmp_path):
    """Where the kernel scores the policy, a completion's loss forward on its prefix goes through it, as its
    forward at its end would: the run still trains as TRL's."""
    assert_same_training(tmp_path, "grpo-uncheckpointed", from_loss=True, packed=True, kernel=True, ahead=True,
                         completions="interleaved", prefixes=True)


@pytest.mark.parametrize("case", ["grpo-beta", "grpo-uncheckpointed"])
def test_a_prefix_whose_pass_fails_leaves_its_completion_to_run_whole_and_trains_as_trl(tmp_path, monkeypatch,
                                                                                          capsys, case):
    """A piece that raises (here every completion's last): its completion's pass (and, without checkpointing, its
    loss forward) runs whole at its end, the run trains as TRL's, and the failure is said once."""
    from ogrpo.overlap.prefixes import IncrementalPass

    def broken(self, completion):
        raise RuntimeError("no cache here")

    monkeypatch.setattr(IncrementalPass, "finish", broken)
    assert_same_training(tmp_path, case, from_loss=True, packed=True, ahead=True, completions="interleaved",
                         prefixes="failing")
    assert capsys.readouterr().err.count("a completion's pass on its prefix failed (RuntimeError: no cache") == 1
