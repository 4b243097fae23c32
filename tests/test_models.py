"""Model facts: the built-in table, local config.json, --params."""

from __future__ import annotations

import json

import pytest

from ogrpo.errors import OgrpoError
from ogrpo.models import BUILTIN, from_config_dict, parse_params, resolve_model

# Shapes as in each model's config.json on the Hub:
# (hidden, layers, heads, kv heads, vocab, intermediate, tied, max positions, torch_dtype)
REAL_SHAPES = {
    "Qwen/Qwen2.5-0.5B-Instruct": (896, 24, 14, 2, 151936, 4864, True, 32768, "bfloat16"),
    "Qwen/Qwen2.5-1.5B-Instruct": (1536, 28, 12, 2, 151936, 8960, True, 32768, "bfloat16"),
    "Qwen/Qwen2.5-1.5B": (1536, 28, 12, 2, 151936, 8960, True, 131072, "bfloat16"),
    "Qwen/Qwen2.5-3B-Instruct": (2048, 36, 16, 2, 151936, 11008, True, 32768, "bfloat16"),
    "Qwen/Qwen2.5-7B-Instruct": (3584, 28, 28, 4, 152064, 18944, False, 32768, "bfloat16"),
    "Qwen/Qwen3-0.6B": (1024, 28, 16, 8, 151936, 3072, True, 40960, "bfloat16"),
    "Qwen/Qwen3-1.7B": (2048, 28, 16, 8, 151936, 6144, True, 40960, "bfloat16"),
    "Qwen/Qwen3-4B": (2560, 36, 32, 8, 151936, 9728, True, 40960, "bfloat16"),
    "Qwen/Qwen3-8B": (4096, 36, 32, 8, 151936, 12288, False, 40960, "bfloat16"),
    "meta-llama/Llama-3.2-1B-Instruct": (2048, 16, 32, 8, 128256, 8192, True, 131072, "bfloat16"),
    "meta-llama/Llama-3.2-3B-Instruct": (3072, 28, 24, 8, 128256, 8192, True, 131072, "bfloat16"),
    "meta-llama/Llama-3.1-8B-Instruct": (4096, 32, 32, 8, 128256, 14336, False, 131072, "bfloat16"),
}

# Published parameter counts (model cards / safetensors metadata).
PUBLISHED_PARAMS = {
    "Qwen/Qwen2.5-0.5B-Instruct": 494_032_768,
    "Qwen/Qwen2.5-1.5B-Instruct": 1_543_714_304,
    "Qwen/Qwen2.5-7B-Instruct": 7_615_616_512,
    "Qwen/Qwen3-0.6B": 596_049_920,
    "meta-llama/Llama-3.2-1B-Instruct": 1_235_814_400,
    "meta-llama/Llama-3.1-8B-Instruct": 8_030_261_248,
}


@pytest.mark.parametrize("name", sorted(REAL_SHAPES))
def test_builtin_shapes_match_hub_configs(name):
    m = resolve_model(name)
    got = (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.vocab_size, m.intermediate_size,
           m.tie_word_embeddings, m.max_position_embeddings, m.torch_dtype)
    assert got == REAL_SHAPES[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_counts(name):
    assert resolve_model(name).params == PUBLISHED_PARAMS[name]


def test_table_covers_required_models():
    for name in ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-3B", "Qwen/Qwen2.5-7B",
                 "Qwen/Qwen3-1.7B", "Qwen/Qwen3-4B", "meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-3B",
                 "meta-llama/Llama-3.1-8B"):
        assert name.lower() in BUILTIN
    assert resolve_model("qwen/qwen2.5-1.5b-instruct").name == "Qwen/Qwen2.5-1.5B-Instruct"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen3-0.6B", "meta-llama/Llama-3.2-1B"])
def test_param_formula_matches_transformers(name):
    """Count the real transformers model's parameters (built on the meta device: no memory, no download)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    m = resolve_model(name)
    cfg = AutoConfig.for_model(
        m.model_type, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, vocab_size=m.vocab_size,
        intermediate_size=m.intermediate_size, tie_word_embeddings=m.tie_word_embeddings,
        max_position_embeddings=m.max_position_embeddings, head_dim=m.head_dim,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    real = sum(p.numel() for p in model.parameters())  # tied weights are one Parameter
    assert m.params == real


def test_local_directory(tiny_model_dir):
    m = resolve_model(str(tiny_model_dir))
    assert m.source == "config.json"
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (64, 2, 4, 2, 16)
    # embed 512·64 = 32768; per layer: q 64·64 + k,v 2·64·32 + o 64·64 = 12288, biases 64+2·32 = 128,
    # MLP 3·64·128 = 24576, norms 128 -> 37120; 2 layers 74240; final norm 64; tied: no lm_head.
    assert m.params == 32768 + 74240 + 64


def test_local_directory_without_config(tmp_path):
    with pytest.raises(OgrpoError, match="--params"):
        resolve_model(str(tmp_path))


def test_text_config_nested():
    cfg = {"model_type": "gemma3", "text_config": {"hidden_size": 640, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "vocab_size": 1000}}
    m = from_config_dict(cfg, "x")
    assert m.hidden_size == 640 and m.fp32_only


def test_unknown_hub_name_names_params_flag():
    with pytest.raises(OgrpoError) as e:
        resolve_model("someone/unknown-model-13B")
    assert "--params" in str(e.value) and "\n" not in str(e.value)


def test_params_flag():
    m = resolve_model("someone/unknown-model", params="7B")
    assert m.params == 7_000_000_000 and not m.exact_shapes and m.source == "params"
    # Known shapes are kept, only the count changes.
    k = resolve_model("Qwen/Qwen2.5-7B-Instruct", params="7.6B")
    assert k.exact_shapes and k.hidden_size == 3584 and k.params == 7_600_000_000


@pytest.mark.parametrize("text, n", [("7B", 7e9), ("1.5b", 1.5e9), ("500M", 5e8), ("7", 7e9), (7e9, 7e9),
                                     ("7000000000", 7e9)])
def test_parse_params(text, n):
    assert parse_params(text) == int(n)


@pytest.mark.parametrize("bad", ["seven", "7Q", "", True])
def test_parse_params_bad(bad):
    with pytest.raises(OgrpoError, match="7B"):
        parse_params(bad)


def test_hf_cache_lookup(tmp_path, monkeypatch):
    snap = tmp_path / "models--org--cached" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128,
                                                  "num_hidden_layers": 2, "num_attention_heads": 4,
                                                  "vocab_size": 100}))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert resolve_model("org/cached").source == "hf-cache"


def test_tiny_model_resolves_without_building():
    from ogrpo import tiny

    m = resolve_model(tiny.TINY_NAME)
    cfg = tiny.model_config()
    assert (m.hidden_size, m.num_layers, m.vocab_size, m.torch_dtype) == (
        cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], "float32")
    assert resolve_model("tiny").name == tiny.TINY_NAME
