"""The readable form of a Plan for `ogrpo plan` (box-drawn tables on stdout)."""

from __future__ import annotations

import sys

from ogrpo.planner.device_rules import rules_of
from ogrpo.planner.types import Mode
from ogrpo.render.boxes import box_table, styled, wrap


def _terms(terms: dict) -> str:
    items = [(k, v) for k, v in terms.get("terms", {}).items() if v >= 0.005]
    return ", ".join(f"{k} {v:.2f}" for k, v in items)


def _count(n: float) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def _value(v) -> str:
    text = "-" if v is None else str(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _where(nodes: list[int], gpus: list[int], processes: int, rules) -> str:
    node = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {nodes[0]}-{nodes[-1]}"
    return f"{node}, {rules.devices_text(gpus, processes)}"


def _kv_share(args) -> str:
    if args.kv_cache_memory_bytes:
        return f"KV {args.kv_cache_memory_bytes / 2**20:,.0f} MiB"
    return f"{args.gpu_memory_utilization} of the device"


def print_plan(plan, out=None) -> None:
    out = out or sys.stdout

    def say(text: str = "") -> None:
        out.write(text + "\n")

    p = plan
    m, rules = p.model, rules_of(p)
    unit = rules.unit
    say(wrap(f"{p.cluster.spec} · {m.name} ({_count(m.params)} params, {m.source}) · profile {p.profile} · "
             f"mode {p.mode} · {p.precision} · {p.attn_implementation}"))
    rows = []
    v, tr = p.vllm, p.trainer
    mt = v.memory_terms or {}
    if p.mode is Mode.SERVER:
        rows.append(["vLLM server", _where(v.nodes, v.gpus, 1, rules),
                     f"TP {v.tensor_parallel_size}, DP {v.data_parallel_size}; "
                     f"{mt.get('max_concurrent_seqs', 0)} x {v.args.max_model_len} tokens in KV",
                     f"{mt['total_gib']:.1f}", f"{mt['budget_gib']:.1f}", _terms(mt)])
    elif p.mode is Mode.COLOCATE and mt:
        rows.append(["vLLM (colocated)", "in each trainer process",
                     f"{_kv_share(v.args)}; {mt.get('max_concurrent_seqs', 0)} x "
                     f"{v.args.max_model_len} tokens in KV", f"{mt['total_gib']:.1f}",
                     f"{mt['budget_gib']:.1f}", _terms(mt)])
    tt = tr.memory_terms
    rows.append(["trainer", _where(tr.nodes, tr.gpus, tr.num_processes, rules), f"{tr.num_processes} x {tr.strategy}",
                 f"{tt['total_gib']:.1f}", f"{tt['budget_gib']:.1f}", _terms(tt)])
    say(box_table(["role", "where", "layout", f"GiB/{unit}", "budget", "memory terms (GiB)"], rows, right=(3, 4),
                  stream=out))
    b = p.batch
    say(wrap(f"batch: {b.per_device_train_batch_size} per device x {b.num_processes} processes x "
             f"{b.steps_per_generation} steps = generation batch {b.generation_batch_size} "
             f"({b.prompts_per_generation} prompts x {b.num_generations} generations); "
             f"prompt {b.prompt_length} + completion {b.completion_length} tokens"))
    say(box_table(["setting", "value", "why"],
                  [[item.name, str(item.value), item.reason] for item in p.settings],
                  title="settings", stream=out))
    if p.changes:
        say(box_table(["key", "recipe", "run", "why"],
                      [[c.key, _value(c.old), _value(c.new), c.reason] for c in p.changes],
                      title="changes from the recipe", stream=out))
    for w in p.warnings:
        say(wrap(styled("note:", "yellow", stream=out) + f" {w}"))
    if p.fits:
        say(styled("fits", "bold", "green", stream=out))
    else:
        say(styled("does not fit", "bold", "red", stream=out))
        for r in p.reasons:
            say(f"  - {r}")
        if p.fixes:
            say("try: " + "; ".join(p.fixes))
