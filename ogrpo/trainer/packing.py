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
    return [_rows(b) for b in fill_bins(dict(enumerate(lengths)), [], capacity)]


@dataclass(frozen=True)
class Family:
    """Rows sharing their prompt: the prompt but its last token (`prefix` positions) computed once per bin that
    holds any of them, then per row (`segments`: row -> positions) its last prompt token and its completion."""

    prefix: int
    segments: dict

    def length(self, rows) -> int:
        return self.prefix + sum(self.segments[r] for r in rows)


def fill_bins(alone: dict, families: list[Family], capacity: int) -> list[list[tuple]]:
    """Bins of at most `capacity` positions (a row longer than that alone in one), each a list of (family index
    or None, rows). Longest first: a row alone goes to the first bin with room; a family goes whole where a bin
    has room, else it splits: the bin with the most room that takes the prefix and a row gets as many of the
    family's rows as fit, longest first, each part repeating the prefix. Splitting fills the bins that whole
    families would leave part empty (the filler every bin is padded with)."""
    items = sorted([(n, -1, r) for r, n in alone.items()] +
                   [(f.length(f.segments), i, -1) for i, f in enumerate(families)], key=lambda x: (-x[0], x[1], x[2]))
    bins: list[list[tuple]] = []
    room: list[int] = []

    def place(b, family, rows, n):
        if b is None:
            bins.append([])
            room.append(capacity)
            b = len(bins) - 1
        bins[b].append((family, rows))
        room[b] -= n

    for n, i, r in items:
        if i < 0:
            place(next((b for b, left in enumerate(room) if n <= left), None), None, [r], n)
            continue
        f = families[i]
        left = sorted(f.segments, key=lambda x: (-f.segments[x], x))
        while left:
            whole = next((b for b, space in enumerate(room) if f.length(left) <= space), None)
            if whole is not None:
                place(whole, i, sorted(left), f.length(left))
                break
            smallest = f.prefix + min(f.segments[x] for x in left)
            fits = [b for b, space in enumerate(room) if smallest <= space]
            b = max(fits, key=lambda b: (room[b], -b)) if fits else None  # None: a new bin
            space, take = (capacity if b is None else room[b]) - f.prefix, []
            for x in left:
                if f.segments[x] <= space:
                    take.append(x)
                    space -= f.segments[x]
            take = take or left[:1]  # (a new bin) a row longer than a bin: alone in it
            place(b, i, sorted(take), f.length(take))
            left = [x for x in left if x not in take]
    return [sorted(b, key=lambda entry: entry[1][0]) for b in bins]  # in row order within a bin


def _rows(bin_: list[tuple]) -> list[int]:
    return sorted(r for _, rows in bin_ for r in rows)


def bin_lengths(bins: list[list[tuple]], alone: dict, families: list[Family]) -> list[int]:
    return [sum(alone[rows[0]] if i is None else families[i].length(rows) for i, rows in b) for b in bins]


