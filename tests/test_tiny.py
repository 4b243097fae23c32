"""The embedded default: tiny Qwen2 model + byte-level BPE tokenizer built locally and reproducibly, toy task."""

from __future__ import annotations

import hashlib
import json

import pytest

from ogrpo import tiny


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_module_import_is_cheap_and_spec_is_pure_data():
    import subprocess
    import sys

    code = "import sys, ogrpo.tiny; print(any(m in sys.modules for m in ('torch', 'transformers', 'tokenizers')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    cfg = tiny.model_config()
    assert cfg["model_type"] == "qwen2" and cfg["vocab_size"] == tiny.VOCAB_SIZE
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 32  # a head size vLLM's CPU attention has


@pytest.mark.slow
def test_two_builds_are_byte_identical_and_load_as_qwen2(tmp_path):
    a = tiny.ensure_tiny_model(tmp_path / "a")
    b = tiny.ensure_tiny_model(tmp_path / "b")
    assert a.name == b.name == f"tiny-{tiny.spec_hash()}"
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha(a / name) == _sha(b / name), name
    # cached: a second call returns the same directory without rebuilding
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert tiny.ensure_tiny_model(tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(a)
    tok = AutoTokenizer.from_pretrained(a)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.vocab_size == len(tok) == tiny.VOCAB_SIZE
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token_id != tok.eos_token_id
    text = "Write the letter c: cccc ü"  # byte-level: any text round-trips, non-ASCII included
    assert tok.decode(tok(text)["input_ids"]) == text
    assert json.loads((a / "config.json").read_text())["tie_word_embeddings"] is True


def test_cache_dir_follows_ogrpo_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("OGRPO_CACHE", str(tmp_path))
    assert tiny.model_dir() == tmp_path / f"tiny-{tiny.spec_hash()}"


def test_toy_prompts_are_deterministic_and_balanced():
    rows = tiny.toy_prompts(64)
    assert rows == tiny.toy_prompts(64)
    assert {r["letter"] for r in rows} == set(tiny.LETTERS)
    # every block of len(LETTERS) rows holds each letter once
    assert all(sorted(r["letter"] for r in rows[i:i + 8]) == sorted(tiny.LETTERS) for i in range(0, 64, 8))
    assert all(r["prompt"] == tiny.prompt_for(r["letter"]) for r in rows)


def test_letter_reward_is_dense():
    # share of the first 8 non-space characters equal to the asked letter
    assert tiny.letter_reward([" cccc cccc", " ccccxxxx", "xx", " c c c c c c c c c"], letter=["c"] * 4) == [
        1.0, 0.5, 0.0, 1.0]
    # without a letter column the letter comes from the prompt text
    assert tiny.letter_reward(["aaaa"], prompts=[tiny.prompt_for("a")]) == [0.5]
