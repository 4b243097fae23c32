"""Supervised warm start of a tiny task model (`ogrpo:tiny-math`, `ogrpo:tiny-code`) on its task's completions.

Why: GRPO only sharpens what a model already does. A model that never writes `\\boxed{}` or a ```python block
scores 0 on every accuracy, format and code reward, so a run would never exercise them. A few seconds of
next-token training on (prompt, completion) pairs in the recipe's format, some correct and some wrong, give a
model whose sampled completions are parsable and right only part of the time: the rewards vary within a group.

Each task module provides `WARM` (the parameters, part of the cache key) and `warm_examples(n, seed)`. The
training loop is plain torch on one thread with a fixed seed, so a build is the same on every machine with the
same torch. The prompt and the completion are tokenized separately, as the trainer does at generation time
(TRL tokenizes the prompt, the model continues it), so the model learns the token sequence it will be asked to
produce, not one that only exists when both strings are tokenized together.
"""

from __future__ import annotations


def corpus(task) -> list[str]:
    """Text the task model's tokenizer is trained on: the training prompts and their reference completions, so
    BPE merges cover the numbers, keywords and tags the completions are made of (shorter sequences)."""
    return [text for prompt, completion in task.warm_examples() for text in (prompt, completion)]


def encode(tok, pairs: list[tuple[str, str]]) -> list[tuple[list[int], int]]:
    """(token ids of prompt + completion + eos, number of prompt tokens) per pair."""
    out = []
    for prompt, completion in pairs:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        c = tok(completion, add_special_tokens=False)["input_ids"]
        out.append((p + c + [tok.eos_token_id], len(p)))
    return out


def _batch(rows: list[tuple[list[int], int]], pad_id: int):
    """Right-padded input ids, attention mask and labels (-100 on the prompt and the padding: only the
    completion is learned, the prompt is given)."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (seq, n_prompt) in enumerate(rows):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
        labels[i, n_prompt:len(seq)] = torch.tensor(seq[n_prompt:])
    return ids, mask, labels


def fine_tune(model, tok, pairs: list[tuple[str, str]], *, steps: int, batch: int, lr: float, seed: int,
              **_) -> list[float]:
    """`steps` AdamW steps over shuffled epochs of `pairs`; returns the loss of each step. The caller fixes
    torch's seed and thread count (ogrpo.tiny.build_model)."""
    import random

    import torch

    rows = encode(tok, pairs)
    rng = random.Random(seed)
    order: list[int] = []
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    # Linear decay to 0: the last steps settle on the data's answer distribution instead of the last batches.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / steps)
    losses = []
    model.train()
    for _ in range(steps):
        while len(order) < batch:
            epoch = list(range(len(rows)))
            rng.shuffle(epoch)
            order += epoch
        picked, order = order[:batch], order[batch:]
        ids, mask, labels = _batch([rows[i] for i in picked], tok.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses
