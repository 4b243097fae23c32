"""Model facts (parameter count and shapes) without a hub: a local `config.json`, a built-in table, or `--params`.

The planner needs only shapes: parameters (weights, gradients, optimizer states), layers x hidden
(activations), vocab (logits), kv heads x head_dim (vLLM KV cache), attention heads (tensor-parallel sizes).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ogrpo.errors import OgrpoError

# vLLM runs these only in fp32 (shared/compat.md): they cannot be served on V100 with --dtype half.
FP32_ONLY_MODEL_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text", "glm4", "plamo2"})


@dataclass(frozen=True)
class ModelFacts:
    name: str
    params: int  # total parameters
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    torch_dtype: str  # checkpoint dtype: "bfloat16" | "float16" | "float32"
    model_type: str = "unknown"
    source: str = "builtin"  # "config.json" | "builtin" | "params"
    exact_shapes: bool = True  # False when shapes were extrapolated from --params alone

    @property
    def fp32_only(self) -> bool:
        return self.model_type in FP32_ONLY_MODEL_TYPES

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for every layer: what one cached token costs vLLM."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fp32_only"] = self.fp32_only
        return d


def count_params(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                 intermediate: int, tied: bool, qkv_bias: bool = False, qk_norm: bool = False) -> int:
    """Parameters of a Llama/Qwen-style decoder (GQA attention, SwiGLU MLP, RMSNorm)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = hidden * q + 2 * hidden * kv + q * hidden
    if qkv_bias:
        attn += q + 2 * kv
    if qk_norm:
        attn += 2 * head_dim
    mlp = 3 * hidden * intermediate
    per_layer = attn + mlp + 2 * hidden  # two RMSNorm weights
    embed = vocab * hidden
    return embed + layers * per_layer + hidden + (0 if tied else vocab * hidden)


def _facts(name, model_type, hidden, layers, heads, kv, vocab, inter, tied, max_pos, dtype="bfloat16",
           head_dim=None, qkv_bias=False, qk_norm=False) -> ModelFacts:
    hd = head_dim or hidden // heads
    params = count_params(hidden, layers, heads, kv, hd, vocab, inter, tied, qkv_bias, qk_norm)
    return ModelFacts(name, params, hidden, layers, heads, kv, hd, vocab, inter, tied, max_pos, dtype, model_type)


def _qwen2(name, hidden, layers, heads, kv, vocab, inter, tied, max_pos):
    return _facts(name, "qwen2", hidden, layers, heads, kv, vocab, inter, tied, max_pos, qkv_bias=True)


def _qwen3(name, hidden, layers, heads, kv, inter, tied):
    return _facts(name, "qwen3", hidden, layers, heads, kv, 151936, inter, tied, 40960, head_dim=128, qk_norm=True)


def _llama(name, hidden, layers, heads, kv, inter, tied):
    return _facts(name, "llama", hidden, layers, heads, kv, 128256, inter, tied, 131072)


# Shapes copied from each model's config.json on the Hub (hidden, layers, heads, kv heads, vocab, intermediate,
# tie_word_embeddings, max_position_embeddings, torch_dtype). Base and Instruct share weights' shapes; only
# max_position_embeddings differs for some Qwen2.5 sizes.
_TABLE: tuple[ModelFacts, ...] = (
    _qwen2("Qwen/Qwen2.5-0.5B", 896, 24, 14, 2, 151936, 4864, True, 32768),
    _qwen2("Qwen/Qwen2.5-0.5B-Instruct", 896, 24, 14, 2, 151936, 4864, True, 32768),
    _qwen2("Qwen/Qwen2.5-1.5B", 1536, 28, 12, 2, 151936, 8960, True, 131072),
    _qwen2("Qwen/Qwen2.5-1.5B-Instruct", 1536, 28, 12, 2, 151936, 8960, True, 32768),
    _qwen2("Qwen/Qwen2.5-3B", 2048, 36, 16, 2, 151936, 11008, True, 32768),
    _qwen2("Qwen/Qwen2.5-3B-Instruct", 2048, 36, 16, 2, 151936, 11008, True, 32768),
    _qwen2("Qwen/Qwen2.5-7B", 3584, 28, 28, 4, 152064, 18944, False, 131072),
    _qwen2("Qwen/Qwen2.5-7B-Instruct", 3584, 28, 28, 4, 152064, 18944, False, 32768),
    _qwen2("Qwen/Qwen2.5-Math-1.5B", 1536, 28, 12, 2, 151936, 8960, True, 4096),
    _qwen2("Qwen/Qwen2.5-Math-7B", 3584, 28, 28, 4, 152064, 18944, False, 4096),
    _qwen3("Qwen/Qwen3-0.6B", 1024, 28, 16, 8, 3072, True),
    _qwen3("Qwen/Qwen3-1.7B", 2048, 28, 16, 8, 6144, True),
    _qwen3("Qwen/Qwen3-4B", 2560, 36, 32, 8, 9728, True),
    _qwen3("Qwen/Qwen3-8B", 4096, 36, 32, 8, 12288, False),
    _llama("meta-llama/Llama-3.2-1B", 2048, 16, 32, 8, 8192, True),
    _llama("meta-llama/Llama-3.2-1B-Instruct", 2048, 16, 32, 8, 8192, True),
    _llama("meta-llama/Llama-3.2-3B", 3072, 28, 24, 8, 8192, True),
    _llama("meta-llama/Llama-3.2-3B-Instruct", 3072, 28, 24, 8, 8192, True),
    _llama("meta-llama/Llama-3.1-8B", 4096, 32, 32, 8, 14336, False),
    _llama("meta-llama/Llama-3.1-8B-Instruct", 4096, 32, 32, 8, 14336, False),
    _llama("meta-llama/Meta-Llama-3.1-8B-Instruct", 4096, 32, 32, 8, 14336, False),
)

