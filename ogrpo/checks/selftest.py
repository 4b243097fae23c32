"""`ogrpo selftest`: run what a plan relies on, once, on the node a user is about to train on; write one JSON
report to attach to bug reports.

Checks (each: status pass | fail | skip, with its numbers):
- tf32: what torch reports and what the plan would set (TrainingArguments(tf32=...)); fail when the plan
  would turn TF32 on where the GPU has none. No GPU: skip.
- flash_attn: `import flash_attn` and one causal forward against torch's SDPA on the same input. Only where
  FA2 can run (sm_80+); on a V100 it is "not applicable" (skip).
- deepspeed_ops: each op's builder `is_compatible()` and `load()` (prebuilt in the images, else a JIT build,
  timed): cpu_adam (ZeRO-Offload) and fused_adam.
- fp16_overflow: forward hooks on every module of the run's model on a calibration batch, once in a wide dtype
  (fp32, or bf16 where fp32 does not fit) for the largest |activation| against fp16's 65504, once with fp16
  weights (what vLLM serves on a V100) for the first module whose output is inf/NaN. Fails only where the plan
  runs fp16 (trainer or server); elsewhere the numbers are reported for information.
- vllm_server: `ogrpo serve` with the plan's server flags (the CPU plan's on CPU), time to /health.
- weight_push: the run's model, perturbed, pushed once through the client the trainer uses (cpu_shm on CPU,
  TRL's NCCL client on GPU), then the log-prob gap between vLLM's sampled-token log-probs and the trainer-side
  model's, before the push (must be several times the gap after it: the push changed what vLLM samples from)
  and after (must be under the dtype's tolerance). NCCL cannot
  join two ranks on one GPU: with one GPU the push is skipped and the gap is measured on the unperturbed model.

Versions and devices come from `ogrpo doctor` (ogrpo.checks.doctor.run_checks); the weight client and server command
line from ogrpo.serve. Heavy imports happen inside the checks.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from ogrpo.checks.doctor import run_checks
from ogrpo.dtypes import FP16_MAX, torch_name
from ogrpo.errors import OgrpoError
from ogrpo.hardware import parse_gpus
from ogrpo.launch.ports import free_ports, release_ports
from ogrpo.launch.secret import ensure_in_env
from ogrpo.launch.supervisor import health_ok
from ogrpo.load_plan import load_and_plan
from ogrpo.planner.device_rules import rules_of
from ogrpo.planner.types import Precision
from ogrpo.serve import client as weight_client
from ogrpo.serve.client import expected_from_run_config
from ogrpo.serve.server import serve as serve_argv
from ogrpo.trainer.assembly import resolve_model_path

PASS, FAIL, SKIP = "pass", "fail", "skip"
DEFAULT_DS_OPS = ("cpu_adam", "fused_adam")
_DS_BUILDERS = {"cpu_adam": "CPUAdamBuilder", "fused_adam": "FusedAdamBuilder", "cpu_adagrad": "CPUAdagradBuilder",
                "cpu_lion": "CPULionBuilder"}
# mean |log p_vLLM - log p_trainer| over sampled tokens: CI's bound for fp32 (tests/test_train_server.py), and
# what bf16/fp16 rounding on two different kernels stays under
GAP_TOL = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 5e-2}
PERTURB = 0.2  # noise, relative to each tensor's std, that makes the pushed model visibly another one
CALIBRATION_TEXTS = (
    "The quick brown fox jumps over the lazy dog. 12 + 30 = 42.",
    "Solve for x: 3x + 7 = 22. First subtract 7 from both sides, then divide by 3.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Write the letter c: ccccc",
)


def result(status: str, detail: str = "", **numbers) -> dict:
    return {"status": status, "detail": detail, **numbers}


def run_check(fn: Callable[[], dict]) -> dict:
    """One check; an exception is its failure (with the exception's first line), never the self-test's."""
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        first = (str(exc).strip().splitlines() or [""])[0]
        out = result(FAIL, f"{type(exc).__name__}: {first}"[:600])
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


# ---------------------------------------------------------------------------------------------------------
# plan for this machine

def machine_gpus(env: dict) -> str | None:
    """`NxTYPE` for the GPUs `ogrpo doctor` found, None when there are none or their type is not in the catalog."""
    gpus = env.get("gpus") or []
    if not gpus:
        return None
    names = {g.get("catalog") for g in gpus}
    if len(names) != 1 or None in names:
        return None
    return f"{len(gpus)}x{names.pop()}"


def selftest_plan(config: str, gpus: str | None, model: str | None, cuda_count: int):
    """(run config, plan) of a server-mode run on this machine: the server flags come from the plan. With one GPU
    the plan is made for two of that type (one for vLLM), which is what a one-GPU server of it gets."""
    extra: dict = {"use_vllm": True}
    cluster = parse_gpus(gpus) if gpus else None

    if cluster is not None and not rules_of(cluster).counts_gpus:
        return load_and_plan(config, gpus, model, None, None, None, extra=extra)
    if cuda_count == 1 and cluster is not None and cluster.total_gpus == 1:
        gpus = "2x" + cluster.spec.removeprefix("1x")
    return load_and_plan(config, gpus, model, None, None, 1 if gpus else None, extra=extra)


def plan_dtype(plan) -> str:
    """The server's dtype for a Plan: its vLLM engine's, else the trainer's precision."""
    return torch_name(plan.vllm.args.dtype or plan.precision or "fp32", allow_auto=True)


# ---------------------------------------------------------------------------------------------------------
# checks

def check_tf32(plan, gpu: dict | None) -> dict:
    if gpu is None:
        return result(SKIP, "n/a: no CUDA device (TF32 is a CUDA matmul mode)")
    import torch

    state = {"cuda.matmul.allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
             "cudnn.allow_tf32": bool(torch.backends.cudnn.allow_tf32),
             "float32_matmul_precision": torch.get_float32_matmul_precision()}
    planned = plan.trainer_args.tf32
    numbers = {"torch": state, "plan_tf32": planned, "gpu_tf32": bool(gpu.get("tf32")), "sm": gpu.get("sm")}
    if planned and not gpu.get("tf32"):
        return result(FAIL, f"the plan sets tf32 but sm_{gpu.get('sm')} has none (transformers raises)", **numbers)
    what = {True: "the trainer turns TF32 matmuls on", False: "the trainer turns TF32 matmuls off",
            None: "the trainer leaves torch's default"}[planned]
    return result(PASS, f"{what}; torch now: matmul {state['cuda.matmul.allow_tf32']}, cudnn "
                        f"{state['cudnn.allow_tf32']}", **numbers)


def check_flash_attn(plan, gpu: dict | None) -> dict:
    if gpu is None:
        return result(SKIP, "n/a: no CUDA device")
    if not gpu.get("fa2_arch"):
        return result(SKIP, f"not applicable: sm_{gpu.get('sm')} has no FlashAttention-2 (sm_80+); the plan "
                            f"uses {plan.attn_implementation}", sm=gpu.get("sm"))
    import torch
    import torch.nn.functional as F
    from flash_attn import __version__ as fa_version
    from flash_attn import flash_attn_func

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 257, 8, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True).transpose(1, 2)
    diff = float((out.float() - ref.float()).abs().max())
    tol = 2e-2  # bf16 output rounding of two kernels that sum in different orders
    numbers = {"flash_attn": fa_version, "max_abs_diff": diff, "tolerance": tol,
               "plan_attn_implementation": plan.attn_implementation}
    return result(PASS if diff <= tol else FAIL, f"FA2 vs SDPA, causal bf16 [2, 257, 8, 64]: max |diff| "
                                                 f"{diff:.3g} (tolerance {tol})", **numbers)


