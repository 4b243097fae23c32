"""Model facts (parameter count and shapes) without a hub: a local `config.json`, the shipped table
(`ogrpo/data/model_facts.json`, real config.json fields), the HF cache, or `--params`.

The planner needs only shapes: parameters (weights, gradients, optimizer states), layers x hidden
(activations), vocab (logits), kv heads x head_dim (vLLM KV cache), attention heads (tensor-parallel sizes).
A MoE model weighs all its experts (`params`) but computes with its top-k (`active_params`): Qwen3-30B-A3B
is 30.5B parameters of weights and 3.3B of compute per token, and must be planned as the former.
Counts are computed from config fields by one function (`decoder_params`), checked against transformers'
own models per family and against published sizes (tests/test_models.py).
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ogrpo import tiny
from ogrpo.errors import OgrpoError

# vLLM runs these only in fp32: they cannot be served on V100 with --dtype half.
FP32_ONLY_MODEL_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text", "glm4", "plamo2"})


@dataclass(frozen=True)
class ModelFacts:
    name: str
    params: int  # total parameters: what weights, gradients and optimizer states weigh
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int  # dense MLP width (config.json's intermediate_size)
    tie_word_embeddings: bool
    max_position_embeddings: int
    torch_dtype: str  # checkpoint dtype: "bfloat16" | "float16" | "float32"
    model_type: str = "unknown"
    source: str = "builtin"  # "config.json" | "builtin" | "hf-cache" | "params"
    exact_shapes: bool = True  # False when shapes were extrapolated from --params alone
    active_params: int = 0  # parameters one token runs through (MoE: top-k experts); 0 means = params
    num_experts: int = 0  # routed experts per MoE layer (0: dense)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one routed expert's MLP width
    shared_intermediate_size: int = 0  # always-on shared expert(s) MLP width (Qwen2-MoE, DeepSeek)
    num_moe_layers: int = 0
    reference: str = ""  # where the built-in facts come from
    # KV layout as vLLM allocates it. MLA (DeepSeek V2/V3): one compressed latent of kv_lora_rank plus a shared
    # rope key of qk_rope_head_dim per token and layer, replacing K and V of every head (0: not MLA).
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    # Sliding-window attention: the window in tokens and how many of the layers use it (the rest attend fully).
    sliding_window: int = 0
    sliding_layers: int = 0
    warnings: tuple[str, ...] = ()  # what the plan must say about these facts (a --params count overriding one)

    def __post_init__(self):
        if not self.active_params:
            object.__setattr__(self, "active_params", self.params)
        object.__setattr__(self, "warnings", tuple(self.warnings))  # a plan read back from JSON has a list

    @property
    def fp32_only(self) -> bool:
        return self.model_type in FP32_ONLY_MODEL_TYPES

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def active_intermediate_size(self) -> int:
        """MLP width one token runs through in a MoE layer (top-k experts + shared), else the dense width."""
        if not self.is_moe:
            return self.intermediate_size
        return self.num_experts_per_tok * self.moe_intermediate_size + self.shared_intermediate_size

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """What one cached token costs vLLM over every layer on one GPU (sliding windows aside): MLA keeps the
        latent and the rope key, other attention K and V of every KV head."""
        if self.is_mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["warnings"] = list(self.warnings)
        d["fp32_only"] = self.fp32_only
        return d


def count_params(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                 intermediate: int, tied: bool, qkv_bias: bool = False, qk_norm: bool = False) -> int:
    """Parameters of a dense Llama/Qwen-style decoder (GQA attention, SwiGLU MLP, RMSNorm)."""
    cfg = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
           "intermediate_size": intermediate, "tie_word_embeddings": tied, "attention_bias": qkv_bias}
    return decoder_params(cfg, "qwen3" if qk_norm else "llama")[0]


# Per-family layout facts that config.json does not spell out.
_QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")  # Qwen2 always has q/k/v biases; its config has no attention_bias key
_QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3", "gemma3_text")  # RMSNorm over head_dim on q and k
_FOUR_NORM_TYPES = ("gemma2", "gemma3", "gemma3_text")  # pre- and post-norms around attention and MLP


def _int(cfg: dict, key: str, default: int = 0) -> int:
    value = cfg.get(key)
    return int(value) if value not in (None, "") else default


def _attention_params(cfg: dict, mtype: str) -> int:
    H, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    if cfg.get("kv_lora_rank"):
        # DeepSeek V2/V3 multi-head latent attention: low-rank q (optional) and a shared compressed kv.
        nope, rope, v = _int(cfg, "qk_nope_head_dim"), _int(cfg, "qk_rope_head_dim"), _int(cfg, "v_head_dim")
        kv_rank, q_rank = _int(cfg, "kv_lora_rank"), _int(cfg, "q_lora_rank")
        q = (H * q_rank + q_rank + q_rank * heads * (nope + rope)) if q_rank else H * heads * (nope + rope)
        kv = H * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v)
        return q + kv + heads * v * H
    hd = _int(cfg, "head_dim") or H // heads
    kvh = _int(cfg, "num_key_value_heads") or heads
    q, kv = heads * hd, kvh * hd
    n = H * q + 2 * H * kv + q * H
    if cfg.get("attention_bias", mtype in _QKV_BIAS_TYPES):
        n += q + 2 * kv
    if mtype in _QK_NORM_TYPES:
        n += 2 * hd
    return n


def _moe_layer(cfg: dict, mtype: str, i: int) -> bool:
    if cfg.get("n_routed_experts"):  # DeepSeek: the first k layers stay dense
        freq = _int(cfg, "moe_layer_freq", 1) or 1
        return i >= _int(cfg, "first_k_dense_replace") and i % freq == 0
    if cfg.get("num_experts") or cfg.get("num_local_experts"):  # Qwen2/3-MoE; Mixtral has neither key: all
        step = _int(cfg, "decoder_sparse_step", 1) or 1
        return i not in (cfg.get("mlp_only_layers") or []) and (i + 1) % step == 0
    return False


def moe_shape(cfg: dict) -> tuple[int, int, int, int]:
    """(routed experts, experts per token, one expert's width, shared width) of a config; zeros when dense."""
    E = _int(cfg, "n_routed_experts") or _int(cfg, "num_local_experts") or _int(cfg, "num_experts")
    if not E:
        return 0, 0, 0, 0
    k = _int(cfg, "num_experts_per_tok", 2)
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts too; Mixtral alone has no
    # moe_intermediate_size: its experts are intermediate_size wide.
    width = _int(cfg, "moe_intermediate_size") or _int(cfg, "intermediate_size")
    shared = _int(cfg, "shared_expert_intermediate_size") or _int(cfg, "n_shared_experts") * width
    return E, k, width, shared


def decoder_params(cfg: dict, mtype: str) -> tuple[int, int, int]:
    """(total, active, MoE layers) parameters of a decoder-only text model from its config fields.

    Total counts every expert (what the weights weigh); active counts the top-k routed experts, the shared
    experts and the router, i.e. what one token computes with. Dense models: total == active."""
    H, L, V = _int(cfg, "hidden_size"), _int(cfg, "num_hidden_layers"), _int(cfg, "vocab_size")
    I = _int(cfg, "intermediate_size") or 4 * H
    norms = (4 if mtype in _FOUR_NORM_TYPES else 2) * H
    attn = _attention_params(cfg, mtype)
    E, k, width, shared = moe_shape(cfg)
    total = active = 0
    moe_layers = 0
    for i in range(L):
        base = attn + norms
        if E and _moe_layer(cfg, mtype, i):
            moe_layers += 1
            router = H * E  # (DeepSeek-V3's e_score_correction_bias is a buffer, not a parameter)
            shared_p = 3 * H * shared + (H if cfg.get("shared_expert_intermediate_size") else 0)  # + Qwen2 gate
            total += base + router + shared_p + E * 3 * H * width
            active += base + router + shared_p + k * 3 * H * width
        else:
            total += base + 3 * H * I
            active += base + 3 * H * I
    embed = V * H * (1 if cfg.get("tie_word_embeddings", False) else 2) + H  # + final norm
    return total + embed, active + embed, moe_layers


def _vision_params(vc: dict, text_hidden: int) -> int:
    """A SigLIP/ViT tower (biased linear layers, LayerNorm, learned positions) and a linear projector."""
    h, I, L = _int(vc, "hidden_size"), _int(vc, "intermediate_size"), _int(vc, "num_hidden_layers")
    if not (h and I and L):
        return 0
    patch, image, ch = _int(vc, "patch_size", 14), _int(vc, "image_size", 224), _int(vc, "num_channels", 3)
    layer = 4 * (h * h + h) + (h * I + I) + (I * h + h) + 2 * 2 * h
    embed = ch * patch * patch * h + h + (image // patch) ** 2 * h
    # SigLIP's attention-pooling head; Gemma 3 turns it off (vision_use_head: false).
    head = (h + 4 * (h * h + h) + 2 * h + (h * I + I) + (I * h + h)) if vc.get("vision_use_head", True) else 0
    return L * layer + embed + 2 * h + head + (h * text_hidden + h)  # post-LN, projector (+ its input norm)


def sliding_layout(cfg: dict, mtype: str) -> tuple[int, int]:
    """(window, layers that use it) as vLLM reads a config: `layer_types` where the config has it; Gemma 2
    alternates (even layers slide) and Gemma 3 keeps every `sliding_window_pattern`-th layer global; Qwen2/3 slide
    only with `use_sliding_window`, from layer `max_window_layers` on; any other model with a `sliding_window`
    slides in every layer (vLLM's model-wide window, e.g. Mistral-7B-v0.1, Phi-3 4k). (0, 0): none."""
    window = _int(cfg, "sliding_window")
    L = _int(cfg, "num_hidden_layers")
    if not window or cfg.get("use_sliding_window") is False:
        return 0, 0
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        return window, sum(1 for t in types[:L] if t == "sliding_attention")
    if mtype == "gemma2":
        return window, (L + 1) // 2
    if mtype in ("gemma3", "gemma3_text"):
        pattern = _int(cfg, "sliding_window_pattern", 6) or 6
        return window, sum(1 for i in range(L) if (i + 1) % pattern)
    if mtype in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if not cfg.get("use_sliding_window"):
            return 0, 0
        return window, max(0, L - _int(cfg, "max_window_layers", L))
    return window, L


FACTS_FILE = Path(__file__).with_name("data") / "model_facts.json"


@functools.cache
def builtin_table() -> dict[str, ModelFacts]:
    """Hub id (lower case) -> facts of the shipped table, read on first use (`ogrpo --help` never pays)."""
    doc = json.loads(FACTS_FILE.read_text())
    return {name.lower(): from_config_dict(entry["config"], name, "builtin", entry.get("source", ""))
            for name, entry in doc["models"].items()}


def builtin_names() -> list[str]:
    return [m.name for m in builtin_table().values()]


PARAMS_HINT = "give a positive parameter count such as 7B, 1.5B or 500M"
MAX_PARAMS = 1e14  # 100T: beyond any model; a larger count is a typo, not a plan


def parse_params(value) -> int:
    """'7B', '1.5b', '500M', 7e9, '7000000000' -> parameter count; zero, negative, non-finite or absurd counts
    are refused (a 0-parameter plan "fits" anything)."""
    if isinstance(value, bool):
        raise OgrpoError(f"--params {value!r}: {PARAMS_HINT}")
    if isinstance(value, (int, float)):
        n = float(value)
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmbt]?)\s*", str(value).lower())
        if not m:
            raise OgrpoError(f"--params {value!r}: {PARAMS_HINT}")
        n = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2)]
    if not math.isfinite(n) or n <= 0:
        raise OgrpoError(f"--params {value!r}: {PARAMS_HINT}")
    if n < 1e3:
        # A bare small number is almost certainly billions ("--params 7").
        n *= 1e9
    if n < 1 or n > MAX_PARAMS:
        raise OgrpoError(f"--params {value!r}: {n:.3g} parameters; {PARAMS_HINT}")
    return int(n)


