"""The embedded default: a tiny Qwen2 model, a byte-level BPE tokenizer and a toy task, all built here.

Why: a newcomer (or CI) must see the whole GRPO loop run and learn on a CPU with no model hub. Everything is
derived from the spec below and a fixed seed, so the same spec gives the same files on every machine with the
same torch; the cache directory is named by a hash of the spec (`tiny-<hash>`), so a changed spec never reuses
stale files. Building takes about a second.

The task ("letters"): each prompt asks for one letter (`Write the letter c:`); a completion earns the share of
its first characters that are that letter. The reward is dense (every character counts), so the group-relative
advantage is non-zero from the first step even for a randomly initialised model, and the curve rises within a
few dozen steps on two cores.

The task models (`ogrpo:tiny-math`, `ogrpo:tiny-code`) are the same architecture with the task's text in the
tokenizer's corpus and a supervised warm start on the task's completions instead of the letters warm-up
(ogrpo/tasks/warm.py); their cache directories (`tiny-math-<hash>` ...) are keyed by the task's builder
parameters and the source of the task and warm-start modules. `ensure_model(name)` builds any of them.

Module import is cheap (no torch): `ogrpo.models` and the planner may read `TINY_MODEL` / `model_config(name)`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ogrpo.tasks import warm

TINY_NAME = "ogrpo:tiny"  # what a run config names as model_name_or_path / dataset_name
BUILD_VERSION = 1  # bump when the build procedure changes in a way the spec does not capture

LETTERS = "abcdefgh"
REWARD_CHARS = 8  # characters of a completion that the reward reads

TINY_MODEL = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,  # head_dim 32: a size vLLM's CPU attention supports
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "torch_dtype": "float32",
}
VOCAB_SIZE = 384
SEED = 1234
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]
WARMUP_STEPS = 300
WARMUP_BATCH = 32
WARMUP_COPY = 0.4


# Task models: the tiny architecture with the task's text in its tokenizer's corpus and a supervised warm start on
# the task's completions (ogrpo/tasks/warm.py), so the task's rewards see real answers. Their builder parameters
# (`WARM`) live in the task module.
TASK_MODELS = {"ogrpo:tiny-math": "ogrpo.tasks.tiny_math", "ogrpo:tiny-code": "ogrpo.tasks.tiny_code"}


def builtin_model(name: object) -> str | None:
    """The canonical name of a built-in model (`ogrpo:tiny` or its alias `tiny`, `ogrpo:tiny-math`,
    `ogrpo:tiny-code`), or None for any other model name."""
    if not isinstance(name, str):
        return None
    key = name.strip().lower()
    if key in (TINY_NAME, "tiny"):
        return TINY_NAME
    return key if key in TASK_MODELS else None


def _task(name: str):
    import importlib

    return importlib.import_module(TASK_MODELS[name])


def _canonical(name: str) -> str:
    canonical = builtin_model(name)
    if canonical is None:
        raise ValueError(f"{name!r} is not a built-in model ({', '.join([TINY_NAME, *TASK_MODELS])})")
    return canonical


def model_config(name: str = TINY_NAME) -> dict:
    """config.json fields of a built-in model (without building it)."""
    name = _canonical(name)
    vocab = VOCAB_SIZE if name == TINY_NAME else _task(name).WARM["vocab_size"]
    return {**TINY_MODEL, "vocab_size": vocab, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}


def _source_hash(*modules) -> str:
    """Hash of the modules' source: a task model's build depends on its rows, completions, training loop and
    this builder (an edit to any of them rebuilds the task models; `ogrpo:tiny` keeps its spec-only key)."""
    h = hashlib.sha256()
    for path in [__file__, *(mod.__file__ for mod in modules)]:
        h.update(Path(path).read_bytes())
    return h.hexdigest()


def spec_hash(name: str = TINY_NAME) -> str:
    name = _canonical(name)
    if name == TINY_NAME:
        spec = {"model": model_config(), "vocab": VOCAB_SIZE, "seed": SEED, "corpus": _corpus(),
                "special": SPECIAL_TOKENS, "build": BUILD_VERSION,
                "warmup": [WARMUP_STEPS, WARMUP_BATCH, WARMUP_COPY, REWARD_CHARS, LETTERS]}
    else:
        task = _task(name)
        spec = {"model": model_config(name), "seed": SEED, "corpus": _corpus(), "special": SPECIAL_TOKENS,
                "build": BUILD_VERSION, "warm": task.WARM, "source": _source_hash(task, warm)}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def cache_root() -> Path:
    env = os.environ.get("OGRPO_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "ogrpo"


def model_dir(name: str = TINY_NAME) -> Path:
    return cache_root() / _dir_name(name)


def _dir_name(name: str) -> str:
    name = _canonical(name)
    return f"{name.removeprefix('ogrpo:')}-{spec_hash(name)}"


def is_tiny(name: object) -> bool:
    """The letters model or dataset (`ogrpo:tiny`, `tiny`). Model names: see builtin_model."""
    return isinstance(name, str) and name.strip().lower() in (TINY_NAME, "tiny")


# --- toy task -------------------------------------------------------------------------------------------------


def prompt_for(letter: str) -> str:
    return f"Write the letter {letter}:"


def _corpus() -> list[str]:
    """Text the tokenizer is trained on: the prompts and letter runs, so merges cover the task's strings."""
    lines = [prompt_for(c) for c in LETTERS]
    lines += [" ".join(c * n for n in range(1, 6)) for c in LETTERS]
    lines += ["the quick brown fox jumps over the lazy dog", "0123456789 ,.;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`"]
    return lines