def check_deepspeed_ops(ops: tuple[str, ...], jit: bool = True) -> dict:
    """ds_report's question for each op: compatible here, prebuilt, and does it load."""
    try:
        import deepspeed
    except ImportError:
        return result(SKIP, "deepspeed is not installed (ZeRO plans need it)")
    from deepspeed.accelerator import get_accelerator

    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        installed_ops = {}
    acc = get_accelerator()
    rows: dict = {}
    failed = []
    for op in ops:
        row: dict = {"builder": _DS_BUILDERS.get(op, op)}
        builder = acc.create_op_builder(row["builder"])
        if builder is None:
            rows[op] = {**row, "status": SKIP, "detail": f"no {row['builder']} for the {acc._name} accelerator"}
            continue
        row["compatible"] = bool(builder.is_compatible(verbose=False))
        row["prebuilt"] = bool(installed_ops.get(builder.NAME))
        if not row["compatible"]:
            rows[op] = {**row, "status": SKIP, "detail": "not compatible with this machine (ds_report says why)"}
            continue
        if not row["prebuilt"] and not jit:
            rows[op] = {**row, "status": SKIP, "detail": "not prebuilt; JIT build not requested"}
            continue
        t0 = time.perf_counter()
        try:
            builder.load(verbose=False)
            row.update(status=PASS, detail="loaded" + ("" if row["prebuilt"] else " (JIT-built or JIT cache)"))
        except Exception as exc:  # noqa: BLE001
            row.update(status=FAIL, detail=f"{type(exc).__name__}: {exc}"[:400])
            failed.append(op)
        row["load_s"] = round(time.perf_counter() - t0, 2)
        rows[op] = row
    status = FAIL if failed else (PASS if any(r["status"] == PASS for r in rows.values()) else SKIP)
    detail = (f"failed to load: {', '.join(failed)}" if failed else
              ", ".join(f"{op} {r['status']}" for op, r in rows.items()))
    return result(status, detail, deepspeed=deepspeed.__version__, accelerator=acc._name, ops=rows)