def from_config_dict(cfg: dict, name: str, source: str = "config.json", reference: str = "") -> ModelFacts:
    if not isinstance(cfg, dict):
        kind = {list: "a list", str: "a string", type(None): "null"}.get(type(cfg), type(cfg).__name__)
        raise OgrpoError(f"{name}: config.json holds {kind}, not an object of the model's settings; pass --params "
                         "to plan without it")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        value = text.get(key)
        if key not in text:
            raise OgrpoError(f"{name}: config.json lacks {key!r}; pass --params to plan without it")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise OgrpoError(f"{name}: config.json {key} {value!r} is not a positive integer; pass --params to plan "
                             "without it")
    try:
        return _facts(cfg, text, name, source, reference)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError, AttributeError) as exc:
        # a malformed optional setting (a width that is a string, a head count of 0): one line, not a traceback
        raise OgrpoError(f"{name}: config.json has a setting O-GRPO cannot read ({exc}); pass --params to plan "
                         "without it") from None


def _facts(cfg: dict, text: dict, name: str, source: str, reference: str) -> ModelFacts:
    hidden, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
    heads, vocab = int(text["num_attention_heads"]), int(text["vocab_size"])
    kv = int(text.get("num_key_value_heads") or heads)
    hd = int(text.get("head_dim") or hidden // heads)
    if text.get("kv_lora_rank"):
        # MLA: a query/key head is qk_nope + qk_rope wide (transformers 5 writes head_dim as the rope part alone,
        # the hub files have none); the KV cache does not use it (kv_bytes_per_token).
        hd = _int(text, "qk_nope_head_dim") + _int(text, "qk_rope_head_dim") or hd
    inter = int(text.get("intermediate_size") or 4 * hidden)
    tied = bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))
    max_pos = int(text.get("max_position_embeddings") or 2048)
    dtype = str(text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype")
                or "float32")
    mtype = str(cfg.get("model_type") or text.get("model_type") or "unknown")
    text_type = str(text.get("model_type") or mtype)
    total, active, moe_layers = decoder_params({**text, "tie_word_embeddings": tied}, text_type)
    if isinstance(cfg.get("vision_config"), dict):
        vision = _vision_params(cfg["vision_config"], hidden)
        total, active = total + vision, active + vision
    E, k, width, shared = moe_shape(text)
    window, sliding = sliding_layout(text, text_type)
    kv_rank = _int(text, "kv_lora_rank")
    return ModelFacts(name, total, hidden, layers, heads, kv, hd, vocab, inter, tied, max_pos, dtype, mtype, source,
                      active_params=active, num_experts=E, num_experts_per_tok=k, moe_intermediate_size=width,
                      shared_intermediate_size=shared, num_moe_layers=moe_layers, reference=reference,
                      kv_lora_rank=kv_rank, qk_rope_head_dim=_int(text, "qk_rope_head_dim") if kv_rank else 0,
                      sliding_window=window, sliding_layers=sliding)


