"""Shared helpers for the serving/launch tests: a tiny Qwen2 checkpoint and a run config pointing at it.

Built here (not downloaded) so the tests run offline; `ogrpo.tiny` replaces it when the training area ships it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ogrpo.launch.procs import group_members  # noqa: F401 - what a role left behind after its teardown


def build_tiny_model(out: Path, hidden: int = 128, layers: int = 2, heads: int = 2, kv_heads: int = 1,
                     intermediate: int = 256, seed: int = 0) -> Path:
    # head_dim 64: the CPU attention kernels reject head_dim 16 ("Unsupported CPU attention configuration").
    """A randomly initialized Qwen2 (tied embeddings) with a byte-level BPE tokenizer, saved in fp32."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"{a} + {b} = {a + b}" for a in range(40) for b in range(40)] + ["the quick brown fox"] * 10
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(fast), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      eos_token_id=fast.eos_token_id, bos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


def write_run_config(path: Path, model: Path, **trl) -> Path:
    import yaml

    data = {"model_name_or_path": str(model), "max_completion_length": 16, "dtype": "float32",
            "ogrpo": {"max_prompt_length": 32}}
    data.update(trl)
    Path(path).write_text(yaml.safe_dump(data))
    return Path(path)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