def calibration_texts(run_config, limit: int = 4) -> tuple[list, str]:
    """The run's first prompts (what the model will really see), else fixed texts."""
    try:
        # inside the try: a failing import falls back to the fixed texts
        from ogrpo.trainer.data import load_prompts

        ds = load_prompts(run_config.trl, run_config.ogrpo.prompt_column, run_config.ogrpo.system_prompt)
        prompts = [ds[i]["prompt"] for i in range(min(limit, len(ds)))]
        if prompts:
            return prompts, "dataset"
        why = "the dataset has no prompts"
    except Exception as exc:  # noqa: BLE001 - an offline node still gets a probe; the source label says why
        why = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:200]
    return list(CALIBRATION_TEXTS), f"built-in texts (dataset not used: {why})"


def _encode(tok, prompts: list, max_len: int = 128):
    texts = []
    for p in prompts:
        if isinstance(p, list):  # conversational prompt
            if getattr(tok, "chat_template", None):
                p = tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
            else:
                p = "\n".join(str(m.get("content", "")) for m in p)
        texts.append(str(p))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=max_len)


def activation_peaks(model, batch) -> list[tuple[str, float, bool]]:
    """(module name, max |output|, output has inf/NaN) for every module, in the order they ran."""
    import torch

    rows: list[tuple[str, float, bool]] = []

    def tensors(out):
        if torch.is_tensor(out):
            yield out
        elif isinstance(out, (tuple, list)):
            for o in out:
                yield from tensors(o)
        elif isinstance(out, dict):
            for o in out.values():
                yield from tensors(o)

    def hook(name):
        def fn(module, inputs, output):
            peak, bad = 0.0, False
            for t in tensors(output):
                if t.is_floating_point() and t.numel():
                    finite = torch.isfinite(t)
                    bad = bad or not bool(finite.all())
                    peak = max(peak, float(t.detach().abs().masked_fill(~finite, 0).max()))
            rows.append((name or "<model>", peak, bad))
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    return rows


