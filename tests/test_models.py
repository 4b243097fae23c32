"""Model facts: the built-in table, local config.json, --params."""

from __future__ import annotations

import json

import pytest

from error_checks import one_line_error
from ogrpo.errors import OgrpoError
from ogrpo.models import builtin_table, from_config_dict, from_params, parse_params, resolve_model

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

# Exact published parameter counts (safetensors metadata on the hub).
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
        assert name.lower() in builtin_table()
    assert resolve_model("qwen/qwen2.5-1.5b-instruct").name == "Qwen/Qwen2.5-1.5B-Instruct"


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


GOOD = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}


@pytest.mark.parametrize("config, says", [
    ("[]", "holds a list"), ("null", "holds null"), ('"qwen"', "holds a string"),
    ({**GOOD, "num_attention_heads": 0}, "num_attention_heads 0 is not a positive integer"),
    ({**GOOD, "hidden_size": -5}, "hidden_size -5 is not a positive integer"),
    ('{"hidden_size": 1e400, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}',
     "hidden_size inf is not"),
    ({**GOOD, "num_hidden_layers": "x"}, "num_hidden_layers 'x' is not"),
    ({**GOOD, "vocab_size": True}, "vocab_size True is not"),
    ({**GOOD, "intermediate_size": "wide"}, "a setting O-GRPO cannot read (invalid literal"),
])
def test_a_malformed_config_json_is_one_line(run_cli, tmp_path, config, says):
    """A local model whose config.json is not what transformers writes: the plan says which setting, no traceback."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    proc = run_cli("plan", "--gpus", "3xA40", "--config", "tiny", "--model", str(tmp_path / "m"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    line, = proc.stderr.strip().splitlines()
    assert says in line and "--params" in line, line


def test_text_config_nested():
    cfg = {"model_type": "gemma3", "text_config": {"hidden_size": 640, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "vocab_size": 1000}}
    m = from_config_dict(cfg, "x")
    assert m.hidden_size == 640 and m.fp32_only


def test_unknown_hub_name_names_params_flag():
    assert "--params" in str(one_line_error(resolve_model, "someone/unknown-model-13B"))


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


# Sizes as the model cards (or the hub's safetensors total) state them, total / active. The table's counts are
# computed from config.json fields, so a wrong field or a wrong family rule shows up here as a >2% miss.
PUBLISHED_SIZES = {
    "Qwen/Qwen2.5-0.5B": 0.494e9, "Qwen/Qwen2.5-1.5B": 1.54e9, "Qwen/Qwen2.5-3B": 3.09e9, "Qwen/Qwen2.5-7B": 7.61e9,
    "Qwen/Qwen2.5-14B": 14.7e9, "Qwen/Qwen2.5-32B": 32.5e9, "Qwen/Qwen2.5-72B": 72.7e9,
    "Qwen/Qwen2.5-Math-7B": 7.61e9, "Qwen/Qwen2.5-Coder-7B-Instruct": 7.61e9,
    "Qwen/Qwen3-0.6B": 0.6e9, "Qwen/Qwen3-1.7B": 1.7e9, "Qwen/Qwen3-4B": 4.0e9, "Qwen/Qwen3-8B": 8.2e9,
    "Qwen/Qwen3-14B": 14.8e9, "Qwen/Qwen3-32B": 32.8e9,
    "Qwen/Qwen3-30B-A3B": 30.5e9, "Qwen/Qwen3-235B-A22B": 235e9,
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": 1.78e9, "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": 7.62e9,
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B": 14.8e9, "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": 32.8e9,
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": 8.03e9, "deepseek-ai/DeepSeek-R1-Distill-Llama-70B": 70.6e9,
    "meta-llama/Llama-3.2-1B": 1.24e9, "meta-llama/Llama-3.2-3B": 3.21e9, "meta-llama/Llama-3.1-8B": 8.03e9,
    "meta-llama/Llama-3.1-70B-Instruct": 70.6e9, "meta-llama/Llama-3.3-70B-Instruct": 70.6e9,
    "mistralai/Mistral-7B-v0.1": 7.24e9, "mistralai/Mistral-7B-Instruct-v0.3": 7.25e9,
    "mistralai/Mixtral-8x7B-Instruct-v0.1": 46.7e9,
    "HuggingFaceTB/SmolLM2-135M": 135e6, "HuggingFaceTB/SmolLM2-360M": 362e6, "HuggingFaceTB/SmolLM2-1.7B": 1.71e9,
    "google/gemma-2-2b-it": 2.61e9, "google/gemma-2-9b-it": 9.24e9, "google/gemma-2-27b-it": 27.2e9,
    "google/gemma-3-1b-it": 1.0e9, "google/gemma-3-4b-it": 4.3e9, "google/gemma-3-12b-it": 12.2e9,
    "google/gemma-3-27b-it": 27.4e9,
    "microsoft/Phi-3-mini-4k-instruct": 3.82e9, "microsoft/Phi-3-medium-4k-instruct": 14.0e9,
    "microsoft/phi-4": 14.7e9, "microsoft/Phi-4-mini-instruct": 3.84e9,
}
PUBLISHED_ACTIVE = {"Qwen/Qwen3-30B-A3B": 3.3e9, "Qwen/Qwen3-235B-A22B": 22e9,
                    "mistralai/Mixtral-8x7B-Instruct-v0.1": 12.9e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED_SIZES))
def test_published_sizes_within_2_percent(name):
    m = resolve_model(name)
    assert m.params == pytest.approx(PUBLISHED_SIZES[name], rel=0.02)
    assert m.active_params == pytest.approx(PUBLISHED_ACTIVE.get(name, PUBLISHED_SIZES[name]), rel=0.02)


def test_moe_weighs_all_experts():
    m = resolve_model("Qwen/Qwen3-30B-A3B")
    assert m.is_moe and (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (128, 8, 768)
    assert m.num_moe_layers == 48
    # Each layer's experts alone: 128 experts x 3 matrices x 2048 x 768 = 603,979,776; x 48 layers = 29.0B.
    assert m.params > 48 * 128 * 3 * 2048 * 768
    # Active: 8 of 128 experts, so the MLP part shrinks 16x: 48 x 8 x 3 x 2048 x 768 = 1.81B of 3.35B.
    assert m.params - m.active_params == 48 * (128 - 8) * 3 * 2048 * 768
    assert m.active_intermediate_size == 8 * 768


def test_moe_weights_do_not_fit_one_a40():
    """30.5B bf16 weights are 57 GiB: more than an A40's 48 GiB, whatever the active count says."""
    from ogrpo.planner.memory import GiB, server_estimate

    m = resolve_model("Qwen/Qwen3-30B-A3B")
    est = server_estimate(m, tensor_parallel_size=1, dtype_bytes=2, memory_gib=48, gpu_memory_utilization=0.9,
                          max_model_len=4096, max_num_seqs=8, enforce_eager=False)
    assert est.terms["weights"] == pytest.approx(m.params * 2 / GiB)
    assert est.terms["weights"] > 56 and not est.fits


