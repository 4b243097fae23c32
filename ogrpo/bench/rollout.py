"""`ogrpo bench rollout`: one GRPO rollout (prompts x generations x new tokens), three ways, same model/dtype.

(a) hf          — TRL's default rollout without vLLM: `model.generate` on the prompts repeated num_generations
                  times (TRL's RepeatSampler order), sampling at temperature 1, the GenerationConfig TRL 1.16 builds.
(b) raw vLLM offline: `LLM(...).generate(token prompts, SamplingParams(n=G, logprobs=0))`, two ways:
    vllm        — vLLM's default engine processes (on CPU: an EngineCore process and a worker bound to one core);
    vllm_inproc — the engine in the calling process (VLLM_ENABLE_V1_MULTIPROCESSING=0), the faster on CPU.
    The bar compares the server with the faster of the two that ran.
(c) server      — O-GRPO's server path: `ogrpo serve` for a run config of this model, then TRL's own
                  `VLLMClient.generate` (what the trainer calls each step) over HTTP.

Every path runs in its own fresh subprocess: vLLM's CPU worker replaces `torch.set_num_threads` with a no-op in
the process that hosts it and keeps memory after shutdown, so sharing a process would skew the next path.
EOS is ignored so that every path generates exactly the same number of tokens. The model is a randomly
initialized Qwen2 of the given shape (throughput does not depend on the weights' values).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from ogrpo import dtypes
from ogrpo.bench.harness import append_rows, environment_tags, make_row, median_seconds
from ogrpo.errors import OgrpoError
from ogrpo.launch.ports import free_ports, release_ports
from ogrpo.launch.secret import ensure_in_env
from ogrpo.planner.memory import kv_budget_bytes
from ogrpo.serve import SERVER_ARGS
from ogrpo.serve.auth import install_client_key
from ogrpo.serve.server import engine_flags
from ogrpo.tables import format_table
from ogrpo.tiny import SPECIAL_TOKENS, build_tokenizer

RESULT_TAG = "OGRPO_BENCH_RESULT "
PATHS = ("hf", "vllm", "server", "vllm_inproc")
DEFAULT_PATHS = ["hf", "vllm", "vllm_inproc", "server"]
RAW_PATHS = ("vllm", "vllm_inproc")
PATH_NAMES = {"hf": "HF generate (TRL default)", "vllm": "vLLM offline (raw, default processes)",
              "server": "O-GRPO server path", "vllm_inproc": "vLLM offline (raw, engine in-process)"}
BAR = 0.95
_DTYPES = {p: dtypes.torch_name(p) for p in ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")}


@dataclass
class RolloutShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = True

    def params(self) -> int:
        head_dim = self.hidden // self.heads
        attn = self.hidden * head_dim * (self.heads * 2 + self.kv_heads * 2) + head_dim * (self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        per_layer = attn + mlp + 2 * self.hidden
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * per_layer + emb + self.hidden

    def check(self) -> None:
        """Refuse a shape no model can have (one line, before anything is built)."""
        sizes = {"hidden": self.hidden, "layers": self.layers, "heads": self.heads, "kv-heads": self.kv_heads,
                 "intermediate": self.intermediate}
        check_counts(**sizes, vocab=(self.vocab, 2))
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise OgrpoError(f"hidden {self.hidden} must divide by heads {self.heads}, heads by kv-heads "
                             f"{self.kv_heads}")

    def label(self) -> str:
        return (f"{self.params() / 1e6:.1f}M h{self.hidden} i{self.intermediate} l{self.layers} "
                f"a{self.heads}/{self.kv_heads} v{self.vocab}{' tied' if self.tied else ''}")


def check_counts(**counts) -> None:
    """Refuse counts below their least: NAME=value (least 1) or NAME=(value, least), named as their options."""
    low = []
    for name, given in counts.items():
        value, least = given if isinstance(given, tuple) else (given, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            low.append(f"--{name.replace('_', '-')} {value!r} (at least {least})")
    if low:
        raise OgrpoError("too small: " + ", ".join(low))


@dataclass
class Workload:
    model_dir: str
    dtype: str  # torch name: float32 | bfloat16 | float16
    prompts: list[list[int]]
    generations: int
    new_tokens: int
    repeats: int
    gpu_memory_utilization: float | None
    enforce_eager: bool
    workdir: str
    kv_cache_bytes: int | None = None

    def memory_args(self) -> dict:
        """The same KV budget for both vLLM paths: explicit bytes, else a share of the host memory."""
        if self.kv_cache_bytes:
            return {"kv_cache_memory_bytes": self.kv_cache_bytes}
        return {"gpu_memory_utilization": self.gpu_memory_utilization}

    @property
    def max_model_len(self) -> int:
        return max(len(p) for p in self.prompts) + self.new_tokens

    @property
    def total_tokens(self) -> int:
        return len(self.prompts) * self.generations * self.new_tokens


def kv_cache_budget(shape: RolloutShape, dtype_bytes: int, seqs: int, max_model_len: int) -> int:
    """KV bytes that hold every sequence of one rollout at once (see ogrpo.planner.memory.kv_budget_bytes for why an
    explicit budget rather than a memory share)."""
    per_token = 2 * shape.layers * shape.kv_heads * (shape.hidden // shape.heads) * dtype_bytes
    return kv_budget_bytes(per_token, seqs, max_model_len)


MODEL_MARK = "ogrpo-bench-model.json"  # a model dir built by this version of build_model (reused as is)


def build_model(shape: RolloutShape, dtype: str, out_dir: Path, seed: int = 0, end_ids: tuple[int, ...] = ()) -> Path:
    """Random Qwen2 weights of `shape` in `dtype`, with a byte-level BPE tokenizer of exactly `shape.vocab` ids
    (so every sampled id detokenizes), trained with the split transformers' Qwen2Tokenizer rebuilds on load:
    AutoTokenizer picks that class from the model type whatever tokenizer.json holds (a word-level vocabulary
    came back as a BPE without merges that read every prompt as 3-5 unknown tokens). `end_ids`: more end tokens
    in the model's generation config beside EOS, as real chat models list several: HF generate and vLLM stop at
    each, and TRL cuts completions at each (its `eos_token_ids` come from that config)."""
    import random

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    mark = json.dumps({"shape": asdict(shape), "dtype": dtype, "seed": seed, "end_ids": list(end_ids)}) + "\n"
    if (out_dir / MODEL_MARK).is_file() and (out_dir / MODEL_MARK).read_text() == mark:
        return out_dir  # the same model: reused; anything else in the directory is built over
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    words = [" ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 6)))
                      for _ in range(50)) for _ in range(4000)]
    tok = build_tokenizer(out_dir, words, shape.vocab, qwen2_split=True)
    if len(tok) != shape.vocab:
        raise RuntimeError(f"bench tokenizer has {len(tok)} ids, not the model's {shape.vocab}")
    eos, pad = (tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS)
    cfg = Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, max_position_embeddings=4096,
                      tie_word_embeddings=shape.tied, bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    if end_ids:
        model.generation_config.eos_token_id = [eos, *(i for i in end_ids if i != eos)]
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / MODEL_MARK).write_text(mark)
    return out_dir


def text_prompts(model_dir: Path, n: int, length: int, seed: int = 0) -> list[str]:
    """`n` prompt texts of random tokens that the model's tokenizer, as the trainer and the server load it, reads
    back as exactly `length` ids."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(seed)
    special = set(tok.all_special_ids)
    out = []
    for _ in range(1000 * n):
        ids = [i for i in (rng.randrange(len(tok)) for _ in range(length + 8)) if i not in special]
        ids = tok(tok.decode(ids))["input_ids"][:length]
        text = tok.decode(ids)
        if len(ids) == length and tok(text)["input_ids"] == ids:
            out.append(text)
            if len(out) == n:
                return out
    raise RuntimeError(f"no {length}-token prompts round-trip through {model_dir}'s tokenizer")


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