def toy_prompts(n: int = 256, seed: int = 0) -> list[dict]:
    """`n` rows {"prompt", "letter"}, the letters cycled in a seeded order (deterministic)."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        if i % len(LETTERS) == 0:
            order = list(LETTERS)
            rng.shuffle(order)
        letter = order[i % len(LETTERS)]
        rows.append({"prompt": prompt_for(letter), "letter": letter})
    return rows


def toy_dataset(n: int = 256, seed: int = 0):
    from datasets import Dataset

    return Dataset.from_list(toy_prompts(n, seed))


def letter_reward(completions, letter=None, **kwargs) -> list[float]:
    """Share of the first REWARD_CHARS characters (spaces ignored) equal to the prompt's letter.

    TRL passes the dataset's extra columns as keyword lists; without a `letter` column the letter is read from
    the prompt text, so the reward also works on a plain prompt file.
    """
    prompts = kwargs.get("prompts") or [None] * len(completions)
    out = []
    for i, completion in enumerate(completions):
        text = completion if isinstance(completion, str) else _message_text(completion)
        target = letter[i] if letter is not None else _letter_from_prompt(prompts[i])
        chars = [ch for ch in text if not ch.isspace()][:REWARD_CHARS]
        out.append(sum(ch == target for ch in chars) / REWARD_CHARS if target else 0.0)
    return out


def _message_text(completion) -> str:
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def _letter_from_prompt(prompt) -> str | None:
    text = _message_text(prompt) if not isinstance(prompt, str) else prompt
    if not text:
        return None
    text = text.rstrip().rstrip(":").rstrip()
    return text[-1:] or None


# --- building -------------------------------------------------------------------------------------------------


def build_tokenizer(out_dir: Path, corpus: list[str] | None = None, vocab_size: int = VOCAB_SIZE,
                    qwen2_split: bool = False):
    """Train a byte-level BPE on the corpus (the letters corpus by default) and save it as a fast tokenizer.

    `qwen2_split`: train with the normalizer and pre-tokenizer that transformers' Qwen2Tokenizer rebuilds on
    load (AutoTokenizer picks it from config.json's model_type, in the trainer and in the server), so the ids
    seen in training are the ids seen at run time. With GPT-2's byte-level split instead, ` 12` is one
    pre-token at build time and ` `, `1`, `2` at run time: a model fine-tuned on the former reads the
    latter as unseen input. The letters texts split alike both ways, which is why `ogrpo:tiny` keeps GPT-2's.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if qwen2_split:
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus() if corpus is None else corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[1],
                                   bos_token=None, model_max_length=TINY_MODEL["max_position_embeddings"])
    fast.save_pretrained(str(out_dir))
    return fast


