"""Padding-free log-prob passes (issue 36): the loss forward and the scoring passes compute the tokens that count.

TRL pads every row of a pass to the longest in the batch: prompts on the left, completions on the right, and a
forward computes every padded position. Here each call of TRL's `_get_per_token_logps_and_entropies` (one per TRL
chunk, so as many forwards as TRL runs: DDP and ZeRO-3 ranks stay in step) is answered from packed rows instead:
the real tokens of its rows, end to end, each sequence's `position_ids` starting at 0, so transformers builds a
block-causal mask (SDPA and eager: its packed-sequence mask; FlashAttention-2: varlen). Rows are packed first-fit
decreasing into balanced bins: one row under FlashAttention-2, else the bin length whose pass costs least
(`choose_capacity`: longer bins leave less filler, but SDPA and eager compute the masked scores between their
sequences too); where no packing costs clearly less than TRL's padded rows (rows of one length), TRL's pass runs. The
log-probs (and entropies) of the completion tokens are put back where TRL's padded layout has them; padded
positions get 0, as TRL 1.16 gives them (TRL 1.9.2 gives numbers that every use masks out).

Why it is exact: with rotary (or any relative) positions, a sequence's attention scores do not change when its
positions shift, and the padding TRL computes is masked out of every key it could reach; what changes is only
the order of floating-point sums (on CPU, fp32, the losses agree to 1e-5; 2.5e-6 measured after a step). Absolute position embeddings would
see other positions (TRL's left-padded forward shifts them), so there the trainer keeps TRL's padded pass.

Off where it cannot be exact or is not needed: absolute position embeddings, multimodal inputs, the MoE
load-balancing loss (its token average counts padding in TRL's), a prompt with no real token.
"""

from __future__ import annotations

from dataclasses import dataclass

from ogrpo.patches import trl_linear_logprobs as kernel_patch

ROTARY_CONFIG_KEYS = ("rope_theta", "rope_parameters", "rope_scaling", "rotary_dim", "rotary_pct")


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Row indices per bin, longest rows first, each bin's total at most `capacity` (a longer row alone)."""
    order = sorted(range(len(lengths)), key=lambda r: (-lengths[r], r))
    bins: list[list[int]] = []
    room: list[int] = []
    for r in order:
        for b, left in enumerate(room):
            if lengths[r] <= left:
                bins[b].append(r)
                room[b] -= lengths[r]
                break
        else:
            bins.append([r])
            room.append(capacity - lengths[r])
    return [sorted(b) for b in bins]