def _round_to(x: float, step: int) -> int:
    return max(step, int(round(x / step)) * step)


def from_params(name: str, params: int) -> ModelFacts:
    """Shapes extrapolated from a parameter count (Llama-3 proportions), flagged as inexact.

    Heads and KV heads are multiples of 8 so that every tensor-parallel size of 2, 4 or 8 splits them (vLLM
    refuses a TP size that does not divide the heads); the layer count is then chosen so that the decoder's
    own count lands closest to P."""
    head_dim = 128 if params >= 1e9 else 64
    # Llama-3/Qwen-2.5 sizes keep roughly L ≈ H/128 and 12·L·H² ≈ P: H ≈ (128·P/12)^(1/3).
    hidden = _round_to((params * 128 / 12) ** (1 / 3), 8 * head_dim)
    heads = hidden // head_dim
    kv = 8
    inter = _round_to(hidden * 8 / 3, 256)
    # Embeddings of a 128k vocabulary dwarf a small model; small models use a 32k one, as SmolLM/Mistral do.
    vocab = 128256 if params >= 3e9 else 32000
    per_layer = count_params(hidden, 1, heads, kv, head_dim, vocab, inter, False) - count_params(
        hidden, 0, heads, kv, head_dim, vocab, inter, False)
    embed = count_params(hidden, 0, heads, kv, head_dim, vocab, inter, False)
    layers = max(2, int(round((params - embed) / per_layer)))
    return ModelFacts(name, params, hidden, layers, heads, kv, head_dim, vocab, inter, False, 32768, "bfloat16",
                      "unknown", "params", exact_shapes=False)


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
            # The user's count replaces the total; a dense model's active count is the same number. Said out loud:
            # a known model's own count is usually the right one.
            active = base.active_params if base.is_moe else count
            where = {"builtin": "the built-in table", "config.json": "its config.json",
                     "hf-cache": "its config.json in the HF cache"}.get(base.source, base.source)
            warning = (f"--params {_billions(count)} overrides {base.name}'s {_billions(base.params)} parameters "
                       f"(counted from {where}): --params wins for weights, gradients and optimizer states; "
                       f"layers, widths and vocabulary stay the model's")
            return replace(base, params=count, active_params=active, source="params",
                           warnings=base.warnings + (warning,))
        return from_params(str(name_or_path or "model"), count)
    if not name_or_path:
        raise OgrpoError("no model: set model_name_or_path in the run config or pass --model (and --params)")
    return _resolve_known(str(name_or_path))


def _billions(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e8 else f"{n / 1e6:.3g}M"


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
    hit = builtin_table().get(name.lower())
    if hit is not None:
        return hit

    builtin = tiny.builtin_model(name)  # cheap: the spec is data, building needs torch
    if builtin:
        return from_config_dict(tiny.model_config(builtin), builtin, "builtin")
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
    try:
        if not snaps.is_dir():
            return None
        for snap in sorted(snaps.iterdir()):
            f = snap / "config.json"
            if f.is_file():
                return json.loads(f.read_text())
    except (OSError, ValueError):  # a cache this user cannot read (another user's HF_HOME) is no cache here
        return None
    return None
