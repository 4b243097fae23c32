"""Regenerate `model_facts.json` from real `config.json` files.

    python -m ogrpo.data.gen_model_facts ROOT [--out ogrpo/data/model_facts.json] [--merge]

ROOT holds one directory per model, named like the hub id (`ROOT/Qwen/Qwen2.5-7B/config.json`, or
`ROOT/models--Qwen--Qwen2.5-7B/snapshots/<rev>/config.json` as the HF cache lays it out). A `SOURCE` file next
to a config.json says where it came from (a URL and revision); without one the source is the file's path.
Only the fields the planner reads are kept (`KEEP`), so the table stays small and diffs stay readable; the
facts themselves (parameter counts, MoE split) are computed from these fields by `ogrpo.models`, the same code
that reads a user's local config.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_OUT = Path(__file__).with_name("model_facts.json")

# Shapes, dtype and context of the decoder; MoE fields of Qwen2/3-MoE, Mixtral and DeepSeek V2/V3; the KV layout
# (MLA's latent, sliding windows).
KEEP = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "tie_word_embeddings", "max_position_embeddings", "torch_dtype", "dtype",
    "attention_bias",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "decoder_sparse_step", "mlp_only_layers", "num_local_experts",
    "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "moe_layer_freq",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    # Sliding-window attention as vLLM allocates it (ogrpo.models.sliding_layout).
    "sliding_window", "layer_types", "sliding_window_pattern", "use_sliding_window", "max_window_layers",
)
# Fields whose explicit null means something else than the config class's default (DeepSeek-V2-Lite's q_lora_rank:
# no q compression, not transformers' 1536; Mistral v0.2+'s sliding_window: none, not MistralConfig's 4096).
KEEP_NULL = ("q_lora_rank", "sliding_window")
VISION_KEEP = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "patch_size", "image_size",
               "num_channels", "vision_use_head")


def extract(cfg: dict) -> dict:
    """The planner's subset of one config.json (nested `text_config` / `vision_config` kept as subsets)."""
    out = {k: cfg[k] for k in KEEP if k in cfg and (cfg[k] is not None or k in KEEP_NULL)}
    # transformers 5 writes `dtype`; hub files written by 4.x say `torch_dtype`. Keep one spelling.
    if "dtype" in out:
        out.setdefault("torch_dtype", out.pop("dtype"))
    if isinstance(cfg.get("text_config"), dict):
        out["text_config"] = extract(cfg["text_config"])
    if isinstance(cfg.get("vision_config"), dict):
        out["vision_config"] = {k: cfg["vision_config"][k] for k in VISION_KEEP if k in cfg["vision_config"]}
    return out


def model_name(config_file: Path, root: Path) -> str:
    rel = config_file.parent.relative_to(root).parts
    if rel and rel[0].startswith("models--"):  # HF cache layout: models--org--name/snapshots/<rev>/
        return rel[0][len("models--"):].replace("--", "/")
    if len(rel) == 1 and "--" in rel[0]:
        return rel[0].replace("--", "/")
    return "/".join(rel)


def generate(root: Path) -> dict[str, dict]:
    models: dict[str, dict] = {}
    for cfg_file in sorted(Path(root).rglob("config.json")):
        name = model_name(cfg_file, Path(root))
        src = cfg_file.with_name("SOURCE")
        source = src.read_text().strip() if src.is_file() else str(cfg_file)
        models[name] = {"source": source, "config": extract(json.loads(cfg_file.read_text()))}
    return models


ABOUT = ("config.json facts of open models, by hub id; regenerate with `python -m ogrpo.data.gen_model_facts ROOT` "
         "(ogrpo/data/gen_model_facts.py)")


def write(models: dict[str, dict], out: Path) -> None:
    # One model per line: a changed config shows as one changed line in a diff.
    rows = [f"  {json.dumps(name)}: {json.dumps(models[name])}" for name in sorted(models, key=str.lower)]
    out.write_text("{\n" + f' "about": {json.dumps(ABOUT)},\n "models": {{\n' + ",\n".join(rows) + "\n }\n}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="directory of <org>/<name>/config.json files")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--merge", action="store_true", help="keep models of --out that ROOT does not have")
    a = ap.parse_args(argv)
    models = generate(a.root)
    if not models:
        print(f"no config.json under {a.root}", file=sys.stderr)
        return 2
    if a.merge and a.out.is_file():
        models = {**json.loads(a.out.read_text())["models"], **models}
    write(models, a.out)
    print(f"{a.out}: {len(models)} models")
    return 0


if __name__ == "__main__":
    sys.exit(main())
