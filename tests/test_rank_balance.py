"""Generation batches balanced across the trainer's ranks by tokens (ogrpo/trainer/rank_balance.py): the rule, the
exchange over a real process group, and two-process training runs that learn exactly what TRL's split learns."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ogrpo.config import load_run_config
from ogrpo.launch.ports import free_ports
from ogrpo.launch.procs import mentioning
from ogrpo.plan import plan_from_config
from ogrpo.trainer.rank_balance import assignment, spread

REPO = Path(__file__).resolve().parents[1]
OGRPO = str(Path(sys.executable).with_name("ogrpo"))
STEPS = 3


def test_each_rank_keeps_its_number_of_rows_and_the_most_tokens_a_rank_holds_falls():
    rng = random.Random(0)
    for ranks in (2, 3, 4, 8):
        for _ in range(50):
            per = rng.randint(1, 12)
            costs = [min(256, int(rng.expovariate(1 / 60)) + 1) for _ in range(ranks * per)]
            placed = assignment(costs, ranks)
            given = [list(range(r * per, (r + 1) * per)) for r in range(ranks)]
            if placed is None:  # nothing better than TRL's split was found
                continue
            assert sorted(i for rows in placed for i in rows) == list(range(ranks * per))
            assert all(len(rows) == per for rows in placed)
            assert spread(costs, placed) < spread(costs, given)
            assert assignment(costs, ranks) == placed  # every rank computes the same answer
    # the rows of one rank are 4x another's: the longest go to different ranks
    costs = [100, 100, 100, 100, 25, 25, 25, 25]
    placed = assignment(costs, 2)
    assert spread(costs, placed) == 1.0 and spread(costs, [[0, 1, 2, 3], [4, 5, 6, 7]]) == 1.6


def test_an_even_split_is_left_as_it_is():
    assert assignment([10, 20, 20, 10], 2) is None  # 30 / 30 already
    assert assignment([5] * 8, 4) is None
    assert assignment([7, 3], 1) is None
    assert assignment([1, 2, 3], 2) is None  # rows that do not divide: not TRL's batch


def _plan(tmp_path, **keys):
    recipe = yaml.safe_load((REPO / "ogrpo" / "recipes" / "tiny.yaml").read_text())
    ogrpo = {**recipe.pop("ogrpo"), "gpus": "2xcpu", **keys.pop("ogrpo", {})}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**recipe, **keys, "ogrpo": ogrpo}))
    return plan_from_config(load_run_config(str(path)))


def test_the_plan_balances_ranks_exactly_where_a_rows_weight_does_not_depend_on_its_rank(tmp_path):
    p = _plan(tmp_path)
    assert p.trainer.num_processes == 2 and p.rank_balance is True
    assert "2 trainer processes" in p.reason_of("rank_balance") and "loss_type" in p.reason_of("rank_balance")
    for keys, why in (({"loss_type": "bnpo"}, "each micro-batch's token count"),
                      ({"top_entropy_quantile": 0.2}, "quantile"),
                      ({"ogrpo": {"rank_balance": "off"}}, "ogrpo.rank_balance: off")):
        q = _plan(tmp_path, **keys)
        assert q.rank_balance is False and why in q.reason_of("rank_balance"), keys
    assert _plan(tmp_path, ogrpo={"gpus": "cpu"}).rank_balance is None  # one process: nothing to balance


EXCHANGE = r"""
import json, os, sys
import torch, torch.distributed as dist
from accelerate import Accelerator
from ogrpo.trainer.rank_balance import BalanceState, exchange

acc = Accelerator(cpu=True)
rank = acc.process_index
# rank 0: long completions, rank 1: short ones; rows tagged by their global index
lengths = [[9, 8, 7, 6], [1, 2, 1, 3]][rank]
prompts = [[2, 3, 3, 2], [4, 1, 2, 2]][rank]
rows, pw, cw = 4, max(prompts), max(lengths)
out = {"prompt_ids": torch.zeros(rows, pw, dtype=torch.long), "prompt_mask": torch.zeros(rows, pw, dtype=torch.long),
       "completion_ids": torch.zeros(rows, cw, dtype=torch.long),
       "completion_mask": torch.zeros(rows, cw, dtype=torch.long),
       "advantages": torch.arange(rows, dtype=torch.float) + 10 * rank,
       "sampling_per_token_logps": torch.zeros(rows, cw),
       "importance_sampling_ratio": torch.ones(rows, 1) * (rank + 1),
       "num_items_in_batch": torch.tensor(99.0)}
for i in range(rows):
    g = rank * rows + i
    out["prompt_ids"][i, pw - prompts[i]:] = 100 + g
    out["prompt_mask"][i, pw - prompts[i]:] = 1
    out["completion_ids"][i, :lengths[i]] = 200 + g
    out["completion_mask"][i, :lengths[i]] = 1
    out["sampling_per_token_logps"][i, :lengths[i]] = -g
state = BalanceState()
new = exchange(type("T", (), {"accelerator": acc})(), out, state)
got = {k: v.tolist() for k, v in new.items()}
with open(sys.argv[1] + f".{rank}", "w") as f:
    json.dump({"out": got, "state": state.summary()}, f)
