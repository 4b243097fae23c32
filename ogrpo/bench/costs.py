"""`python -m ogrpo.bench.costs [--write]`: the per-token costs the planner chooses where generation runs with
(ogrpo/planner/costs.py), measured on this machine for a few model sizes; `--write` puts them in the shipped
table ogrpo/data/generation_costs.json (`--models` a subset: the other sizes' entries stay).

Per model size (random Qwen2 weights, fp32 checkpoint), one device each, as the split placement gives them:
- hf_tok_s: TRL's rollout without vLLM (HF generate) in one process with one thread (a trainer process);
- server_tok_s / server_bf16_tok_s: O-GRPO's server path (`ogrpo serve` + TRL's client) in fp32, and in bf16
  where the CPU has bf16 matrix units (AMX / avx512_bf16);
- request_s: one 1-token request to that server (the fixed cost of a generation call);
- push_s: one weight push of the whole model through the CPU weight-transfer backend (TRL's
  update_named_params + reset_prefix_cache, as `sync_weights` makes them);
- train_tok_s: prompt + completion tokens per second of one scoring pass (no grad) plus loss, backward and an
  AdamW step, in one process with one thread, on 8 of the rollout's sequences.
Rollouts are 8 prompts x 8 completions x 128 tokens (EOS ignored), the median of 3 repeats.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from ogrpo.bench.harness import device_name
from ogrpo.tables import format_table
from ogrpo.bench.rollout import (RESULT_TAG, RolloutShape, Workload, _server_generate, _spawn, _start_server,
                                 _stop_server, _wait_health, build_model, make_prompts)
from ogrpo.planner import costs
from ogrpo.serve.client import install_cpu_client

SHAPES = {
    "tiny": RolloutShape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=384),
    "32.5M": RolloutShape(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=2048, vocab=4096),
}
PROMPTS, GENERATIONS, NEW_TOKENS, PROMPT_TOKENS, REPEATS = 8, 8, 128, 32, 3
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
TRAIN_ROWS = 8


def _server_costs(w: Workload) -> dict:
    """Rollout tokens/s, one request's seconds and one push's seconds against one `ogrpo serve`."""
    import torch
    from transformers import AutoModelForCausalLM

    proc, port, log = _start_server(w)
    try:
        _wait_health(f"http://127.0.0.1:{port}/health", proc, timeout=900)
        once, produced = _server_generate(w, port)
        once()  # warm-up
        times = []
        for _ in range(w.repeats):
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
        client = install_cpu_client()(base_url=f"http://127.0.0.1:{port}", connection_timeout=60)
        request = []
        for _ in range(5):
            t0 = time.perf_counter()
            client.generate(w.prompts[:1], n=1, max_tokens=1, logprobs=0)
            request.append(time.perf_counter() - t0)
        client.init_communicator(device="cpu")
        model = AutoModelForCausalLM.from_pretrained(w.model_dir, dtype=torch.float32)
        meta = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in model.named_parameters()]
        push = []
        for _ in range(w.repeats):
            t0 = time.perf_counter()
            client.update_named_params(meta, iter(list(model.named_parameters())))
            client.reset_prefix_cache()
            push.append(time.perf_counter() - t0)
        client.close_communicator()
        return {"tok_s": produced["n"] / statistics.median(times), "request_s": statistics.median(request),
                "push_s": statistics.median(push)}
    finally:
        _stop_server(proc, port, log)


def _train_costs(w: Workload) -> dict:
    """Tokens per second of one no-grad scoring pass plus loss, backward and an AdamW step (one thread)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(w.model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    # one trainer process's micro-batch: tokens per second hardly change with the number of rows beyond it
    n = min(TRAIN_ROWS, len(w.prompts) * w.generations)
    ids = torch.randint(2, model.config.vocab_size, (n, len(w.prompts[0]) + w.new_tokens))

    def once():
        with torch.no_grad():
            model(input_ids=ids)
        loss = model(input_ids=ids).logits.float().log_softmax(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    once()
    times = []
    for _ in range(w.repeats):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return {"tok_s": ids.numel() / statistics.median(times)}


def measure(name: str, shape: RolloutShape, work: Path, bf16: bool, out=sys.stdout) -> dict:
    """One table entry for `shape` (each path in its own subprocess)."""
    model_dir = build_model(shape, "float32", work / f"model-{name}")
    entry = {"device": "cpu", "model": name, "params": shape.params()}
    for dtype in ("float32", "bfloat16") if bf16 else ("float32",):
        w = Workload(model_dir=str(model_dir), dtype=dtype, prompts=make_prompts(PROMPTS, PROMPT_TOKENS, shape.vocab),
                     generations=GENERATIONS, new_tokens=NEW_TOKENS, repeats=REPEATS, gpu_memory_utilization=None,
                     enforce_eager=False, workdir=str(work / f"run-{name}-{dtype}"),
                     kv_cache_bytes=256 * 2**20)
        Path(w.workdir).mkdir(parents=True, exist_ok=True)
        spec = Path(w.workdir) / "workload.json"
        spec.write_text(json.dumps(asdict(w)))
        out.write(f"{name}: server {dtype} ...\n")
        out.flush()
        res = _spawn_costs("server", spec, Path(w.workdir) / "server-costs.log")
        if dtype == "float32":
            entry.update(server_tok_s=res["tok_s"], request_s=res["request_s"], push_s=res["push_s"])
            out.write(f"{name}: HF generate and training, one thread ...\n")
            out.flush()
            hf = _with_env(ONE_THREAD, lambda: _spawn("hf", spec, Path(w.workdir) / "hf.log"))
            entry["hf_tok_s"] = w.total_tokens / statistics.median(hf["times"])
            entry["train_tok_s"] = _spawn_costs("train", spec, Path(w.workdir) / "train.log", ONE_THREAD)["tok_s"]
        else:
            entry["server_bf16_tok_s"] = res["tok_s"]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()}


def _with_env(env: dict, fn):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _spawn_costs(kind: str, spec: Path, log_path: Path, env: dict | None = None) -> dict:
    import subprocess

    with open(log_path, "wb") as log:
        proc = subprocess.run([sys.executable, "-m", "ogrpo.bench.costs", "--worker", kind, str(spec)],
                              stdout=subprocess.PIPE, stderr=log, env={**os.environ, **(env or {})}, timeout=1800)
    for line in proc.stdout.decode("utf-8", "replace").splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    raise RuntimeError(f"costs worker {kind} failed (exit {proc.returncode}); see {log_path}")


def merged(previous: dict, measured: list[dict], source: str, workload: str) -> dict:
    """The table with `measured` entries in place of the previous ones of the same device and model; entries of
    other sizes are kept (each carries when and under what load it was measured), as long as they were measured
    on the same machine kind with the same workload, else the table starts afresh."""
    same = previous.get("source") == source and previous.get("workload") == workload
    fresh = {(e["device"], e["model"]) for e in measured}
    kept = [e for e in previous.get("entries", []) if same and (e.get("device"), e.get("model")) not in fresh]
    return {"version": 1, "generated_by": "python -m ogrpo.bench.costs --write", "source": source,
            "workload": workload, "entries": sorted(kept + measured, key=lambda e: (e["device"], e["params"]))}


def run(write: bool = False, models: list[str] | None = None, out=sys.stdout) -> dict:
    bf16 = costs.bf16_capable(costs.cpu_flags())
    work = Path(tempfile.mkdtemp(prefix="ogrpo-bench-costs-"))
    entries = []
    for name in models or list(SHAPES):
        entry = measure(name, SHAPES[name], work, bf16, out)
        # a loaded machine skews every number: regenerate on a quiet one
        entry.update(date=datetime.date.today().isoformat(), load_avg_1min=round(os.getloadavg()[0], 1))
        entries.append(entry)
        out.write(json.dumps(entry) + "\n")  # as measured: a long run interrupted keeps what it has
        out.flush()
    table = merged(costs.table(), entries, source=f"{device_name()}, {os.cpu_count()} cores",
                   workload=f"{PROMPTS} prompts x {GENERATIONS} completions x {NEW_TOKENS} tokens, prompts of "
                            f"{PROMPT_TOKENS}; median of {REPEATS}")
    keys = ["hf_tok_s", "server_tok_s", "server_bf16_tok_s", "request_s", "push_s", "train_tok_s"]
    out.write(format_table(["model", "params", *keys, "date"],
                           [[e["model"], f"{e['params']:,}", *[f"{e[k]:g}" if k in e else "-" for k in keys],
                             e.get("date", "-")] for e in table["entries"]]) + "\n")
    if write:
        costs.TABLE.write_text(json.dumps(table, indent=2) + "\n")
        out.write(f"wrote {costs.TABLE}\n")
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ogrpo.bench.costs", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="replace ogrpo/data/generation_costs.json")
    parser.add_argument("--models", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        kind, spec = args.worker
        w = Workload(**json.loads(Path(spec).read_text()))
        result = (_server_costs if kind == "server" else _train_costs)(w)
        sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
        return
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in SHAPES]
    if bad:
        sys.exit(f"error: --models {','.join(bad)}: use {', '.join(SHAPES)}")
    run(write=args.write, models=models)


if __name__ == "__main__":
    from ogrpo.launch.teardown import exit_on_signals

    with exit_on_signals():
        main()