def overflow_probe(model_path: str, device: str, precision: str, server_dtype: str | None = None,
                   texts: list | None = None, source: str = "built-in texts") -> dict:
    """Largest activation of the model against fp16's range, and whether fp16 weights overflow (see module doc).
    `precision` / `server_dtype`: what the plan trains and serves in (decides pass/fail)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    batch = _encode(tok, list(texts or CALIBRATION_TEXTS))
    wide = torch.float32
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        n_bytes = sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() \
            else 0
        fp32_bytes = n_bytes * (2 if _checkpoint_is_half(model_path) else 1)
        if fp32_bytes and fp32_bytes * 1.3 > free:
            wide = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=wide).to(device).eval()
    batch = {k: v.to(device) for k, v in batch.items()}
    numbers: dict = {"model": model_path, "calibration": f"{source}: {len(batch['input_ids'])} sequences, "
                                                         f"{int(batch['attention_mask'].sum())} tokens",
                     "wide_dtype": str(wide).removeprefix("torch."), "fp16_max": FP16_MAX}
    if wide != torch.float16:
        peaks = activation_peaks(model, batch)
        name, peak, _ = max(peaks, key=lambda r: r[1])
        first_over = next((n for n, p, bad in peaks if p > FP16_MAX or bad), None)
        numbers.update(max_abs_activation=peak, max_module=name, ratio=peak / FP16_MAX,
                       first_module_over_fp16=first_over)
    model = model.to(torch.float16)
    half = activation_peaks(model, batch)
    numbers["fp16_first_nonfinite_module"] = next((n for n, _, bad in half if bad), None)
    if wide == torch.float16:  # no wider pass fitted: the fp16 pass is the measurement
        name, peak, _ = max(half, key=lambda r: r[1])
        numbers.update(max_abs_activation=peak, max_module=name, ratio=peak / FP16_MAX if not
                       numbers["fp16_first_nonfinite_module"] else float("inf"))
    del model
    _free(device)
    overflows = numbers["ratio"] >= 1.0 or numbers["fp16_first_nonfinite_module"] is not None
    uses_fp16 = precision == Precision.FP16 or (server_dtype is not None and server_dtype != "auto"
                                          and torch_name(server_dtype, allow_auto=True) == "float16")
    where = numbers.get("first_module_over_fp16") or numbers["fp16_first_nonfinite_module"] or numbers["max_module"]
    detail = (f"max |activation| {numbers['max_abs_activation']:.4g} in {numbers['max_module']} = "
              f"{numbers['ratio']:.3g}x fp16's max")
    if overflows:
        detail += f"; overflows fp16 first at {where}"
        if uses_fp16:
            return result(FAIL, detail + " and the plan runs fp16: expect inf/NaN losses (train in fp32 or on "
                                         "a bf16 GPU)", **numbers)
        detail += f" (the plan runs {precision}: not used)"
    return result(PASS, detail, **numbers)


def _checkpoint_is_half(model_path: str) -> bool:
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return True
    return str(cfg.get("dtype") or cfg.get("torch_dtype")) in ("bfloat16", "float16")


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------
# server, push, gap

class Server:
    """`ogrpo serve` for a run config carrying the plan, as its own process group."""

    def __init__(self, run_yaml: Path, workdir: Path, env: dict[str, str] | None = None):
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        self.argv = [sys.executable, "-m", "ogrpo", "serve", "--config", str(run_yaml), "--host", "127.0.0.1",
                     "--port", str(self.port)]

        ensure_in_env()  # the server (a child) and this process's client share one job key
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> float:
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}: {self.tail()}")
            if health_ok(f"{self.url}/health"):
                return time.monotonic() - t0
            time.sleep(1)
        raise TimeoutError(f"server not healthy after {timeout:.0f} s: {self.tail()}")

    def tail(self, n: int = 3) -> str:
        try:
            lines = [x for x in self.log_path.read_text(errors="replace").splitlines() if x.strip()]
        except OSError:
            return ""
        return " | ".join(lines[-n:])[-600:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(timeout=wait)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
        release_ports([self.port])


def server_plan(plan, one_gpu: bool, model_bytes: int, total_bytes: int) -> tuple[object, str | None]:
    """The Plan the server starts from; on one GPU shared with the self-test's reference model, vLLM's memory
    share is capped so that model fits beside it (the only flag changed, and said so). `plan` is not modified."""
    gmu = plan.vllm.args.gpu_memory_utilization
    if not one_gpu or gmu is None or not total_bytes:
        return plan, None
    cap = round(max(0.1, 1.0 - (2.0 * model_bytes + 4 * 2**30) / total_bytes), 2)
    if gmu <= cap:
        return plan, None
    vllm = dataclasses.replace(plan.vllm, args=dataclasses.replace(plan.vllm.args, gpu_memory_utilization=cap))
    return (dataclasses.replace(plan, vllm=vllm),
            f"gpu_memory_utilization {gmu} -> {cap}: one GPU shared with the self-test's reference model")


def _sequence_logps(model, prompt_ids: list[list[int]], completion_ids: list[list[int]], n: int) -> list[list[float]]:
    """The trainer side's log-prob of each sampled token (teacher forcing, no sampling transforms at T=1)."""
    import torch

    device = next(model.parameters()).device
    out = []
    for i, comp in enumerate(completion_ids):
        ids = list(prompt_ids[i // n]) + list(comp)
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=device)).logits[0].float()
        logps = torch.log_softmax(logits[len(prompt_ids[i // n]) - 1:-1], dim=-1)
        out.append(logps.gather(1, torch.tensor(comp, device=device).view(-1, 1)).view(-1).tolist())
    return out


def _gap(model, gen: dict, n: int) -> dict:
    """mean / max |log p_server - log p_trainer| over every sampled token of `gen` (TRL client output)."""
    ours = _sequence_logps(model, gen["prompt_ids"], gen["completion_ids"], n)
    diffs = []
    for seq_theirs, seq_ours in zip(gen["logprobs"], ours):
        for theirs, mine in zip(seq_theirs, seq_ours):
            value = theirs[0] if isinstance(theirs, (list, tuple)) else theirs
            diffs.append(abs(float(value) - mine))
    if not diffs:
        raise RuntimeError("the server returned no log-probs")
    return {"mean": sum(diffs) / len(diffs), "max": max(diffs), "tokens": len(diffs)}


def push_and_gap(url: str, model_path: str, dtype: str, device: str, push: bool, expect: dict | None,
                 prompts: list[list[int]], n: int = 2, max_tokens: int = 8) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    if device == "cuda":
        cls = weight_client.install_gpu_sync_timeout(timeout_s=300, expect=expect, push_dtype=dtype)
    else:
        cls = weight_client.install_cpu_client(expect)
    (group_port,) = free_ports(1)
    client = cls(base_url=url, group_port=group_port, connection_timeout=120)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
    tol = GAP_TOL.get(dtype, 5e-2)

    import inspect

    # TRL's own call as GRPOTrainer makes it; keyword names differ across TRL lines, so pass only what this one takes
    accepted = inspect.signature(client.generate).parameters
    kwargs = {k: v for k, v in dict(n=n, temperature=1.0, top_p=1.0, top_k=0, max_tokens=max_tokens,
                                    logprobs=0).items() if k in accepted}

    def sample():
        out = client.generate(prompts, **kwargs)
        if not out.get("logprobs"):
            raise RuntimeError(f"TRL's {type(client).__name__}.generate returned no log-probs: no gap to measure")
        return out

    numbers: dict = {"dtype": dtype, "tolerance_mean": tol, "client": cls.__name__}
    try:
        if not push:
            numbers["gap"] = _gap(model, sample(), n)
            ok = numbers["gap"]["mean"] < tol
            return result(PASS if ok else FAIL, f"no push (one GPU: NCCL cannot join two ranks on one device); "
                                                f"gap on the served weights: mean {numbers['gap']['mean']:.3g}",
                          **numbers)
        client.init_communicator(device=0)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point() and p.numel() > 1:
                    noise = torch.randn(p.shape, generator=gen).to(device=p.device, dtype=torch.float32)
                    p.add_((noise * PERTURB * p.float().std()).to(p.dtype))
        numbers["gap_before_push"] = _gap(model, sample(), n)
        t0 = time.perf_counter()
        client.update_model_params(model)
        client.reset_prefix_cache()
        numbers["push_s"] = round(time.perf_counter() - t0, 3)
        numbers["pushed_tensors"] = sum(1 for _ in model.parameters())
        numbers["gap_after_push"] = _gap(model, sample(), n)
    finally:
        try:
            client.close_communicator()
        except Exception:  # noqa: BLE001
            pass
        del model
        _free(device)
    before, after = numbers["gap_before_push"]["mean"], numbers["gap_after_push"]["mean"]
    detail = f"log-prob gap mean {before:.3g} before the push, {after:.3g} after (tolerance {tol})"
    if after >= tol:
        return result(FAIL, detail + ": the server does not sample from the pushed weights", **numbers)
    if before < 3 * after or before < 10 * GAP_TOL["float32"]:
        return result(FAIL, detail + ": the perturbed weights sample like the served ones, so the gap cannot show "
                                     "whether the push arrived", **numbers)
    return result(PASS, detail, **numbers)


# ---------------------------------------------------------------------------------------------------------
# the whole self-test

def run_selftest(config: str = "tiny", *, gpu: bool = False, gpus: str | None = None, model: str | None = None,
                 ds_ops: tuple[str, ...] = DEFAULT_DS_OPS, jit_ops: bool = True, server: bool = True,
                 health_timeout: float = 900.0, progress: Callable[[str, dict], None] | None = None) -> dict:
    """Every check, in order; returns the report (see `write_report`)."""

    env = run_checks(patches=False)  # the checks below exercise the patches themselves; `ogrpo doctor` checks them
    import torch

    cuda = bool(torch.cuda.is_available())
    if gpu and not cuda:
        raise OgrpoError("--gpu: no CUDA device here (torch.cuda.is_available() is False); run `ogrpo selftest` "
                         "without --gpu for the CPU checks")
    device = "cuda" if gpu else "cpu"
    if not gpu:
        gpus = "cpu"
    elif gpus is None:
        gpus = machine_gpus(env)
        if gpus is None:
            names = ", ".join(sorted({g["name"] for g in env.get("gpus") or []}))
            raise OgrpoError(f"--gpu: cannot tell which catalog GPU this is ({names}); pass --gpus NxTYPE "
                             "(e.g. 1xA40, 1xV100-32G)")
    rc, plan = selftest_plan(config, gpus, model, torch.cuda.device_count() if gpu else 0)

    model_path = resolve_model_path(rc.trl.get("model_name_or_path"))
    gpu_row = (env.get("gpus") or [None])[0] if gpu else None
    report: dict = {
        "ogrpo_selftest": 1, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mode": "gpu" if gpu else "cpu",
        "device": ({k: gpu_row.get(k) for k in ("name", "catalog", "sm", "memory_gib", "bf16", "tf32")}
                   if gpu_row else {"name": "cpu"}),
        "config": str(rc.source), "model": model_path, "gpus_planned": gpus,
        "plan": {"precision": plan.precision.value, "mode": plan.mode.value, "strategy": plan.trainer.strategy.value,
                 "attn_implementation": plan.attn_implementation, "tf32": plan.trainer_args.tf32,
                 "vllm_args": plan.vllm.args.to_dict()},
        "environment": env, "checks": {},
    }
    checks = report["checks"]

    def record(name: str, fn: Callable[[], dict]) -> dict:
        checks[name] = run_check(fn)
        if progress:
            progress(name, checks[name])
        return checks[name]

    sdtype = plan_dtype(plan)
    record("tf32", lambda: check_tf32(plan, gpu_row))
    record("flash_attn", lambda: check_flash_attn(plan, gpu_row))
    record("deepspeed_ops", lambda: check_deepspeed_ops(tuple(ds_ops), jit=jit_ops))
    texts, source = calibration_texts(rc)
    record("fp16_overflow", lambda: overflow_probe(model_path, device, plan.precision or "fp32",
                                                   server_dtype=sdtype, texts=texts, source=source))
    if not server:
        checks["vllm_server"] = checks["weight_push"] = result(SKIP, "--no-server")
    else:
        _server_checks(report, rc, plan, model_path, device, sdtype, texts, health_timeout, record)
    statuses = [c["status"] for c in checks.values()]
    report["status"] = FAIL if FAIL in statuses else PASS
    return report


def _server_checks(report, rc, plan, model_path, device, sdtype, texts, health_timeout, record) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        report["checks"]["vllm_server"] = report["checks"]["weight_push"] = result(
            SKIP, "vLLM is not installed: generation falls back to transformers")
        return
    import torch
    import yaml

    n_cuda = torch.cuda.device_count() if device == "cuda" else 0
    one_gpu = n_cuda == 1
    model_bytes = sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors")) \
        if Path(model_path).is_dir() else 0
    total = torch.cuda.get_device_properties(0).total_memory if n_cuda else 0
    splan, note = server_plan(plan, one_gpu, model_bytes, total)
    work = Path(tempfile.mkdtemp(prefix="ogrpo-selftest-"))
    run = rc.to_dict()
    run["ogrpo"]["plan"] = splan.to_dict()  # the run config carries the dict form; `serve` parses it
    run_yaml = work / "run.yaml"
    run_yaml.write_text(yaml.safe_dump(run))
    # the server on its own GPU when there are two: the trainer side (this process) keeps cuda:0
    senv = {"CUDA_VISIBLE_DEVICES": _visible(1)} if n_cuda >= 2 else {}
    srv = Server(run_yaml, work, senv)
    try:
        def start() -> dict:
            argv = serve_argv(str(run_yaml), "127.0.0.1", srv.port, dry_run=True)
            secs = srv.start(health_timeout)
            return result(PASS, f"healthy after {secs:.1f} s with the plan's flags" + (f" ({note})" if note else ""),
                          argv=argv, startup_s=round(secs, 1), plan_args=splan.vllm.args.to_dict(),
                          changed=note, log=str(srv.log_path))

        started = record("vllm_server", start)
        if started["status"] != PASS:
            report["checks"]["weight_push"] = result(SKIP, "the server did not start")
            return
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        enc = _encode(tok, texts[:2], max_len=24)
        prompts = [[int(t) for t, m in zip(ids, mask) if m] for ids, mask in
                   zip(enc["input_ids"].tolist(), enc["attention_mask"].tolist())]
        trl = {**rc.trl, "model_name_or_path": model_path}
        expect = expected_from_run_config(trl, rc.ogrpo.to_dict(), dtype=sdtype, plan=splan)
        record("weight_push", lambda: push_and_gap(srv.url, model_path, sdtype, device, push=not one_gpu,
                                                   expect=expect, prompts=prompts))
    finally:
        srv.stop()


def _visible(index: int) -> str:
    ids = [x for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return ids[index] if len(ids) > index else str(index)


def check_inputs(gpus: str | None, out: str | os.PathLike | None, ds_ops: tuple[str, ...] | None = None) -> None:
    """Refuse, before the checks run, a GPU spec the catalog does not know, DeepSpeed ops it does not have (a
    check of nothing would pass), and a report path that cannot be written (the report would be lost after
    them) or holds a file already (an earlier report): its directory is made and a file is tried in it (root
    passes access() where the file system says no)."""
    if gpus:
        parse_gpus(gpus)
    _check_out(out)
    if ds_ops is not None:  # last: it imports DeepSpeed
        _check_ds_ops(ds_ops)


def _check_out(out: str | os.PathLike | None) -> None:
    if not out:
        return
    path = Path(out)
    where = path if path.is_dir() else path.parent
    if path.exists() and not path.is_dir():
        raise OgrpoError(f"-o {out}: a file is there already (an earlier report?); choose another report path or "
                         "a directory")
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as exc:
        raise OgrpoError(f"-o {out}: cannot write the report there ({exc.strerror or exc}); choose another "
                         "report path") from None


def _check_ds_ops(ops: tuple[str, ...]) -> None:
    if not ops:
        raise OgrpoError("--ds-ops names no op; give a comma list (e.g. cpu_adam,fused_adam)")
    try:
        # heavy: deepspeed (only where ops are named; DeepSpeed absent is the op checks' own finding)
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
    except Exception:  # noqa: BLE001 - no DeepSpeed (or a broken one): the checks report it
        return
    unknown = [op for op in ops if op not in ALL_OPS]
    if unknown:
        raise OgrpoError(f"--ds-ops {','.join(unknown)}: not a DeepSpeed op (this DeepSpeed has "
                         f"{', '.join(sorted(ALL_OPS))})")


def write_report(report: dict, out: str | os.PathLike | None = None) -> Path:
    path = Path(out) if out else Path.cwd() / f"ogrpo-selftest-{time.strftime('%Y%m%d-%H%M%S')}.json"
    if path.is_dir():
        path = path / f"ogrpo-selftest-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return path
