"""A prompt group's rows as TRL lays out its batch (left-padded prompts, right-padded completions, truncated
completions masked): what the per-group passes (ogrpo.overlap.streaming) and losses (ogrpo.overlap.train_ahead)
compute on, so TRL's own tensors can be compared with them."""

from __future__ import annotations

import copy


def prompt_layout(trainer, prompts) -> tuple[list, int]:
    """The batch's prompt ids (TRL's tokenization) and the width TRL left-pads them to."""
    prompt_ids = trainer._tokenize_prompts(copy.deepcopy(prompts))[0]
    width = max(len(p) for p in prompt_ids)
    multiple = getattr(trainer, "pad_to_multiple_of", None)
    if multiple:
        width = -(-width // multiple) * multiple
    return prompt_ids, width


def group_rows(trainer, prompt: list, completions: list, width: int):
    """One group's rows as TRL's batch lays them out: (ids, attention mask, completion length), the prompt
    left-padded to `width`, the completions right-padded to the group's longest (at least one column, so a group
    of empty completions still runs its pass: lockstep ranks run as many as the others; the extra column is
    masked, as TRL's right padding would be), truncated completions masked where TRL masks them."""
    import torch

    tokenizer = getattr(trainer, "_tokenizer", None) or trainer.processing_class
    pad_id = tokenizer.pad_token_id
    eos = set(getattr(trainer, "eos_token_ids", None) or [tokenizer.eos_token_id]) | {pad_id}
    length = max(1, max(len(c) for c in completions))
    n = len(completions)
    ids = torch.full((n, width + length), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width + length), dtype=torch.long)
    ids[:, width - len(prompt):width] = torch.tensor(prompt)
    mask[:, width - len(prompt):width] = 1
    for row, c in enumerate(completions):
        if not c:
            continue
        ids[row, width:width + len(c)] = torch.tensor(c)
        truncated = trainer.mask_truncated_completions and c[-1] not in eos
        mask[row, width:width + len(c)] = 0 if truncated else 1
    return ids, mask, length
