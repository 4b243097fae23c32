"""Lossless streaming, a completion's scoring passes on its prefix (issue 36): while the server still generates a
completion, the trainer runs its reference (and, where TRL needs one, old-policy) pass on the tokens sampled so
far, extending a key/value cache as more arrive (ogrpo.serve.prefix_stream sends them every few tokens), so that
when the completion ends only its last tokens are left to score. Without it, the pass of the completion that ends
last runs whole after generation, on the step's critical path.

Why it is exact: the passes score with weights that do not change before the optimizer step, under no gradient;
a causal model's log-prob of a token depends only on the tokens before it, so the sequence fed in pieces through a
cache gives the log-probs the whole sequence gives (to float rounding: attention over a cache sums in another
order, as the padding-free pass does). The pieces go through the model's own forward and TRL's fused LM head
(`fused_lm_head=True`: its temperature, soft-capping and logit scale), as TRL's pass does, with the positions the
padding-free pass gives (the prompt's real tokens from 0). The tokens a completion ends with are checked against
the prefix scored; on any difference the prefix is dropped and the pass runs whole, as without it.

Memory: a prefix holds a key/value cache, no activations: 2 x layers x kv-heads x head-dim values per position,
a small share of what one position's activations take in the loss forward the plan budgets for. At most
MAX_OPEN prefixes are held at once, and each is released when its completion is scored.

The loss forward goes the same way where TrainAhead allows it (`grad=True`): the policy's pieces run with their
graph kept through the cache, so that when the completion ends its forward is all but done and only its backward
waits. Its graph is held within the budget TrainAhead holds the graphs of completions forwarded as they end by,
reserved at the cap while the completion grows.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

MAX_OPEN = 8  # prefixes held at once; the completions that end last are those still generating at the end
# the fewest new tokens a piece scores: each piece pays the model's per-call cost, and the pieces run while the
# server generates on the next device set (on CPU, beside it: a busier trainer slows the server's core)
MIN_PIECE = 48
# a completion's prefix is first scored once it is this share of the length cap: only the pass of a completion that
# ends last is on the step's critical path, and those still generating late are the long ones (all start
# together); the shorter ones' passes run at their end, while the server still generates, at no cost in pieces
START_SHARE = 0.5
# loss forwards on prefixes held at once (graphs kept): one follows the completion that is to end last, and the budget
# left forwards (and backwards) the others as they end; another begins once it has ended
MAX_FORWARDS = 1
# a loss forward's pieces are at least this share of the cap: each piece's attention keeps the keys and values so
# far for its backward, so its pieces are few (a cap of 4096: 4 pieces between half the cap and the cap)
FORWARD_PIECE_SHARE = 1 / 8


LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")  # RoPE types whose frequencies depend on the length seen


def rope_why_not(config) -> str | None:
    """Why pieces through a cache would not rotate keys as one whole pass does, else None: RoPE whose frequencies
    depend on the longest position seen (dynamic NTK, LongRoPE) rotates a piece's keys by the length so far."""
    specs = [getattr(config, name, None) for name in ("rope_parameters", "rope_scaling")]
    for spec in specs:
        if not isinstance(spec, dict):
            continue
        # transformers 5 may hold one per attention type
        for one in ([spec] if "rope_type" in spec or "type" in spec else list(spec.values())):
            kind = one.get("rope_type", one.get("type")) if isinstance(one, dict) else None
            if kind in LENGTH_DEPENDENT_ROPE:
                return f"RoPE {kind!r} rotates by the length seen so far: a piece's keys differ from a whole pass's"
    return None


def report_failure(state, exc: BaseException) -> None:
    """A piece that failed: that completion's passes run whole at its end (the same numbers, later); said once per
    run on stderr, and counted (`state.prefix_failures`)."""
    import sys

    state.prefix_failures = getattr(state, "prefix_failures", 0) + 1
    if state.prefix_failures == 1:
        print(f"note: a completion's pass on its prefix failed ({type(exc).__name__}: {exc}); such completions' "
              "passes run whole when they end", file=sys.stderr, flush=True)


class Prefixes:
    """The completions' token ids so far, put by the request threads (`put`), taken by the trainer's thread
    (`take`). `wake` is done while some completion has tokens the trainer has not taken."""

    def __init__(self):
        self._lock = threading.Lock()
        self.latest: dict[tuple[int, int], list[int]] = {}
        self.taken: dict[tuple[int, int], int] = {}
        self.ended: set[tuple[int, int]] = set()
        self.wake: Future = Future()

    def put(self, group: int, j: int, ids: list[int]) -> None:
        with self._lock:
            key = (group, j)
            if key in self.ended:
                return
            self.latest[key] = ids
            if not self.wake.done():
                self.wake.set_result(None)

    def end(self, group: int, j: int) -> None:
        """Completion j of `group` is back: no more prefixes of it."""
        with self._lock:
            self.ended.add((group, j))
            self.latest.pop((group, j), None)

    def take(self, allowed, least: int = 1, start: int = 0) -> tuple[tuple[int, int], list[int]] | None:
        """The completion with the most tokens not yet taken (at least `least`, and `start` so far for its first
        piece), among those `allowed(key)` accepts, and its ids so far; None when there is none (`wake` is then
        reset until the next put)."""
        with self._lock:
            fresh = [(len(ids) - self.taken.get(key, 0), key) for key, ids in self.latest.items()
                     if len(ids) - self.taken.get(key, 0) >= least and (key in self.taken or len(ids) >= start)
                     and allowed(key)]
            if not fresh:
                if self.wake.done():
                    self.wake = Future()
                return None
            _, key = max(fresh)
            ids = self.latest[key]
            self.taken[key] = len(ids)
            return key, ids