def balanced_fill(alone: dict, families: list[Family], capacity: int) -> list[list[tuple]]:
    """As few bins as `fill_bins` needs at `capacity`, each as short as that count allows: the bins are padded to
    the longest, so even bins leave the least filler."""
    bins = fill_bins(alone, families, capacity)
    atoms = [*alone.values(), *(f.prefix + max(f.segments.values()) for f in families)]
    total = sum(alone.values()) + sum(f.length(f.segments) for f in families)
    lo, hi = max(max(atoms), -(-total // len(bins))), capacity
    while lo < hi:  # the shortest capacity that still needs no more bins
        mid = (lo + hi) // 2
        if len(fill_bins(alone, families, mid)) <= len(bins):
            hi = mid
        else:
            lo = mid + 1
    tighter = fill_bins(alone, families, lo) if lo < capacity else bins
    return tighter if len(tighter) <= len(bins) else bins


def balanced_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """`balanced_fill` of rows alone: row indices per bin."""
    return [_rows(b) for b in balanced_fill(dict(enumerate(lengths)), [], capacity)]


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
    return rows_layout(lengths, width, costs)[1]


def rows_layout(lengths: list[int], width: int, costs: Costs | None) -> tuple[float | None, int | None]:
    """(cost, bin length) of the rows' pass `choose_capacity` picks: packed at that length, or TRL's padded rows
    (None, at their cost); (None, width) where no shape is known."""
    if costs is None:
        return None, width
    padded = costs.of_rows(len(lengths), width)
    cost, capacity = cheapest_capacity(dict(enumerate(lengths)), [], width, costs)
    return (cost, capacity) if cost < CLEARLY_CHEAPER * padded else (padded, None)


CLEARLY_CHEAPER = 0.95  # a packed layout replaces TRL's padded rows only below this share of their cost


def cheapest_capacity(alone: dict, families: list[Family], width: int, costs: Costs) -> tuple[float, int]:
    """(cost, bin length) of the cheapest packed pass of `alone` (row -> length) and `families`, bin lengths from
    TRL's padded row upwards."""
    best, capacity = None, width
    while True:
        lengths = bin_lengths(balanced_fill(alone, families, capacity), alone, families)
        cost = costs.of_rows(len(lengths), max(lengths))
        if best is None or cost < best[0]:
            best = (cost, capacity)
        total = sum(lengths)
        if capacity >= total:
            return best
        capacity = min(total, capacity * 3 // 2 + 1)


@dataclass
class Packed:
    input_ids: object  # [bins, width]: the rows' real tokens end to end, the rest one filler sequence
    position_ids: object  # [bins, width]: 0.. per sequence (the filler too: a sequence of its own)
    scored: tuple  # (bin, column) of every completion token that TRL scores; its predictor is at column - 1
    dest: tuple  # (row, column) of the same tokens in TRL's [rows, logits_to_keep] layout
    real: int = 0  # positions that are not filler
    attention_mask: object = None  # [bins, 1, width, width] bool where a prompt is shared, else None (positions)

    @property
    def positions(self) -> int:
        return self.input_ids.numel()


def prompt_families(input_ids, attention_mask, logits_to_keep: int) -> list[list[int]]:
    """Rows (2 or more) whose real prompt tokens are the same and at least 2 long, each with a completion token:
    the generations of one prompt. Their prompt is computed once (`pack(families=...)`)."""
    mask = attention_mask.bool()
    start = mask.size(1) - logits_to_keep
    by_prompt: dict[tuple, list[int]] = {}
    for r in range(mask.size(0)):
        prompt = input_ids[r, :start][mask[r, :start]]
        if prompt.numel() >= 2 and mask[r, start:].any():
            by_prompt.setdefault(tuple(prompt.tolist()), []).append(r)
    return [rows for rows in by_prompt.values() if len(rows) >= 2]


def _units(mask, logits_to_keep: int, families: list[list[int]]) -> tuple[dict, list[Family]]:
    """(row -> length of the rows packed alone, the families as `Family`) of one chunk's padded rows."""
    lengths = mask.sum(1).tolist()
    start = mask.size(1) - logits_to_keep
    shared = {r for rows in families for r in rows}
    out = []
    for rows in families:
        prompt = int(mask[rows[0], :start].sum())
        out.append(Family(prompt - 1, {r: lengths[r] - prompt + 1 for r in rows}))
    return {r: n for r, n in enumerate(lengths) if r not in shared}, out


def pack(input_ids, attention_mask, logits_to_keep: int, capacity: int | None = None,
         families: list[list[int]] | None = None) -> Packed | None:
    """TRL's padded rows -> packed bins of at most `capacity` tokens (default: the padded row's width; a row is
    never split); None where a completion token would have no token before it, or no token is scored.

    `families` (rows sharing their prompt, `prompt_families`): each family's prompt but its last token is placed
    once per bin that holds its rows, and each row follows as its own sequence (its last prompt token, then its
    completion) that attends to that prefix and to itself (`attention_mask`). Positions continue the prefix's, so
    each token sees the same tokens at the same relative positions as in its own row: the same log-probs,
    computed from fewer positions."""
    import torch

    mask = attention_mask.bool()
    rows, width = mask.shape
    start = width - logits_to_keep  # TRL's completion columns: the last logits_to_keep
    if any(not mask[r, :start].any() and mask[r, start:].any() for r in range(rows)):
        return None  # no prompt token: the first completion token has no predictor in its own sequence
    real = [mask[r].nonzero()[:, 0] for r in range(rows)]
    alone, fams = _units(mask, logits_to_keep, families or [])
    bins = balanced_fill(alone, fams, capacity or width)
    size = max(bin_lengths(bins, alone, fams))
    ids = input_ids.new_zeros(len(bins), size)
    pos = torch.zeros(len(bins), size, dtype=torch.long, device=input_ids.device)
    seq = torch.zeros(len(bins), size, dtype=torch.long, device=input_ids.device)  # a sequence's id, from 1
    parent = torch.full_like(seq, -1)  # the id of the shared prompt a sequence also sees
    scored_b, scored_c, dest_r, dest_c = [], [], [], []
    made = 0

    def place(b, offset, r, tokens, first_position, parent_id):
        nonlocal made
        n = tokens.numel()
        made += 1
        ids[b, offset:offset + n] = input_ids[r, tokens]
        pos[b, offset:offset + n] = torch.arange(first_position, first_position + n, device=pos.device)
        seq[b, offset:offset + n] = made
        parent[b, offset:offset + n] = parent_id
        return offset + n

    for b, bin_ in enumerate(bins):
        offset = 0
        for family, members in bin_:
            skip, prefix_id = 0, -1
            if family is not None:  # the prompt but its last token, once; each row from its last prompt token
                skip = fams[family].prefix
                offset = place(b, offset, members[0], real[members[0]][:skip], 0, -1)
                prefix_id = made
            for r in members:
                tokens = real[r][skip:]
                tail = (tokens >= start).nonzero()[:, 0]
                scored_b.append(torch.full_like(tail, b))
                scored_c.append(tail + offset)
                dest_r.append(torch.full_like(tail, r))
                dest_c.append(tokens[tail] - start)
                offset = place(b, offset, r, tokens, skip, prefix_id)
        pos[b, offset:] = torch.arange(size - offset, device=pos.device)
        seq[b, offset:] = -2 - b  # the filler: a sequence of its own
    cat = torch.cat
    if not sum(t.numel() for t in scored_c):
        return None  # nothing to score (every completion masked): TRL's pass answers with its zeros
    attention = None
    if fams:
        sees = (seq[:, None, :] == seq[:, :, None]) | (seq[:, None, :] == parent[:, :, None])  # [bin, query, key]
        attention = (sees & torch.ones(size, size, dtype=torch.bool, device=seq.device).tril())[:, None]
    return Packed(ids, pos, (cat(scored_b), cat(scored_c)), (cat(dest_r), cat(dest_c)),
                  real=int((seq > 0).sum()), attention_mask=attention)


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
        # (positions computed, positions not filler) of the last pass, for the pass counting (pad_share)
        self.positions: tuple[int, int] | None = None
        # passes: packed, TRL's padded rows, and packed passes that computed a prompt once for its rows
        self.calls = {"packed": 0, "padded": 0, "shared": 0}
        # None: the cost model picks per chunk; "shared" or "rows" holds one layout (benchmarks and tests)
        self.layout: str | None = None


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
        chunks = None if state is None else _packable(*args, layout=state.layout, **kwargs)
        if chunks is None:
            if state is not None:
                state.calls["padded"] += 1
                state.positions = None
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        import torch

        model, input_ids, logits_to_keep, batch_size, compute_entropy = _args(*args, **kwargs)

        state.calls["packed"] += 1
        state.calls["shared"] += any(p.attention_mask is not None for p in chunks)
        state.positions = sum(p.positions for p in chunks), sum(p.real for p in chunks)
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
              compute_aux_loss=False, layout=None, **extra):
    """The packed chunks of one of TRL's passes, or None where it keeps TRL's padded rows: the MoE load-balancing
    loss (TRL's averages over its rows' attention mask, a packed pass would count its filler), multimodal inputs,
    a row with no prompt token."""
    if compute_aux_loss or any(v is not None for v in extra.values()):
        return None
    return _chunks(model, input_ids, attention_mask, logits_to_keep, batch_size, layout)


def _bounds(rows: int, batch_size: int | None):
    size = batch_size or rows  # TRL's chunking of a pass, kept: as many forwards as TRL runs
    return [(lo, min(lo + size, rows)) for lo in range(0, rows, size)]


def _chunks(model, input_ids, attention_mask, logits_to_keep, batch_size, layout=None):
    config = _config(model)
    flash = "flash" in str(getattr(config, "_attn_implementation", ""))
    costs = Costs.of(config)
    share = why_not_share(config) is None and layout != "rows"
    chunks = []
    for lo, hi in _bounds(input_ids.size(0), batch_size):
        ids, mask = input_ids[lo:hi], attention_mask[lo:hi]
        if flash:  # FlashAttention-2 reads packed sequences only from a batch of one; its varlen path wastes nothing
            chunks.append(pack(ids, mask, logits_to_keep, int(mask.sum())))
            continue
        (rows_cost, capacity), families = rows_layout(mask.sum(1).tolist(), mask.size(1), costs), None
        candidates = prompt_families(ids, mask, logits_to_keep) if share and costs is not None else []
        if candidates:  # each prompt once, where that is clearly cheaper than the rows' own pass
            shared_cost, shared_capacity = _shared_cost(mask, logits_to_keep, candidates, costs)
            if layout == "shared" or shared_cost < CLEARLY_CHEAPER * rows_cost:
                capacity, families = shared_capacity, candidates
        chunks.append(None if capacity is None else pack(ids, mask, logits_to_keep, capacity, families))
    return None if any(c is None for c in chunks) else chunks


def _shared_cost(mask, logits_to_keep: int, families: list[list[int]], costs: Costs) -> tuple[float, int]:
    """(cost, bin length) of the cheapest pass that computes each family's prompt once per bin."""
    alone, fams = _units(mask, logits_to_keep, families)
    return cheapest_capacity(alone, fams, mask.size(1), costs)


def why_not_share(config) -> str | None:
    """Why rows that share a prompt cannot compute it once in this model's passes, else None. The shared prefix
    needs a custom mask: SDPA takes one as it is (FlashAttention-2 takes none, eager would hold every bin's scores);
    a sliding window would be dropped by it."""
    implementation = str(getattr(config, "_attn_implementation", ""))
    if implementation != "sdpa":
        return f"attention {implementation or 'unknown'}: a shared prompt needs SDPA's custom mask"
    windows = getattr(config, "layer_types", None)
    if (any("sliding" in str(t) for t in windows) if windows else
            getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)):
        return "sliding-window attention: a custom mask would drop the window"
    return None


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
        kwargs = {**_inputs(packed), kernel_patch.FORWARD_KEY: spec}
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
            out = model(**_inputs(packed), labels=labels, fused_lm_head=True)
        return out.log_probs[b, c - 1], (out.entropy[b, c - 1] if compute_entropy else None)
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    with _head_only_at(kernel_patch.unwrap(trainer, model), (b, c - 1)):
        logits = model(**_inputs(packed), use_cache=False).logits[0]
    logits = logits / trainer.temperature
    logps = selective_log_softmax(logits, targets)
    entropies = None
    if compute_entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and getattr(trainer, "_entropy_bonus_enabled", False)):
            entropies = entropy_from_logits(logits)
    return logps, entropies


def _inputs(packed: Packed) -> dict:
    """The model inputs of a packed pass: the positions say where each sequence starts, unless a shared prompt
    needs the mask spelled out."""
    extra = {} if packed.attention_mask is None else {"attention_mask": packed.attention_mask}
    return {"input_ids": packed.input_ids, "position_ids": packed.position_ids, **extra}


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