def test_every_entry_records_its_source():
    import ogrpo.models as models

    doc = json.loads(models.FACTS_FILE.read_text())
    assert len(doc["models"]) >= 60
    for name, entry in doc["models"].items():
        assert entry["source"].startswith("https://huggingface.co/" + name), name
        assert builtin_table()[name.lower()].reference == entry["source"]


@pytest.mark.parametrize("count", ["0.5B", "1.5B", "3B", "7B", "14B", "32B", "70B", "405B"])
def test_params_shapes_split_by_tensor_parallelism(count):
    m = resolve_model("someone/unknown", params=count)
    for tp in (2, 4, 8):
        assert m.num_heads % tp == 0 and m.num_kv_heads % tp == 0
    assert m.hidden_size == m.num_heads * m.head_dim
    # The extrapolated decoder's own count lands near the requested one (layers are whole numbers).
    from ogrpo.models import count_params

    own = count_params(m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size,
                       m.intermediate_size, m.tie_word_embeddings)
    assert own == pytest.approx(parse_params(count), rel=0.03)
    assert from_params("x", parse_params(count)) == m.__class__(**{**m.__dict__, "name": "x"})


_FAMILY_EXTRA = {
    "qwen2": {}, "qwen3": {}, "llama": {}, "mistral": {}, "phi3": {},
    "gemma2": {"tie_word_embeddings": True}, "gemma3_text": {"tie_word_embeddings": True},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1]},
    "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": {"n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "q_lora_rank": 24, "kv_lora_rank": 16,
                    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "n_group": 1, "topk_group": 1},
    "deepseek_v2": {"n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "q_lora_rank": None,
                    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
                    "n_group": 1, "topk_group": 1},
}