def _warmup_texts(n: int, seed: int) -> list[str]:
    """Prompt + eight letters: with probability WARMUP_COPY all eight are the asked-for letter, else each is a
    random letter.

    The base model thus writes letters and follows the prompt only sometimes (expected reward about 0.4): GRPO's
    job is to sharpen a behaviour the model already has, as in real post-training. Measured here: from a base
    model that ignores the prompt, 100 GRPO steps did not move the reward (the copy circuit must exist first),
    and a warm-up where each letter is the target with probability 0.2 did not learn the circuit either.
    """
    import random

    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        target = rng.choice(LETTERS)
        if rng.random() < WARMUP_COPY:
            body = target * REWARD_CHARS
        else:
            body = "".join(rng.choice(LETTERS) for _ in range(REWARD_CHARS))
        texts.append(prompt_for(target) + " " + body)
    return texts


def _warmup(model, tok) -> None:
    """A few seconds of next-token training so that completions are letters (random init writes bytes)."""
    import torch

    texts = _warmup_texts(WARMUP_STEPS * WARMUP_BATCH, SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(WARMUP_STEPS):
        batch = texts[step * WARMUP_BATCH:(step + 1) * WARMUP_BATCH]
        enc = tok([t + tok.eos_token for t in batch], return_tensors="pt", padding=True)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        loss = model(**enc, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()


def build_model(out_dir: Path, tok, name: str = TINY_NAME, train=None) -> None:
    """Initialise the model with the fixed seed, train it (`train(model, tok)`, the letters warm-up by default)
    and save it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    train = _warmup if train is None else train
    cfg = {k: v for k, v in model_config(name).items() if k not in ("model_type", "architectures", "torch_dtype")}
    config = Qwen2Config(**cfg)
    state = torch.random.get_rng_state()
    threads = torch.get_num_threads()
    try:
        # One thread: float reductions then do not depend on the machine's core count.
        torch.set_num_threads(1)
        torch.manual_seed(SEED)
        model = Qwen2ForCausalLM(config).to(torch.float32)
        train(model, tok)
    finally:
        torch.random.set_rng_state(state)
        torch.set_num_threads(threads)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(str(out_dir), safe_serialization=True)


def _task_tokenizer(out_dir: Path, name: str):
    """A task model's tokenizer: BPE over the letters corpus plus the task's prompts and completions."""
    task = _task(name)
    return build_tokenizer(out_dir, _corpus() + warm.corpus(task), task.WARM["vocab_size"], qwen2_split=True)


def _task_training(name: str):
    """`train(model, tok)` for build_model: the task's supervised warm start (ogrpo/tasks/warm.py)."""
    task = _task(name)
    examples = task.warm_examples()
    return lambda model, tok: warm.fine_tune(model, tok, examples, **task.WARM)


def ensure_model(name: str = TINY_NAME, root: Path | None = None) -> Path:
    """Path of a built-in model + tokenizer (see builtin_model), built into the cache on first use.

    The build happens in a temporary directory renamed into place, so a reader never sees a partial model. Two
    processes that need it at once (server and trainer, DDP ranks) take a lock, so the second waits for the
    first's build instead of repeating it; without working locks (some network file systems) both build and the
    second rename loses, leaving the first's files.
    """
    name = _canonical(name)
    target = (Path(root) if root is not None else cache_root()) / _dir_name(name)
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.parent / f".{target.name}.lock"):
        if _complete(target):
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-build-", dir=target.parent))
        try:
            tok = build_tokenizer(tmp) if name == TINY_NAME else _task_tokenizer(tmp, name)
            want = model_config(name)["vocab_size"]
            if len(tok) != want:
                # The corpus must give the full vocabulary: the model's embedding is sized to vocab_size.
                raise RuntimeError(f"{name} tokenizer has {len(tok)} tokens, expected {want}")
            build_model(tmp, tok, name, train=None if name == TINY_NAME else _task_training(name))
            info = {"spec_hash": spec_hash(name), "seed": SEED, **({} if name == TINY_NAME else {"name": name})}
            (tmp / "ogrpo_tiny.json").write_text(json.dumps(info) + "\n")
            try:
                os.replace(tmp, target)
            except OSError:
                # Another process finished first (target now exists and is not empty): keep theirs.
                if not _complete(target):
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_tiny_model(root: Path | None = None) -> Path:
    """Path of the built letters model + tokenizer (`ogrpo:tiny`)."""
    return ensure_model(TINY_NAME, root)


def _complete(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "tokenizer.json").is_file()


@contextlib.contextmanager
def _lock(path: Path):
    import fcntl

    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: fall back to the rename race described above
            pass
        yield