BUILTIN: dict[str, ModelFacts] = {m.name.lower(): m for m in _TABLE}


def builtin_names() -> list[str]:
    return [m.name for m in _TABLE]


def parse_params(value) -> int:
    """'7B', '1.5b', '500M', 7e9, '7000000000' -> parameter count."""
    if isinstance(value, bool):
        raise OgrpoError(f"--params {value!r}: give a parameter count such as 7B, 1.5B or 500M")
    if isinstance(value, (int, float)):
        n = float(value)
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmbt]?)\s*", str(value).lower())
        if not m:
            raise OgrpoError(f"--params {value!r}: give a parameter count such as 7B, 1.5B or 500M")
        n = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2)]
    if n < 1e3:
        # A bare small number is almost certainly billions ("--params 7").
        n *= 1e9
    return int(n)


def from_config_dict(cfg: dict, name: str, source: str = "config.json") -> ModelFacts:
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    try:
        hidden = int(text["hidden_size"])
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        vocab = int(text["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise OgrpoError(f"{name}: config.json lacks {exc}; pass --params to plan without it") from None
    kv = int(text.get("num_key_value_heads") or heads)
    hd = int(text.get("head_dim") or hidden // heads)
    inter = int(text.get("intermediate_size") or 4 * hidden)
    tied = bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))
    max_pos = int(text.get("max_position_embeddings") or 2048)
    dtype = str(text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype")
                or "float32")
    mtype = str(cfg.get("model_type") or text.get("model_type") or "unknown")
    qkv_bias = bool(text.get("attention_bias", mtype == "qwen2"))
    params = count_params(hidden, layers, heads, kv, hd, vocab, inter, tied, qkv_bias, mtype.startswith("qwen3"))
    return ModelFacts(name, params, hidden, layers, heads, kv, hd, vocab, inter, tied, max_pos, dtype, mtype,
                      source)


def from_params(name: str, params: int) -> ModelFacts:
    """Shapes extrapolated from a parameter count (Llama-style aspect ratios), flagged as inexact."""
    # Choose hidden so that 12·L·H² ≈ P with L ≈ H/128 (Llama/Qwen proportions), then round to 128.
    hidden = max(256, int(round(((params * 128 / 12) ** (1 / 3)) / 128)) * 128)
    layers = max(2, int(round(params / (12 * hidden * hidden))))
    heads = max(1, hidden // 128)
    return ModelFacts(name, params, hidden, layers, heads, max(1, heads // 4), 128, 128000, int(hidden * 8 / 3),
                      False, 32768, "bfloat16", "unknown", "params", exact_shapes=False)


def resolve_model(name_or_path: str | Path | None, params=None) -> ModelFacts:
    """Facts for a local model directory (config.json), a built-in hub name, or a `--params` count."""
    if params is not None and params != "":
        count = parse_params(params)
        base = None
        if name_or_path:
            try:
                base = _resolve_known(str(name_or_path))
            except OgrpoError:
                base = None
        if base is not None:
            return replace(base, params=count, source="params")
        return from_params(str(name_or_path or "model"), count)
    if not name_or_path:
        raise OgrpoError("no model: set model_name_or_path in the run config or pass --model (and --params)")
    return _resolve_known(str(name_or_path))


def _resolve_known(name: str) -> ModelFacts:
    path = Path(name).expanduser()
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise OgrpoError(f"{name}: directory has no config.json; pass --params to plan without it")
        try:
            cfg = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as exc:
            raise OgrpoError(f"{cfg_file}: unreadable config.json ({exc}); pass --params instead") from None
        return from_config_dict(cfg, str(path), "config.json")
    hit = BUILTIN.get(name.lower())
    if hit is not None:
        return hit
    from ogrpo import tiny  # cheap: the spec is data, building needs torch

    if tiny.is_tiny(name):
        return from_config_dict(tiny.model_config(), tiny.TINY_NAME, "builtin")
    # A hub name that is not built in: look in the local HF cache before giving up (no network).
    cached = _hf_cache_config(name)
    if cached is not None:
        return from_config_dict(cached, name, "hf-cache")
    if name.startswith(("/", ".", "~")):
        raise OgrpoError(f"model path {name} does not exist; fix model_name_or_path or pass --params")
    raise OgrpoError(f"unknown model {name!r}: not a local directory nor a built-in model; pass --params "
                     f"(e.g. --params 7B) or point --model at a directory with config.json")


def _hf_cache_config(name: str) -> dict | None:
    import os

    if "/" not in name:
        return None
    home = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    snaps = Path(home) / ("models--" + name.replace("/", "--")) / "snapshots"
    if not snaps.is_dir():
        return None
    for snap in sorted(snaps.iterdir()):
        f = snap / "config.json"
        if f.is_file():
            try:
                return json.loads(f.read_text())
            except (OSError, ValueError):
                return None
    return None
