"""Log-prob paths on a CUDA GPU: our fused kernel vs TRL's head + selective_log_softmax, time and peak memory.

    python -m ogrpo.bench.kernels_cuda [--tokens 4096,16384] [--hidden 1536] [--vocab 151936] [--dtype bf16]
                                       [--csv PATH]

`ogrpo bench kernels` measures the CPU build (process RSS); this is its GPU side: each path runs forward and
backward on the same inputs, timed with CUDA events after a warm-up, peak from the caching allocator's
high-water mark above the inputs. Ratios are against TRL 1.9.2's path measured in the same run.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys

from ogrpo.bench.kernels import LOGPROB_FNS

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _paths() -> list[str]:
    paths = ["trl_1_9_2", "ogrpo"]
    try:
        import trl.kernels  # noqa: F401  - TRL 1.16's chunked head, where that TRL is installed
    except Exception:  # noqa: BLE001 - a missing optional path is a row left out, said in the output
        print("trl_1_16: not installed here, row left out", file=sys.stderr)
    else:
        paths.insert(1, "trl_1_16")
    return paths


def measure(path: str, tokens: int, hidden: int, vocab: int, dtype: str, repeats: int) -> dict:
    import torch

    fn = LOGPROB_FNS[path]
    dt = getattr(torch, DTYPES[dtype])
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(tokens, hidden, device="cuda", dtype=dt, generator=gen).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", dtype=dt, generator=gen) / hidden ** 0.5).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    g = torch.randn(tokens, device="cuda", generator=gen)

    def step():
        logp, _ = fn(h, w, t, 0.7)
        (logp.float() * g).sum().backward()
        h.grad = w.grad = None

    step()  # first use: kernel load, its verification, allocator warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return {"path": path, "tokens": tokens, "ms": statistics.median(times), "peak_mib": peak}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--csv", help="also append rows (case, path, metric, value, device) to this CSV")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0)
    print(f"device: {device}, torch {torch.__version__}, {args.dtype}, hidden {args.hidden}, vocab {args.vocab}")
    records = []
    print(f"{'tokens':>7} {'path':<10} {'ms':>9} {'peak MiB':>9} {'time/TRL1.9':>12} {'mem/TRL1.9':>11}")
    for tokens in (int(x) for x in args.tokens.split(",")):
        rows = []
        for path in _paths():
            rows.append(measure(path, tokens, args.hidden, args.vocab, args.dtype, args.repeats))
            torch.cuda.empty_cache()  # the next path's peak is measured from an empty cache, not this one's
        ref = rows[0]
        for r in rows:
            time_ratio, mem_ratio = r["ms"] / ref["ms"], r["peak_mib"] / ref["peak_mib"]
            print(f"{tokens:>7} {r['path']:<10} {r['ms']:>9.2f} {r['peak_mib']:>9.0f} "
                  f"{time_ratio:>11.2f}x {mem_ratio:>10.2f}x")
            case = f"{tokens}/{args.dtype}"
            records += [(case, r["path"], "ms", r["ms"]), (case, r["path"], "peak_mib", r["peak_mib"]),
                        (case, r["path"], "time_ratio", time_ratio), (case, r["path"], "mem_ratio", mem_ratio)]
    if args.csv:
        write_csv(args.csv, records, device)
    return 0


def write_csv(path: str, records: list[tuple], device: str) -> None:
    with open(path, "a", newline="") as f:
        out = csv.writer(f)
        if f.tell() == 0:
            out.writerow(["case", "path", "metric", "value", "device"])
        out.writerows([*rec, device] for rec in records)


if __name__ == "__main__":
    sys.exit(main())
