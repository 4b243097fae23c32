"""Datasets as recipes name them: local files and save_to_disk directories, open-r1's prompt layout, open-r1 and TRL
mixtures, the HF hub cache; and the plan-time check (schema only, exit 2 naming the missing column or split)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ogrpo.errors import ConfigError, OgrpoError
from ogrpo.trainer.data import load_prompts
from ogrpo.trainer.data_sources import check_data, columns_of, file_columns, sources

ROWS = [{"problem": f"{i} + 1 = ?", "solution": str(i + 1), "messages": ["x"]} for i in range(10)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_file_columns_read_only_schemas(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_jsonl(tmp_path / "a.jsonl", ROWS)
    (tmp_path / "b.json").write_text(json.dumps(ROWS))  # one JSON array
    (tmp_path / "c.csv").write_text("problem,solution\n1+1,2\n")
    pq.write_table(pa.table({"problem": ["1+1"], "answer": ["2"]}), tmp_path / "d.parquet")
    (tmp_path / "e.jsonl").write_text("\n\n")
    assert file_columns(jsonl) == ["problem", "solution", "messages"]
    assert file_columns(tmp_path / "b.json") == ["problem", "solution", "messages"]
    assert file_columns(tmp_path / "c.csv") == ["problem", "solution"]
    assert file_columns(tmp_path / "d.parquet") == ["problem", "answer"]
    with pytest.raises(ValueError, match="empty"):
        file_columns(tmp_path / "e.jsonl")


def test_missing_columns_and_splits_are_named(tmp_path):
    from datasets import Dataset, DatasetDict

    saved = tmp_path / "saved"
    DatasetDict({"train": Dataset.from_list(ROWS), "test": Dataset.from_list(ROWS[:2])}).save_to_disk(str(saved))
    assert columns_of(sources({"dataset_name": str(saved)})[1][0]) == ["problem", "solution", "messages"]
    with pytest.raises(ConfigError) as info:
        check_data({"dataset_name": str(saved), "dataset_train_split": "validation"}, "problem", {})
    assert "has no split 'validation' (splits: train, test)" in str(info.value)
    with pytest.raises(ConfigError) as info:
        check_data({"dataset_name": str(saved)}, "question", {"verification_info": ["code"]})
    text = str(info.value)
    assert "has no 'question' column (columns: problem, solution, messages); set dataset_prompt_column" in text
    assert "has no 'verification_info' column" in text and "needed by reward code" in text
    assert check_data({"dataset_name": str(saved)}, "problem", {"solution": ["accuracy"]}) == []


def test_directory_of_split_files_and_the_hub_cache(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    snap = tmp_path / "hub" / "datasets--org--math" / "snapshots" / "abc123" / "data"
    snap.mkdir(parents=True)
    pq.write_table(pa.table({"problem": ["1+1"], "solution": ["2"]}), snap / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"problem": ["2+2"]}), snap / "test-00000-of-00001.parquet")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert check_data({"dataset_name": "org/math"}, "problem", {"solution": ["accuracy"]}) == []
    with pytest.raises(ConfigError, match="split 'test'.*no 'solution' column"):
        check_data({"dataset_name": "org/math", "dataset_train_split": "test"}, "problem", {"solution": ["accuracy"]})
    with pytest.raises(ConfigError, match="no files for split 'validation'"):
        check_data({"dataset_name": "org/math", "dataset_train_split": "validation"}, "problem", {})
    warnings = check_data({"dataset_name": "org/not-cached"}, "prompt", {})
    assert len(warnings) == 1 and "not in the local HF hub cache" in warnings[0]
    # a local directory of data files is read the same way
    assert check_data({"dataset_name": str(snap.parent)}, "problem", {}) == []


def test_open_r1_layout_prompt_column_and_system_prompt(tmp_path):
    data = write_jsonl(tmp_path / "math.jsonl", ROWS)
    ds = load_prompts({"dataset_name": str(data), "dataset_prompt_column": "problem", "system_prompt": "Be brief."})
    assert ds[3]["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 + 1 = ?"}]
    assert "messages" not in ds.column_names and ds[3]["solution"] == "4"  # other columns reach the rewards
    # open-r1 makes a conversation even without a system prompt
    ds = load_prompts({"dataset_name": str(data), "dataset_prompt_column": "problem"})
    assert ds[0]["prompt"] == [{"role": "user", "content": "0 + 1 = ?"}]
    # TRL's layout (no open-r1 key): the column is renamed to `prompt` and kept as text
    ds = load_prompts({"dataset_name": str(data)}, prompt_column="problem")
    assert ds[0]["prompt"] == "0 + 1 = ?"
    with pytest.raises(OgrpoError, match="no 'question' column .*set dataset_prompt_column"):
        load_prompts({"dataset_name": str(data), "dataset_prompt_column": "question"})


def test_open_r1_mixture_selects_weights_and_splits(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ROWS)
    b = write_jsonl(tmp_path / "b.jsonl", [{"problem": f"b{i}", "solution": "0", "source": "b"} for i in range(6)])
    mix = {"datasets": [{"id": str(a), "columns": ["problem", "solution"], "weight": 0.5},
                        {"id": str(b), "columns": ["problem", "solution"]}], "seed": 3}
    trl = {"dataset_mixture": mix, "dataset_prompt_column": "problem"}
    assert check_data(trl, "problem", {"solution": ["accuracy"]}) == []
    ds = load_prompts(trl)
    # int(10 * 0.5) rows of a + all 6 of b, shuffled; columns as selected plus the prompt
    assert len(ds) == 11 and sorted(ds.column_names) == ["problem", "prompt", "solution"]
    assert sum(p.startswith("b") for p in ds["problem"]) == 6
    assert load_prompts(trl)["problem"] == ds["problem"]  # seeded
    split = load_prompts({**trl, "dataset_mixture": {**mix, "test_split_size": 0.25}})
    assert len(split) == 8  # 11 rows, 25% (rounded up to 3) held out
    bad = {"dataset_mixture": {"datasets": [{"id": str(a), "columns": ["problem", "answer"]}]}}
    with pytest.raises(ConfigError, match=r"no column 'answer' to select \(columns: problem, solution, messages\)"):
        check_data(bad, "problem", {})


def test_trl_mixture_goes_through_trl_get_dataset(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ROWS)
    trl = {"datasets": [{"path": "json", "data_files": str(a), "columns": ["problem", "solution"]}]}
    kind, srcs = sources(trl)
    assert kind == "TRL mixture" and srcs[0].data_files == str(a)
    assert check_data(trl, "problem", {"solution": ["accuracy"]}) == []  # read from data_files
    with pytest.raises(ConfigError, match="no 'verification_info' column"):
        check_data(trl, "problem", {"verification_info": ["code"]})
    ds = load_prompts(trl, prompt_column="problem")
    assert len(ds) == 10 and sorted(ds.column_names) == ["prompt", "solution"]


def test_plan_with_a_missing_local_column_exits_2_naming_it(run_cli, write_recipe, tmp_path):
    data = write_jsonl(tmp_path / "q.jsonl", [{"question": "1+1", "answer": "2"}])
    recipe = write_recipe(f"model_name_or_path: ogrpo:tiny\ndataset_name: {data}\ndataset_prompt_column: question\n"
                          "reward_funcs: [accuracy, format]\nogrpo:\n  gpus: cpu\n")
    proc = run_cli("plan", "--config", recipe, "--gpus", "cpu")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "has no 'solution' column (columns: question, answer); needed by reward accuracy" in proc.stderr
    out = tmp_path / "job"
    proc = run_cli("render", "--config", recipe, "--gpus", "cpu", "-o", out)
    assert proc.returncode == 2 and "'solution' column" in proc.stderr and not out.exists()


@pytest.mark.parametrize("lines, plan_says, train_says", [
    ('{"prompt": "a"}\nnot json\n', "line 2 is not JSON", "cannot load"),
    ('{"prompt": 5}\n', "line 1: 'prompt' is int, not text", "column 'prompt' holds int64 values"),
    ('{"prompt": "a"}\n{"prompt": null}\n', "line 2: 'prompt' is null", "column 'prompt' has 1 empty (null) value"),
    ('{"prompt": [1, 2]}\n', "line 1: 'prompt' is list, not text", "column 'prompt' holds List(Value('int64'))"),
])
def test_prompts_that_are_no_text_nor_chat_are_refused_in_one_line(tmp_path, lines, plan_says, train_says):
    """Rows TRL's tokenizer fails on at the first step (after the model loaded), with a traceback: the plan reads
    the first rows of a local JSON-lines file, the trainer the loaded column's type and nulls (any source)."""
    data = tmp_path / "d.jsonl"
    data.write_text(lines)
    with pytest.raises(ConfigError, match=plan_says):
        check_data({"dataset_name": str(data)}, "prompt", {})
    with pytest.raises(OgrpoError, match=train_says.replace("(", r"\(").replace(")", r"\)")):
        load_prompts({"dataset_name": str(data)})
    data.write_text('{"prompt": "a"}\n{"prompt": [{"role": "user", "content": "b"}]}\n' * 40)  # both kinds
    assert check_data({"dataset_name": str(data)}, "prompt", {}) == []