@pytest.mark.parametrize("model_type", sorted(_FAMILY_EXTRA))
def test_count_matches_transformers_per_family(model_type):
    """Each family's rules (biases, q/k norms, four norms, experts, shared experts, dense-first layers, MLA)
    against the real transformers model, built on the meta device from the config transformers writes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 96, "vocab_size": 300, "tie_word_embeddings": False,
             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    cfg = AutoConfig.for_model(model_type, **{**shape, **_FAMILY_EXTRA[model_type]})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    real = sum(p.numel() for p in model.parameters())  # tied weights are one Parameter
    facts = from_config_dict(json.loads(cfg.to_json_string()), model_type)
    assert facts.params == real
    assert (facts.active_params < real) == facts.is_moe


def test_count_matches_transformers_multimodal():
    """Gemma 3 (4B and up) carries a SigLIP tower and a projector in the same checkpoint."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    cfg = Gemma3Config(text_config={"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
                                    "vocab_size": 300},
                       vision_config={"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                                      "num_attention_heads": 2, "patch_size": 4, "image_size": 32},
                       mm_tokens_per_image=4)
    for use_head in (True, False):
        cfg.vision_config.vision_use_head = use_head
        with torch.device("meta"):
            model = Gemma3ForConditionalGeneration(cfg)
        real = sum(p.numel() for p in model.parameters())
        assert from_config_dict(json.loads(cfg.to_json_string()), "g").params == real


def test_generator_round_trips_transformers_configs(tmp_path):
    """config.json files written by transformers' own config classes -> gen_model_facts -> the same facts as
    the shipped table (the generator keeps every field the counts need, in either dtype spelling)."""
    import torch  # noqa: F401  (the train extra is part of the test environment: missing fails)
    from transformers import AutoConfig

    import ogrpo.models as models
    from ogrpo.data import gen_model_facts

    shipped = json.loads(models.FACTS_FILE.read_text())["models"]
    names = ["Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen3-30B-A3B", "meta-llama/Llama-3.2-1B-Instruct",
             "mistralai/Mixtral-8x7B-Instruct-v0.1", "microsoft/phi-4", "google/gemma-2-2b-it",
             "deepseek-ai/DeepSeek-V2-Lite", "google/gemma-3-1b-it", "mistralai/Mistral-7B-v0.1"]
    for name in names:
        cfg = dict(shipped[name]["config"])
        AutoConfig.for_model(cfg.pop("model_type"), **cfg).save_pretrained(tmp_path / "root" / name)
    (tmp_path / "root" / names[0] / "SOURCE").write_text("https://example.org/qwen@rev")
    out = tmp_path / "facts.json"
    assert gen_model_facts.main([str(tmp_path / "root"), "--out", str(out)]) == 0
    regenerated = json.loads(out.read_text())["models"]
    assert sorted(regenerated) == sorted(names)
    assert regenerated[names[0]]["source"] == "https://example.org/qwen@rev"
    for name in names:
        got = from_config_dict(regenerated[name]["config"], name)
        want = builtin_table()[name.lower()]
        assert (got.params, got.active_params, got.hidden_size, got.num_layers, got.num_heads, got.num_kv_heads,
                got.head_dim, got.vocab_size, got.intermediate_size, got.tie_word_embeddings,
                got.max_position_embeddings, got.torch_dtype, got.num_experts, got.kv_lora_rank, got.qk_rope_head_dim,
                got.sliding_window, got.sliding_layers) == (
            want.params, want.active_params, want.hidden_size, want.num_layers, want.num_heads, want.num_kv_heads,
            want.head_dim, want.vocab_size, want.intermediate_size, want.tie_word_embeddings,
            want.max_position_embeddings, want.torch_dtype, want.num_experts, want.kv_lora_rank,
            want.qk_rope_head_dim, want.sliding_window, want.sliding_layers), name


def test_generator_reads_hf_cache_layout(tmp_path):
    from ogrpo.data import gen_model_facts

    snap = tmp_path / "models--org--m" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "dtype": "bfloat16",
                                                  "rope_theta": 1e4}))
    models = gen_model_facts.generate(tmp_path)
    assert list(models) == ["org/m"]
    # Only the planner's fields; transformers 5's `dtype` is stored as `torch_dtype`.
    assert models["org/m"]["config"] == {"model_type": "llama", "hidden_size": 64, "torch_dtype": "bfloat16"}


def test_moe_activations_use_the_active_width():
    """Mixtral routes each token through 2 of 8 experts of width 14336: its MLP activations per token and
    layer are 3 x (2 x 14336) values, not 3 x 14336 (and not 8 x)."""
    from ogrpo.planner.memory import GiB, trainer_estimate

    m = resolve_model("mistralai/Mixtral-8x7B-Instruct-v0.1")
    assert m.active_intermediate_size == 2 * 14336
    e = trainer_estimate(m, num_processes=1, strategy="ddp", precision="bf16", micro_batch=1, prompt_len=100,
                         completion_len=100, gradient_checkpointing=False, beta=0.0)
    # 200 tokens x 32 layers x (10 x 4096 + 3 x 28672) values x 2 bytes
    assert e.terms["activations"] == pytest.approx(200 * 32 * (10 * 4096 + 3 * 28672) * 2 / GiB)