dist.destroy_process_group()  # left to interpreter teardown, gloo's threads abort the process
"""


def test_the_ranks_exchange_whole_rows_over_a_real_process_group(tmp_path):
    script = tmp_path / "exchange.py"
    script.write_text(EXCHANGE)
    result = tmp_path / "result"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_ports(1)[0]), str(script), str(result)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert mentioning(str(script)) == []  # torchrun's workers are gone
    ranks = [json.loads(Path(f"{result}.{r}").read_text()) for r in (0, 1)]
    tokens, seen = [], []
    for r, got in enumerate(ranks):
        out = got["out"]
        assert len(out["prompt_ids"]) == 4 and out["num_items_in_batch"] == 99.0  # as many rows; the batch's count
        total = 0
        for i in range(4):
            ids = [x for x in out["prompt_ids"][i] if x]
            g = ids[0] - 100
            seen.append(g)
            # every tensor of a row came with it: ids, masks, advantages, log-probs, the ratio of its first rank
            assert ids == [100 + g] * len(ids) and sum(out["prompt_mask"][i]) == len(ids)
            assert out["prompt_ids"][i][-1] == 100 + g  # still left-padded
            comp = [x for x in out["completion_ids"][i] if x]
            assert comp == [200 + g] * len(comp) and out["completion_ids"][i][:len(comp)] == comp
            assert sum(out["completion_mask"][i]) == len(comp)
            assert out["sampling_per_token_logps"][i][:len(comp)] == [-g] * len(comp)
            assert out["advantages"][i] == (g % 4) + 10 * (g // 4)
            assert out["importance_sampling_ratio"][i] == [1 + g // 4]
            total += len(ids) + len(comp)
        # the widths are the rank's own longest prompt and completion (TRL's for a rank's batch)
        assert len(out["prompt_ids"][0]) == max(sum(m) for m in out["prompt_mask"])
        assert len(out["completion_ids"][0]) == max(sum(m) for m in out["completion_mask"])
        tokens.append(total)
        assert got["state"]["exchanged"] == 1 and got["state"]["batches"] == 1
    assert sorted(seen) == list(range(8))
    before = [2 + 3 + 3 + 2 + 9 + 8 + 7 + 6, 4 + 1 + 2 + 2 + 1 + 2 + 1 + 3]
    assert max(tokens) < max(before) and sum(tokens) == sum(before)
    assert ranks[0]["state"]["spread_after"] == pytest.approx(max(tokens) / (sum(tokens) / 2), abs=1e-4)


def _run(tmp_path: Path, name: str, **ogrpo) -> Path:
    recipe = yaml.safe_load((REPO / "ogrpo" / "recipes" / "tiny.yaml").read_text())
    # 2 ranks x 16 completions; completions up to 24 tokens, so their lengths vary between the ranks
    recipe.update({"max_steps": STEPS, "save_steps": 100, "per_device_train_batch_size": 16, "num_generations": 8,
                   "max_completion_length": 24})
    recipe["ogrpo"].update({"gpus": "2xcpu", **ogrpo})
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(recipe))
    job = tmp_path / name
    proc = subprocess.run([OGRPO, "submit", "--backend", "local", "--gpus", "2xcpu", "--config", str(cfg),
                           "--output", str(job)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return job / "run"


def _metrics(run: Path) -> list[dict]:
    return [r for r in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip())
            if "loss" in r]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_balanced_ranks_learn_what_trls_split_learns(tmp_path, strategy):
    """Two trainer processes (gloo; DDP, or ZeRO-3 whose ranks run every pass in step), TRL's split against the
    balanced one: the same losses, gradient norms and rewards step after step, and the ranks' tokens evener."""
    if strategy == "zero3":
        pytest.importorskip("deepspeed")
    runs = {name: _run(tmp_path, name, strategy=strategy, **keys)
            for name, keys in (("trl", {"rank_balance": "off"}), ("balanced", {}))}
    ours, theirs = _metrics(runs["balanced"]), _metrics(runs["trl"])
    assert len(ours) == len(theirs) == STEPS
    for x, y in zip(ours, theirs):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5), (x["step"], x["loss"], y["loss"])
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5), (x["step"], x["grad_norm"], y["grad_norm"])
        assert x["reward"] == pytest.approx(y["reward"], abs=1e-6)
        assert x["completions/mean_length"] == y["completions/mean_length"]
    assert len({round(r["loss"], 6) for r in ours}) > 1  # the steps differ: a lost update would show
    manifest = json.loads((runs["balanced"] / "manifest.json").read_text())
    balance = manifest["rank_balance"]
    assert balance["on"] is True and balance["batches"] == STEPS, balance
    assert balance["exchanged"] >= 1 and balance["spread_after"] < balance["spread_before"], balance
    assert mentioning(str(tmp_path)) == []  # no trainer process of either job outlives it
    off = json.loads((runs["trl"] / "manifest.json").read_text())["rank_balance"]
    assert off == {"on": False, "reason": "set in the run config (ogrpo.rank_balance: off): each rank computes the "
                                          "rows it sampled for"}