@dataclass(frozen=True)
class Costs:
    """FLOPs of a forward, per position (the projections, the MLP, the output head) and per pair of positions in
    one row (attention: SDPA and eager compute the scores a block-causal mask drops, too)."""

    per_token: float
    per_pair: float

    @classmethod
    def of(cls, config) -> Costs | None:
        h, i = getattr(config, "hidden_size", None), getattr(config, "intermediate_size", None)
        layers, vocab = getattr(config, "num_hidden_layers", None), getattr(config, "vocab_size", None)
        if not all(isinstance(x, int) for x in (h, i, layers, vocab)):
            return None
        heads = getattr(config, "num_attention_heads", None) or 1
        kv = getattr(config, "num_key_value_heads", None) or heads
        projections = 2 * h * h + 2 * h * (h * kv // heads)  # q, o and the (grouped) k, v
        return cls(per_token=2.0 * (projections + 3 * h * i) * layers + 2.0 * h * vocab, per_pair=4.0 * h * layers)

    def of_rows(self, rows: int, width: int) -> float:
        return rows * width * (self.per_token + width * self.per_pair)


def choose_capacity(lengths: list[int], width: int, costs: Costs | None) -> int | None:
    """The bin length whose packed pass costs least, from TRL's padded row upwards (longer bins leave less filler
    but attend over more); None where no packing costs clearly less than TRL's padded rows (rows of one length
    gain nothing and lose the plain causal mask)."""
    if costs is None:
        return width
    total, best, capacity = sum(lengths), None, width
    while True:
        bins = balanced_bins(lengths, capacity)
        cost = costs.of_rows(len(bins), max(sum(lengths[r] for r in b) for b in bins))
        if best is None or cost < best[0]:
            best = (cost, capacity)
        if capacity >= total:
            break
        capacity = min(total, capacity * 3 // 2 + 1)
    return best[1] if best[0] < 0.95 * costs.of_rows(len(lengths), width) else None


def balanced_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """As few bins as first-fit decreasing needs at `capacity`, each as short as that count allows: the bins are
    padded to the longest, so even bins leave the least filler."""
    bins = first_fit_decreasing(lengths, capacity)
    lo, hi = max(max(lengths), -(-sum(lengths) // len(bins))), capacity
    while lo < hi:  # the shortest capacity that still needs no more bins
        mid = (lo + hi) // 2
        if len(first_fit_decreasing(lengths, mid)) <= len(bins):
            hi = mid
        else:
            lo = mid + 1
    tighter = first_fit_decreasing(lengths, lo)
    return tighter if len(tighter) <= len(bins) else bins


@dataclass
class Packed:
    input_ids: object  # [bins, width]: the rows' real tokens end to end, the rest one filler sequence
    position_ids: object  # [bins, width]: 0.. per sequence (the filler too: a sequence of its own)
    scored: tuple  # (bin, column) of every completion token that TRL scores
    dest: tuple  # (row, column) of the same tokens in TRL's [rows, logits_to_keep] layout

    @property
    def positions(self) -> int:
        return self.input_ids.numel()


def pack(input_ids, attention_mask, logits_to_keep: int, capacity: int | None = None) -> Packed | None:
    """TRL's padded rows -> packed bins of at most `capacity` tokens (default: the padded row's width; a row is
    never split); None where a completion token would have no token before it, or no token is scored."""
    import torch

    mask = attention_mask.bool()
    rows, width = mask.shape
    start = width - logits_to_keep  # TRL's completion columns: the last logits_to_keep
    lengths = mask.sum(1).tolist()
    if any(not mask[r, :start].any() and mask[r, start:].any() for r in range(rows)):
        return None  # no prompt token: the first completion token has no predictor in its own sequence
    groups = balanced_bins(lengths, capacity or width)
    size = max(sum(lengths[r] for r in g) for g in groups)
    ids = input_ids.new_zeros(len(groups), size)
    pos = torch.zeros(len(groups), size, dtype=torch.long, device=input_ids.device)
    scored_b, scored_c, dest_r, dest_c = [], [], [], []
    for b, group in enumerate(groups):
        offset = 0
        for r in group:
            real = mask[r].nonzero()[:, 0]
            n = real.numel()
            ids[b, offset:offset + n] = input_ids[r, real]
            pos[b, offset:offset + n] = torch.arange(n, device=pos.device)
            tail = (real >= start).nonzero()[:, 0]
            scored_b.append(torch.full_like(tail, b))
            scored_c.append(tail + offset)
            dest_r.append(torch.full_like(tail, r))
            dest_c.append(real[tail] - start)
            offset += n
        pos[b, offset:] = torch.arange(size - offset, device=pos.device)
    cat = torch.cat
    if not sum(t.numel() for t in scored_c):
        return None  # nothing to score (every completion masked): TRL's pass answers with its zeros
    return Packed(ids, pos, (cat(scored_b), cat(scored_c)), (cat(dest_r), cat(dest_c)))


def _config(model):
    """The text model's config through DDP/DeepSpeed/PEFT wrappers (they forward attribute lookups or hold
    `module`)."""
    inner = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def why_not(model) -> str | None:
    """Why this model's passes cannot be packed exactly, else None."""
    config = _config(model)
    if getattr(config, "position_embedding_type", "rotary") not in ("rotary", "relative_key", "alibi") or \
            not any(getattr(config, k, None) is not None for k in ROTARY_CONFIG_KEYS):
        return (f"{type(model).__name__} has no rotary position embeddings: TRL's left-padded forward shifts its "
                "positions, a packed one would not")
    return None


class PackingState:
    def __init__(self, line: str):
        self.line = line  # TRL's scoring flavour: "fused" (1.16's fused head) or "logits" (1.9.2)
        self.positions: int | None = None  # what the last pass computed, for the pass counting (pad_share)
        self.calls = {"packed": 0, "padded": 0}


class PaddingFree:
    """The trainer's layer (OgrpoGRPOTrainer): off until `pack_sequences()` turns it on."""

    packing: PackingState | None = None

    def pack_sequences(self) -> str | None:
        """Answer the log-prob passes from packed rows where that is exact; returns why not, else None."""
        unwrapped = kernel_patch.unwrap(self, self.model)
        reason = why_not(unwrapped)
        if reason is None:
            self.packing = PackingState(kernel_patch.check())
        return reason

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        state = self.packing
        chunks = None if state is None else _packable(*args, **kwargs)
        if chunks is None:
            if state is not None:
                state.calls["padded"] += 1
                state.positions = None
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        import torch

        model, input_ids, logits_to_keep, batch_size, compute_entropy = _args(*args, **kwargs)

        state.calls["packed"] += 1
        state.positions = sum(p.positions for p in chunks)
        logps, entropies = [], []
        for (lo, hi), packed in zip(_bounds(input_ids.size(0), batch_size), chunks):
            lp, ent = _score(self, model, packed, compute_entropy)
            out = lp.new_zeros(hi - lo, logits_to_keep).index_put(packed.dest, lp)
            logps.append(out)
            if compute_entropy:
                entropies.append(ent.new_zeros(hi - lo, logits_to_keep).index_put(packed.dest, ent))
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None


def _args(model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, *_, **__):
    return model, input_ids, logits_to_keep, batch_size, compute_entropy


def _packable(model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
              compute_aux_loss=False, **extra):
    """The packed chunks of one of TRL's passes, or None where it keeps TRL's padded rows: the MoE load-balancing
    loss (TRL's averages over its rows' attention mask, a packed pass would count its filler), multimodal inputs,
    a row with no prompt token."""
    if compute_aux_loss or any(v is not None for v in extra.values()):
        return None
    return _chunks(model, input_ids, attention_mask, logits_to_keep, batch_size)


def _bounds(rows: int, batch_size: int | None):
    size = batch_size or rows  # TRL's chunking of a pass, kept: as many forwards as TRL runs
    return [(lo, min(lo + size, rows)) for lo in range(0, rows, size)]


def _chunks(model, input_ids, attention_mask, logits_to_keep, batch_size):
    config = _config(model)
    flash = "flash" in str(getattr(config, "_attn_implementation", ""))
    costs = Costs.of(config)
    chunks = []
    for lo, hi in _bounds(input_ids.size(0), batch_size):
        mask = attention_mask[lo:hi]
        if flash:  # FlashAttention-2 reads packed sequences only from a batch of one; its varlen path wastes nothing
            capacity = int(mask.sum())
        else:
            capacity = choose_capacity(mask.sum(1).tolist(), mask.size(1), costs)
        chunks.append(None if capacity is None else pack(input_ids[lo:hi], mask, logits_to_keep, capacity))
    return None if any(c is None for c in chunks) else chunks


def _score(trainer, model, packed: Packed, compute_entropy: bool):
    """(log-probs, entropies) of the packed completion tokens, flat, by the path TRL's own pass would take: the
    linear_logprobs kernel where it scores this trainer's passes, else TRL's line (1.16's fused head, 1.9.2's
    logits)."""
    import torch

    b, c = packed.scored
    targets = packed.input_ids[b, c]
    scorer = trainer.logprobs_scorer
    if scorer is not None and getattr(kernel_patch.unwrap(trainer, model), kernel_patch.PATCHED, False):
        scorer.calls["kernel"] += 1
        spec = {"temperature": trainer.temperature, "index": (b, c - 1), "targets": targets}
        kwargs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids, kernel_patch.FORWARD_KEY: spec}
        if trainer.packing.line == "fused":
            with trainer.accelerator.autocast():
                logps, entropies = model(**kwargs)
        else:
            logps, entropies = model(**kwargs)
            if not getattr(trainer, "_entropy_bonus_enabled", False):
                entropies = entropies.detach()
        return logps, entropies
    if trainer.packing.line == "fused":
        labels = torch.full_like(packed.input_ids, -100)
        labels[b, c] = targets
        with trainer.accelerator.autocast():
            out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, labels=labels,
                        fused_lm_head=True)
        return out.log_probs[b, c - 1], (out.entropy[b, c - 1] if compute_entropy else None)
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    with _head_only_at(kernel_patch.unwrap(trainer, model), (b, c - 1)):
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits[0]
    logits = logits / trainer.temperature
    logps = selective_log_softmax(logits, targets)
    entropies = None
    if compute_entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and getattr(trainer, "_entropy_bonus_enabled", False)):
            entropies = entropy_from_logits(logits)
    return logps, entropies


class _head_only_at:
    """While inside: the model's output head projects only the hidden states at `index` (as one row), so the
    logits of a packed pass are those TRL's padded pass keeps, not one per prompt token."""

    def __init__(self, model, index):
        self.head, self.index, self.handle = model.get_output_embeddings(), index, None

    def __enter__(self):
        b, c = self.index
        self.handle = self.head.register_forward_pre_hook(lambda _m, args: (args[0][b, c][None],))
        return self

    def __exit__(self, *exc):
        self.handle.remove()