class IncrementalPass:
    """One sequence's log-prob pass, fed in pieces: `extend(completion so far)` scores the completion tokens whose
    previous token is known, `finish(completion)` the rest and returns the (1, len) log-probs, or None where the
    completion does not start with the prefix scored. Without gradient (the scoring passes), or with it (`grad`:
    the loss forward, its entropies in `entropies` after `finish`)."""

    def __init__(self, trainer, model, prompt: list[int], context=None, grad: bool = False):
        """`context()`: entered around each piece (TRL's gradient checkpointing switched off, as its passes do)."""
        import contextlib

        self.trainer, self.model, self.prompt, self.grad = trainer, model, list(prompt), grad
        self.context = context or contextlib.nullcontext
        self.cache = None
        self.seq: list[int] = list(prompt)  # the tokens known so far
        self.fed = 0  # positions in the cache
        self.logps: list = []
        self.pieces: list = []  # the loss forward's entropies, piece by piece
        self.entropies = None

    def extend(self, completion: list[int]) -> None:
        import torch
        from transformers import DynamicCache

        seq = self.prompt + list(completion)
        if seq[:len(self.seq)] != self.seq:
            raise ValueError("a completion's tokens so far changed under the prefix already scored")
        end = len(seq) - 1  # the last known token has no label yet
        if end <= self.fed:
            self.seq = seq
            return
        p = len(self.prompt)
        device = self.trainer.accelerator.device
        ids = torch.tensor([seq[self.fed:end]], device=device)
        labels = torch.tensor([[t if self.fed + 1 + k >= p else -100 for k, t in enumerate(seq[self.fed + 1:end + 1])]],
                              device=device)
        if self.cache is None:
            self.cache = DynamicCache(config=self.model.config)
        positions = torch.arange(self.fed, end, device=device).unsqueeze(0)
        scored = labels[0] != -100
        if self.grad:
            logps, entropies = loss_piece(self.trainer, self.model, ids, positions, self.cache, labels)
            if bool(scored.any()):
                self.logps.append(logps[0][scored])
                self.pieces.append(entropies[0][scored])
        else:
            with torch.no_grad(), self.context(), self.trainer.accelerator.autocast():
                out = self.model(input_ids=ids, position_ids=positions, past_key_values=self.cache,
                                 shift_labels=labels, fused_lm_head=True)
            if bool(scored.any()):
                self.logps.append(out.log_probs[0][scored].float())
        if self.cache.get_seq_length() != end:  # a model that drops it (checkpointing in training) scores wrongly
            raise RuntimeError(f"the model kept {self.cache.get_seq_length()} of {end} positions in its key/value "
                               "cache")
        profiler = getattr(self.trainer, "stage_profiler", None)
        if profiler is not None:
            profiler.count_positions(ids.size(1), ids.size(1))
        self.fed, self.seq = end, seq

    def finish(self, completion: list[int]):
        import torch

        seq = self.prompt + list(completion)
        if not completion or seq[:len(self.seq)] != self.seq:
            return None
        self.extend(completion)
        logps = torch.cat(self.logps) if self.logps else torch.zeros(0, device=self.trainer.accelerator.device)
        self.cache = None
        if logps.numel() != len(completion):
            return None
        if self.grad:
            self.entropies = torch.cat(self.pieces).unsqueeze(0)
        return logps.unsqueeze(0)


def loss_piece(trainer, model, ids, positions, cache, labels):
    """(log-probs, entropies) of a piece of the policy's loss forward, with their graph, by the path the trainer's
    own loss forward takes: the linear_logprobs kernel where it scores the policy, else TRL's fused head (whose
    entropies the policy's head computes); each position's label in `labels`, -100 where none is scored."""
    import torch

    from ogrpo.patches import trl_linear_logprobs as kernel  # heavy: torch, and pipeline.py's importers are light

    with trainer.compute_loss_context_manager(), trainer.accelerator.autocast():
        if trainer.logprobs_scorer is not None and getattr(kernel.unwrap(trainer, model), kernel.PATCHED, False):
            c = (labels[0] != -100).nonzero()[:, 0]
            spec = {"temperature": trainer.temperature, "index": (torch.zeros_like(c), c), "targets": labels[0, c]}
            logps, entropies = model(input_ids=ids, position_ids=positions, past_key_values=cache,
                                     **{kernel.FORWARD_KEY: spec})
            full = logps.new_zeros(labels.shape).index_put((torch.zeros_like(c), c), logps)
            return full, entropies.new_zeros(labels.shape).index_put((torch.zeros_like(c), c), entropies)
        out = model(input_ids=ids, position_ids=positions, past_key_values=cache, shift_labels=labels,
                    fused_lm_head=True)
        return out.log_probs, out.entropy