# --- the three paths (each runs in a worker subprocess) ----------------------------------------------------
def _run_hf(w: Workload) -> tuple[list[float], int]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(w.model_dir, dtype=getattr(torch, w.dtype)).eval()
    # TRL's RepeatSampler puts each prompt's num_generations copies next to each other.
    rows = [p for p in w.prompts for _ in range(w.generations)]
    ids = torch.tensor(rows)
    mask = torch.ones_like(ids)
    # What GRPOTrainer builds when use_vllm=False; eos_token_id None so every row generates new_tokens.
    cfg = GenerationConfig(max_new_tokens=w.new_tokens, do_sample=True, pad_token_id=0, bos_token_id=None,
                           eos_token_id=None, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                           repetition_penalty=1.0, cache_implementation=None, disable_compile=True)
    produced = {}

    def once():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        produced["n"] = int((out.shape[1] - ids.shape[1]) * out.shape[0])

    med, times = median_seconds(once, w.repeats)
    return times, produced["n"]


def _wait_health(url: str, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"server not healthy at {url} after {timeout:.0f} s")


def _start_server(w: Workload):
    """`ogrpo serve` for a run config of this workload; returns (process, port, log file)."""
    import yaml

    work = Path(w.workdir)
    run_yaml = work / "bench-run.yaml"

    # What a plan gives every server (stats off: also the offline LLM's default, so settings stay the same). A run
    # config carries a whole plan or none, so these go on the server's command line, after `--`.
    args = {**w.memory_args(), **SERVER_ARGS}
    if w.enforce_eager:
        args["enforce_eager"] = True
    gmu = args.pop("gpu_memory_utilization", None)
    run_yaml.write_text(yaml.safe_dump({
        "model_name_or_path": w.model_dir, "max_completion_length": w.new_tokens, "dtype": w.dtype,
        **({"vllm_gpu_memory_utilization": gmu} if gmu is not None else {}),
        "ogrpo": {"max_prompt_length": w.max_model_len - w.new_tokens}}))

    ensure_in_env()  # the server (a child) and our client share this process's job key
    (port,) = free_ports(1)
    log = open(work / "server.log", "wb")
    cmd = [sys.executable, "-m", "ogrpo", "serve", "--config", str(run_yaml), "--host", "127.0.0.1",
           "--port", str(port), "--", *engine_flags(args)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, port, log


def _stop_server(proc: subprocess.Popen, port: int, log) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    log.close()
    release_ports([port])


def _server_generate(w: Workload, port: int):
    """TRL's own client call, as GRPOTrainer makes it each step (token-id prompts, n, logprobs=0)."""
    from trl.generation.vllm_client import VLLMClient

    install_client_key()
    client = VLLMClient(base_url=f"http://127.0.0.1:{port}", connection_timeout=60)
    produced = {}

    def once():
        out = client.generate(w.prompts, n=w.generations, temperature=1.0, top_p=1.0, top_k=0,
                              max_tokens=w.new_tokens, logprobs=0, generation_kwargs={"ignore_eos": True})
        produced["n"] = sum(len(c) for c in out["completion_ids"])

    return once, produced


def _offline_generate(w: Workload):
    from vllm import LLM, SamplingParams

    # The same engine settings `ogrpo serve` passes (processed log-probs, what TRL needs), so the two vLLM
    # paths differ only by the server around the engine.
    llm = LLM(model=w.model_dir, dtype=w.dtype, max_model_len=w.max_model_len, seed=0, **w.memory_args(),
              enforce_eager=w.enforce_eager, logprobs_mode="processed_logprobs")
    # logprobs=0: TRL asks for the sampled token's log-prob on every path, so the raw baseline does too.
    params = SamplingParams(n=w.generations, max_tokens=w.new_tokens, ignore_eos=True, temperature=1.0,
                            top_p=1.0, top_k=0, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in w.prompts]
    produced = {}

    def once():
        outs = llm.generate(prompts, params, use_tqdm=False)
        produced["n"] = sum(len(c.token_ids) for o in outs for c in o.outputs)

    return once, produced


def _run_server(w: Workload) -> tuple[list[float], int]:
    proc, port, log = _start_server(w)
    try:
        _wait_health(f"http://127.0.0.1:{port}/health", proc, timeout=600)
        once, produced = _server_generate(w, port)
        med, times = median_seconds(once, w.repeats)
        return times, produced["n"]
    finally:
        _stop_server(proc, port, log)


def _run_paired(w: Workload, offline_path: str) -> dict:
    """Raw offline vLLM (`offline_path`, whose engine mode the worker's environment set) and the server path in
    turns, so that load from other jobs on a shared machine hits both alike and their ratio stays meaningful.
    Both engines are idle (blocked on their queues) while the other one runs."""
    proc, port, log = _start_server(w)
    try:
        offline, off_n = _offline_generate(w)  # builds while the server starts
        _wait_health(f"http://127.0.0.1:{port}/health", proc, timeout=600)
        served, srv_n = _server_generate(w, port)
        offline()
        served()
        times = {offline_path: [], "server": []}
        for _ in range(max(1, w.repeats)):
            for name, fn in ((offline_path, offline), ("server", served)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        return {offline_path: {"times": times[offline_path], "tokens": off_n["n"]},
                "server": {"times": times["server"], "tokens": srv_n["n"]}}
    finally:
        _stop_server(proc, port, log)


def _run_vllm(w: Workload) -> tuple[list[float], int]:
    once, produced = _offline_generate(w)
    med, times = median_seconds(once, w.repeats)
    return times, produced["n"]


_RUNNERS = {"hf": _run_hf, "vllm": _run_vllm, "server": _run_server, "vllm_inproc": _run_vllm}
_INPROC = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
_PATH_ENV = {"vllm_inproc": _INPROC, "paired:vllm_inproc": _INPROC}


def _worker(path: str, spec_file: str) -> None:
    w = Workload(**json.loads(Path(spec_file).read_text()))
    if path.startswith("paired:"):
        result = _run_paired(w, path.split(":", 1)[1])
    else:
        times, produced = _RUNNERS[path](w)
        result = {"times": times, "tokens": produced}
    sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()


def _spawn(path: str, spec_file: Path, log_path: Path) -> dict:
    cmd = [sys.executable, "-m", "ogrpo.bench.rollout", path, str(spec_file)]
    env = {**os.environ, **_PATH_ENV.get(path, {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env)
        try:
            stdout, _ = proc.communicate(timeout=1800)
        finally:
            # Interrupted (or timed out): SIGTERM first, so the worker stops the server it started;
            # subprocess.run would SIGKILL it and orphan that server.
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    out = stdout.decode("utf-8", "replace")
    for line in out.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    raise RuntimeError(f"bench path {path} failed (exit {proc.returncode}); see {log_path}")


def bench_ratios(tokps: dict[str, float]) -> list[tuple[str, float]]:
    """Ratios of the measured paths' tokens/s; `server_vs_raw_best` (the bar) divides by the faster raw mode."""
    ratios = []
    raw = [p for p in RAW_PATHS if p in tokps]
    if "server" in tokps:
        ratios += [(f"server_vs_{p}", tokps["server"] / tokps[p]) for p in raw]
        if raw:
            ratios.append(("server_vs_raw_best", tokps["server"] / max(tokps[p] for p in raw)))
        if "hf" in tokps:
            ratios.append(("server_vs_hf", tokps["server"] / tokps["hf"]))
    if "hf" in tokps:
        ratios += [(f"{p}_vs_hf", tokps[p] / tokps["hf"]) for p in raw]
    return ratios


def run_rollout_bench(shape: RolloutShape, *, dtype: str = "fp32", prompts: int = 8, generations: int = 8,
                      new_tokens: int = 128, prompt_tokens: int = 32, repeats: int = 3,
                      paths: list[str] | None = None, csv_path: str | os.PathLike = "bench/results/rollout.csv",
                      workdir: str | None = None, gpu_memory_utilization: float | None = None,
                      enforce_eager: bool = False, paired: bool = True, out=None) -> list[dict]:
    """Run the chosen paths, print a table with tokens/s and ratios, append CSV rows; returns the rows."""

    out = out or sys.stdout
    paths = paths or list(DEFAULT_PATHS)
    bad = [p for p in paths if p not in PATHS]
    if bad:
        raise OgrpoError(f"unknown bench path(s) {bad}; choose from {', '.join(PATHS)}")
    if dtype not in _DTYPES:
        raise OgrpoError(f"unknown dtype {dtype!r}; use fp32 or bf16")
    shape.check()
    check_counts(prompts=prompts, generations=generations, tokens=new_tokens, prompt_tokens=prompt_tokens,
                 repeats=repeats)
    torch_dtype = _DTYPES[dtype]
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="ogrpo-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    tag = f"{shape.hidden}-{shape.layers}-{shape.vocab}-{dtype}"
    model_dir = build_model(shape, torch_dtype, work / f"model-{tag}")
    # Logs and the workload live per shape and dtype, so that one workdir can hold several runs.
    work = work / f"run-{tag}"
    work.mkdir(parents=True, exist_ok=True)
    kv_bytes = None if gpu_memory_utilization else kv_cache_budget(
        shape, dtypes.BYTES[torch_dtype], prompts * generations, prompt_tokens + new_tokens)
    w = Workload(model_dir=str(model_dir), dtype=torch_dtype,
                 prompts=make_prompts(prompts, prompt_tokens, shape.vocab), generations=generations,
                 new_tokens=new_tokens, repeats=repeats, gpu_memory_utilization=gpu_memory_utilization,
                 enforce_eager=enforce_eager, workdir=str(work), kv_cache_bytes=kv_bytes)
    spec_file = work / "workload.json"
    spec_file.write_text(json.dumps(asdict(w)))
    tokps: dict[str, float] = {}
    raw: dict[str, dict] = {}
    results: dict[str, dict] = {}
    # Paired with the server: the raw mode that is the bar's baseline where both run (in-process is the faster
    # on CPU); the other raw mode runs on its own.
    pair = next((p for p in reversed(RAW_PATHS) if p in paths), None)
    if paired and pair and "server" in paths:
        out.write(f"running {PATH_NAMES[pair]} and O-GRPO server path, in turns ...\n")
        out.flush()
        results.update(_spawn(f"paired:{pair}", spec_file, work / "paired.log"))
    for p in paths:
        if p in results:
            continue
        out.write(f"running {PATH_NAMES[p]} ...\n")
        out.flush()
        results[p] = _spawn(p, spec_file, work / f"{p}.log")
    for p in paths:
        res = results[p]
        if res["tokens"] != w.total_tokens:
            raise RuntimeError(f"{p} generated {res['tokens']} tokens, expected {w.total_tokens}")
        med = statistics.median(res["times"])
        tokps[p] = w.total_tokens / med
        raw[p] = res
    case = f"{shape.label()} {dtype} {prompts}x{generations}x{new_tokens}"
    params = json.dumps({**asdict(shape), "dtype": dtype, "prompts": prompts, "generations": generations,
                         "new_tokens": new_tokens, "prompt_tokens": prompt_tokens, "repeats": repeats,
                         "gpu_memory_utilization": gpu_memory_utilization, "kv_cache_bytes": kv_bytes,
                         "enforce_eager": enforce_eager,
                         "paired": paired},
                        sort_keys=True)
    tags = environment_tags()
    rows = [make_row("rollout", case, p, "tokens_per_s", tokps[p], "tok/s", params, tags) for p in paths]
    table = [[PATH_NAMES[p], f"{tokps[p]:,.0f}", " ".join(f"{t:.2f}" for t in raw[p]["times"])] for p in paths]
    ratios = bench_ratios(tokps)
    rows += [make_row("rollout", case, name, "ratio", value, "x", params, tags) for name, value in ratios]
    path = append_rows(csv_path, rows)
    out.write(f"\nrollout: {case}  ({tags['device']}, torch {tags['torch']}, vllm {tags['vllm']}, "
              f"trl {tags['trl']})\n")
    out.write(format_table(["path", "tok/s", "seconds per repeat"], table) + "\n")
    for name, value in ratios:
        note = ""
        if name == "server_vs_raw_best":
            best = max((p for p in RAW_PATHS if p in tokps), key=tokps.get)
            note = f"  (vs {best}; bar: >= {BAR})" + ("" if value >= BAR else "  BELOW BAR")
        out.write(f"{name}: {value:.3f}{note}\n")
    out.write(f"csv: {path}\n")
    return rows


if __name__ == "__main__":  # worker entry: python -m ogrpo.bench.rollout PATH WORKLOAD.json
    from ogrpo.launch.teardown import exit_on_signals

    with exit_on_signals():
        _worker(sys.argv[1], sys.argv[2])