# --- issue 23: DeepSeek (MLA) facts, sliding windows, --params ------------------------------------------------------

# DeepSeek-V2-Lite's safetensors hold 15,706,484,224 parameters (a public dump of the Chat model, same shapes);
# V2 and V3 as their model cards state them (236B / 21B active, 671B / 37B active; V3's multi-token-prediction
# layer is not part of the transformers model).
DEEPSEEK_SIZES = {"deepseek-ai/DeepSeek-V2-Lite": (15_706_484_224, 2.4e9), "deepseek-ai/DeepSeek-V2": (236e9, 21e9),
                  "deepseek-ai/DeepSeek-V3": (671e9, 37e9)}


@pytest.mark.parametrize("name", sorted(DEEPSEEK_SIZES))
def test_deepseek_mla_facts(name):
    m = resolve_model(name)
    total, active = DEEPSEEK_SIZES[name]
    assert m.params == pytest.approx(total, rel=0.02) and m.active_params == pytest.approx(active, rel=0.12)
    assert (m.kv_lora_rank, m.qk_rope_head_dim) == (512, 64) and m.is_mla and m.source == "builtin"
    assert "huggingface.co/deepseek-ai/" in builtin_table()[name.lower()].reference
    assert m.kv_bytes_per_token(2) == m.num_layers * 576 * 2
    if name.endswith("Lite"):
        assert m.params == 15_706_484_224


@pytest.mark.parametrize("cfg, mtype, want", [
    ({"num_hidden_layers": 26, "sliding_window": 4096}, "gemma2", (4096, 13)),  # even layers slide
    ({"num_hidden_layers": 34, "sliding_window": 1024, "sliding_window_pattern": 6}, "gemma3_text", (1024, 29)),
    ({"num_hidden_layers": 4, "sliding_window": 128,
      "layer_types": ["sliding_attention", "full_attention"] * 2}, "gpt_oss", (128, 2)),
    ({"num_hidden_layers": 28, "sliding_window": 131072, "use_sliding_window": False,
      "max_window_layers": 21}, "qwen2", (0, 0)),  # Qwen2.5 ships the window switched off
    ({"num_hidden_layers": 28, "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 21},
     "qwen2", (4096, 7)),  # layers 21.. slide
    ({"num_hidden_layers": 32, "sliding_window": 4096}, "mistral", (4096, 32)),  # model-wide window
    ({"num_hidden_layers": 32, "sliding_window": None}, "mistral", (0, 0)),
])
def test_sliding_layout_as_vllm_reads_it(cfg, mtype, want):
    from ogrpo.models import sliding_layout

    assert sliding_layout(cfg, mtype) == want


def test_shipped_facts_carry_sliding_windows():
    table = builtin_table()
    got = {n: (table[n.lower()].sliding_window, table[n.lower()].sliding_layers) for n in (
        "google/gemma-2-9b-it", "google/gemma-3-4b-it", "google/gemma-3-1b-it", "mistralai/Mistral-7B-v0.1",
        "microsoft/Phi-3-mini-4k-instruct", "mistralai/Mistral-7B-Instruct-v0.3", "Qwen/Qwen2.5-7B-Instruct")}
    assert got == {"google/gemma-2-9b-it": (4096, 21), "google/gemma-3-4b-it": (1024, 29),
                   "google/gemma-3-1b-it": (512, 22), "mistralai/Mistral-7B-v0.1": (4096, 32),
                   "microsoft/Phi-3-mini-4k-instruct": (2047, 32), "mistralai/Mistral-7B-Instruct-v0.3": (0, 0),
                   "Qwen/Qwen2.5-7B-Instruct": (0, 0)}


@pytest.mark.parametrize("bad", ["0B", "0", 0, -3e9, "1e30", float("nan"), float("inf")])
def test_parse_params_refuses_zero_negative_and_absurd(bad):
    one_line_error(parse_params, bad, match="positive parameter count")


def test_params_on_a_known_model_says_which_count_wins():
    m = resolve_model("Qwen/Qwen2.5-7B-Instruct", params="3B")
    assert m.params == 3_000_000_000 and m.num_layers == 28
    assert m.warnings == ("--params 3B overrides Qwen/Qwen2.5-7B-Instruct's 7.62B parameters (counted from the "
                          "built-in table): --params wins for weights, gradients and optimizer states; layers, "
                          "widths and vocabulary stay the model's",)
    assert resolve_model("someone/unknown", params="3B").warnings == ()  # nothing to override
