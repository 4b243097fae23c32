"""Built-in tiny tasks (tiny-math, tiny-code): deterministic rows, gold answers and test cases that the real
rewards accept for a correct completion and reject for a wrong one, the warm-started task models
(`ogrpo:tiny-math`, `ogrpo:tiny-code`) that write answers in the recipes' format, recipes that plan, and (slow)
both recipes end to end through `ogrpo submit --backend local` with every reward taking non-zero values."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ogrpo import tiny
from ogrpo.tasks import task_rows, tiny_code, tiny_math
from ogrpo.rewards.registry import resolve_reward

OGRPO = str(Path(sys.executable).with_name("ogrpo"))
RECIPES = Path(__file__).resolve().parents[1] / "ogrpo" / "recipes"


def test_rows_are_deterministic_and_have_the_reward_columns():
    assert task_rows("ogrpo:tiny-math") == task_rows("ogrpo:tiny-math")
    assert tiny_math.rows(16, seed=1) != tiny_math.rows(16, seed=0)
    assert set(task_rows("ogrpo:tiny-math")[0]) == {"prompt", "solution"}
    assert set(task_rows("ogrpo:tiny-code")[0]) == {"prompt", "verification_info"}
    golds = [r["solution"] for r in tiny_math.rows()]
    # every gold form the accuracy reward must parse occurs: \boxed{n}, plain n, \frac{p}{q}
    assert any(g.startswith("\\boxed{") for g in golds) and any(g.lstrip("-").isdigit() for g in golds)
    assert any(g.startswith("\\frac{") for g in golds)
    info = tiny_code.rows(1)[0]["verification_info"]
    assert info["language"] == "python" and len(info["test_cases"]) == 3
    assert set(info["test_cases"][0]) == {"input", "output", "type"}


def test_tiny_math_gold_answers_verify_against_correct_and_wrong_completions():
    rows = tiny_math.rows(48)
    right = [tiny_math.reference_completion(r) for r in rows]
    wrong = [c.replace("\\boxed{", "\\boxed{1+") for c in right]  # every answer off by one
    golds = [r["solution"] for r in rows]
    assert resolve_reward("accuracy")(completions=right, solution=golds) == [1.0] * len(rows)
    assert resolve_reward("accuracy")(completions=wrong, solution=golds) == [0.0] * len(rows)
    assert resolve_reward("format")(completions=right) == [1.0] * len(rows)
    # decimals (5/8 -> 0.625) are scored equal to the fraction gold: the check is symbolic, not textual
    assert any("0.625" in c or ".5}" in c for c in right)


@pytest.mark.slow
def test_tiny_code_test_cases_pass_the_reference_programs_in_the_sandbox():
    rows = tiny_code.rows(8)
    from ogrpo.sandbox.pool import Limits

    right = [tiny_code.reference_completion(r) for r in rows]
    wrong = [c.replace("print(", "print(1 + ", 1) if "print(w" not in c else c.replace("w[::-1]", "w")
             for c in right]
    infos = [r["verification_info"] for r in rows]
    code = resolve_reward("code", {"code_language": "python"})
    # open-r1's 5 s per case can pass on a CI box shared by many jobs: one reference case once timed out here
    roomy = Limits(wall_s=60.0, cpu_s=30)
    assert code(completions=right, verification_info=infos, limits=roomy) == [1.0] * len(rows)
    got = code(completions=wrong, verification_info=infos, limits=roomy)
    # a wrong program fails every case, except a palindrome word whose reversal is itself (2 or 3 of 3 cases)
    assert all(g < 1.0 for g, r in zip(got, rows) if "reversed" not in r["prompt"])
    assert resolve_reward("binary_code")(completions=right, verification_info=infos, limits=roomy) == [1.0] * len(rows)
    assert resolve_reward("code_format")(completions=right) == [1.0] * len(rows)


def test_task_models_are_builtin_models_with_their_own_cache_key(monkeypatch):
    assert tiny.builtin_model("ogrpo:tiny-math") == "ogrpo:tiny-math"
    assert tiny.builtin_model(" OGRPO:Tiny-Code ") == "ogrpo:tiny-code"
    assert tiny.builtin_model("tiny") == tiny.TINY_NAME and tiny.builtin_model("Qwen/Qwen2.5-0.5B") is None
    # is_tiny stays the letters model/dataset: the tiny-math dataset is not the letters prompts
    assert not tiny.is_tiny("ogrpo:tiny-math")
    letters, math_, code = (tiny.spec_hash(n) for n in (tiny.TINY_NAME, "ogrpo:tiny-math", "ogrpo:tiny-code"))
    assert len({letters, math_, code}) == 3
    assert tiny.model_config("ogrpo:tiny-math")["vocab_size"] == tiny_math.WARM["vocab_size"]
    # a changed warm start re-keys its own model only; the letters model (tests/test_tiny.py) is untouched
    monkeypatch.setitem(tiny_math.WARM, "steps", tiny_math.WARM["steps"] + 1)
    assert tiny.spec_hash("ogrpo:tiny-math") != math_ and tiny.spec_hash() == letters
    assert tiny.model_dir("ogrpo:tiny-code").name == f"tiny-code-{code}"

    from ogrpo.models import resolve_model

    facts = resolve_model("ogrpo:tiny-code")  # the planner reads the spec without building the model
    assert facts.name == "ogrpo:tiny-code"


@pytest.mark.slow
def test_warm_examples_mix_right_and_wrong_answers_in_the_recipe_format():
    math_ex = tiny_math.warm_examples()
    golds = {r["prompt"]: r["solution"] for r in tiny_math.rows()}
    acc = resolve_reward("accuracy")(completions=[c for _, c in math_ex], solution=[golds[p] for p, _ in math_ex])
    assert resolve_reward("format")(completions=[c for _, c in math_ex]) == [1.0] * len(math_ex)
    # WARM["correct"] of the answers are right, the others off by one (binomial spread over 256 rows: < 0.1)
    assert abs(sum(acc) / len(acc) - tiny_math.WARM["correct"]) < 0.1, sum(acc) / len(acc)

    from ogrpo.sandbox.pool import Limits

    code_ex = tiny_code.warm_examples(24)
    infos = {r["prompt"]: r["verification_info"] for r in tiny_code.rows()}
    got = resolve_reward("code", {"code_language": "python"})(
        completions=[c for _, c in code_ex], verification_info=[infos[p] for p, _ in code_ex],
        limits=Limits(wall_s=60.0, cpu_s=30))
    assert resolve_reward("code_format")(completions=[c for _, c in code_ex]) == [1.0] * len(code_ex)
    assert 1.0 in got and min(got) < 1.0, got


@pytest.mark.parametrize("name", ["ogrpo:tiny-math", "ogrpo:tiny-code"])
def test_warm_model_writes_a_parsable_answer_greedily(name):
    """Greedy decoding on training prompts gives the recipe's format with an answer the rewards can read. The
    model is built into the shared cache on first use, later runs load it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny.ensure_model(name)
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    assert len(tok) == model.config.vocab_size == tiny.model_config(name)["vocab_size"]
    texts = []
    for row in task_rows(name)[:4]:
        enc = tok(row["prompt"], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=64, do_sample=False, pad_token_id=tok.pad_token_id)
        texts.append(tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    if name == "ogrpo:tiny-math":
        from math_verify import parse

        from ogrpo.rewards.math import _configs

        assert resolve_reward("format")(completions=texts) == [1.0] * len(texts), texts
        assert all(parse(t, extraction_config=_configs()[1]) for t in texts), texts  # what `accuracy` reads
    else:
        from ogrpo.rewards.code import extract_code

        assert resolve_reward("code_format")(completions=texts) == [1.0] * len(texts), texts
        assert all(extract_code(t).strip() for t in texts), texts  # the program `code` runs


@pytest.mark.parametrize("name", ["ogrpo:tiny-math", "ogrpo:tiny-code"])
def test_trainer_tokenizer_gives_the_warm_start_ids(name):
    """transformers 5 loads a qwen2 model's tokenizer as Qwen2Tokenizer, which replaces tokenizer.json's
    pre-tokenizer with Qwen2's (digits one by one). The warm start trained on tokenizer.json's pipeline; both
    must give the same ids, or the model reads its training prompts as unseen input (it did: garbled output)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = tiny.ensure_model(name)
    built, loaded = Tokenizer.from_file(str(path / "tokenizer.json")), AutoTokenizer.from_pretrained(path)
    task = tiny_math if name == "ogrpo:tiny-math" else tiny_code
    for text in [t for pair in task.warm_examples(32) for t in pair]:
        assert built.encode(text).ids == loaded(text, add_special_tokens=False)["input_ids"], text


@pytest.mark.slow
def test_concurrent_builds_leave_one_complete_model(tmp_path):
    """Two processes asking for one model at once (server and trainer, DDP ranks): one builds, the other waits
    on the lock and reads its result; no partial or temporary directory is left. The letters model is the
    cheapest built-in model to build; the task models go through the same ensure_model."""
    code = "import sys; from ogrpo import tiny; print(tiny.ensure_model('ogrpo:tiny', sys.argv[1]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    paths = {p.communicate(timeout=300)[0].strip().splitlines()[-1] for p in procs}  # after import-time chatter
    assert all(p.returncode == 0 for p in procs)
    assert paths == {str(tmp_path / f"tiny-{tiny.spec_hash()}")}
    built = Path(paths.pop())
    assert (built / "model.safetensors").is_file() and (built / "tokenizer.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [built.name]


@pytest.mark.parametrize("recipe", ["tiny-math", "tiny-code"])
def test_recipes_plan(run_cli, recipe):
    proc = run_cli("plan", "--config", recipe, "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["fits"] is True


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("recipe, rewards, varying", [
    ("tiny-math", ("accuracy", "format", "length"), "length"),
    ("tiny-code", ("code", "code_format", "soft_overlong_punishment"), "soft_overlong_punishment"),
])
def test_tiny_task_runs_end_to_end_through_submit_local(tmp_path, recipe, rewards, varying):
    cfg = yaml.safe_load((RECIPES / f"{recipe}.yaml").read_text())
    # 2 steps of 4 prompts x 4: 32 completions, so a model right ~20% of the time is right at least once
    cfg.update({"max_steps": 2, "save_steps": 100, "per_device_train_batch_size": 16})
    path = tmp_path / f"{recipe}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    job = tmp_path / "job"
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run([OGRPO, "submit", "--backend", "local", "--gpus", "cpu", "--config", str(path),
                           "--output", str(job)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [r for r in _jsonl(job / "run" / "metrics.jsonl") if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for name in rewards:
            mean, std = row[f"rewards/{name}/mean"], row[f"rewards/{name}/std"]
            assert math.isfinite(mean) and math.isfinite(std), (name, row)
        assert 0.0 <= row[f"rewards/{rewards[0]}/mean"] <= 1.0
    # the warm-started model answers in the recipe's format, right only part of the time: every reward is
    # non-zero in at least one step (for `code`, a passing program was run in the sandbox)
    for name in rewards[:2]:
        assert max(r[f"rewards/{name}/mean"] for r in rows) > 0, (name, rows)
    # the length-shaped reward sees completions of different lengths, so it varies within a group in a step
    assert max(r[f"rewards/{varying}/std"] for r in rows) > 0, rows
    profile = _jsonl(job / "run" / "profile.jsonl")
    assert all(r["reward_s"] > 0 for r in profile)