def test_chat_prompts_need_a_chat_template(tmp_path, tiny_model_dir):
    """Chat prompts with a tokenizer that has no template: refused at start-up, not at the first step."""
    from ogrpo.trainer.assembly import prepare

    data = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}] * 8)
    recipe = {"model_name_or_path": "ogrpo:tiny", "dataset_name": str(data), "reward_funcs": ["tiny_letter"],
              "per_device_train_batch_size": 8, "num_generations": 8, "max_completion_length": 8,
              "ogrpo": {"gpus": "cpu", "use_vllm": False, "max_prompt_length": 32}}
    with pytest.raises(OgrpoError, match="the prompts are chat messages, and the tokenizer of .* has no chat "
                                         "template"):
        prepare(recipe, output_dir=tmp_path / "run")
    recipe["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert prepare(recipe, output_dir=tmp_path / "run").tokenizer.chat_template == recipe["chat_template"]


def test_plan_with_an_unknown_reward_exits_2_naming_it(run_cli, write_recipe):
    recipe = write_recipe("model_name_or_path: ogrpo:tiny\ndataset_name: ogrpo:tiny-math\n"
                          "reward_funcs: [accuracy, tag_cuont, my_missing_pkg.rewards:score]\nogrpo:\n  gpus: cpu\n")
    proc = run_cli("plan", "--config", recipe, "--gpus", "cpu")
    assert proc.returncode == 2, proc.stderr
    assert "unknown reward 'tag_cuont': did you mean 'tag_count'" in proc.stderr
    assert "cannot import module 'my_missing_pkg.rewards'" in proc.stderr and "Traceback" not in proc.stderr


def test_plan_time_check_imports_neither_datasets_nor_torch(tmp_path):
    data = write_jsonl(tmp_path / "q.jsonl", ROWS)
    code = ("import sys\nfrom ogrpo.config import load_run_config\nfrom ogrpo.trainer.inputs import check_inputs\n"
            f"rc = load_run_config({{'model_name_or_path': 'ogrpo:tiny', 'dataset_name': '{data}', "
            "'dataset_prompt_column': 'problem', 'reward_funcs': ['accuracy', 'cosine', 'code']})\n"
            "print(check_inputs(rc))\n"
            "print(sorted(m for m in ('torch', 'trl', 'datasets', 'math_verify', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "verification_info" in out.stderr  # `code` needs it: the check ran
    code = code.replace(", 'code'", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "[]"]


def test_the_fingerprint_is_the_rows_in_order_however_they_were_loaded(tmp_path):
    """ogrpo/trainer/data_fingerprint.py: the same rows hash alike through any load (a reload, a map that rewrites
    the Arrow files, a shuffled selection or its flattened copy); a changed cell, a row more, another order or
    another column type do not."""
    import datasets

    from ogrpo.trainer.data_fingerprint import BATCH, fingerprint

    rows = [{"prompt": f"what is {i} + {i % 7}?", "answer": str(i + i % 7), "n": None if i % 3 else i}
            for i in range(BATCH + 100)]  # two hashed batches
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    first = fingerprint(load_prompts({"dataset_name": str(data)}))
    assert first["rows"] == len(rows) and len(first["sha256"]) == 64
    assert fingerprint(load_prompts({"dataset_name": str(data)})) == first
    ds = datasets.load_dataset("json", data_files=str(data), split="train")
    assert fingerprint(ds.map(lambda r: {"prompt": r["prompt"]})) == fingerprint(ds)
    picked = ds.shuffle(seed=3).select(range(500))
    assert fingerprint(picked) == fingerprint(picked.flatten_indices()) != fingerprint(ds.select(range(500)))
    for changed in (rows[:-1] + [{**rows[-1], "answer": "0"}], rows + rows[:1], rows[::-1]):
        assert fingerprint(load_prompts({"dataset_name": str(write_jsonl(tmp_path / "e.jsonl", changed))})) != first
    typed = ds.cast_column("n", datasets.Value("float64"))
    assert fingerprint(typed) != fingerprint(ds)


def fingerprint_of(path) -> dict:
    from ogrpo.trainer.data_fingerprint import fingerprint

    return fingerprint(load_prompts({"dataset_name": str(path)}))


def test_a_pinned_fingerprint_refuses_other_data_before_the_model_loads(tmp_path):
    from ogrpo.trainer.assembly import prepare
    from ogrpo.trainer.data_fingerprint import resumed_note

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(16)])
    recipe = {"model_name_or_path": "ogrpo:tiny", "dataset_name": str(data), "reward_funcs": ["tiny_letter"],
              "per_device_train_batch_size": 8, "num_generations": 8, "max_completion_length": 8,
              "ogrpo": {"gpus": "cpu", "use_vllm": False, "max_prompt_length": 32}}
    found = prepare(recipe, output_dir=tmp_path / "run").data
    assert found["rows"] == 16
    recipe["ogrpo"]["data_sha256"] = found["sha256"].upper()  # as a user may paste it
    assert prepare(recipe, output_dir=tmp_path / "run").data == found
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(15)] + [{"prompt": "other"}])
    with pytest.raises(OgrpoError, match="its 16 rows hash to .*not to the ogrpo.data_sha256 the run config pins"):
        prepare(recipe, output_dir=tmp_path / "run")
    recipe["ogrpo"]["data_sha256"] = "abc"
    with pytest.raises(ConfigError, match="ogrpo.data_sha256: 'abc' is not a SHA-256"):
        prepare(recipe, output_dir=tmp_path / "run")
    # a resumed run whose data changed since it started: a note, in its manifest and on the console
    del recipe["ogrpo"]["data_sha256"]
    run = tmp_path / "resumed"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (run / "manifest.json").write_text(json.dumps({"data": found}))  # what its first start trained on
    notes = prepare(recipe, output_dir=run, resume="auto").notes
    assert any("the dataset changed since this run started (16 rows" in n for n in notes), notes
    (run / "manifest.json").write_text(json.dumps({"data": fingerprint_of(tmp_path / "d.jsonl")}))
    assert not any("dataset changed" in n for n in prepare(recipe, output_dir=run, resume="auto").notes)
    assert resumed_note(found, None) is None and resumed_note(found, dict(found)) is None
    assert "the dataset changed since this run started (16 rows" in resumed_note({**found, "sha256": "0" * 64}, found)
