"""Placement, strategy, batch arithmetic and hardware-aware settings of the planner."""

from __future__ import annotations

import json
import sys

import pytest

from ogrpo.config import load_run_config
from ogrpo.errors import ConfigError, OgrpoError
from ogrpo.hardware import parse_gpus
from ogrpo.models import resolve_model
from ogrpo.plan import make_plan, plan_from_config, valid_tp_sizes
from ogrpo.planner.types import Mode, Precision, Strategy

CONTRACT_KEYS = {"fits", "reasons", "fixes", "precision", "attn_implementation", "mode", "vllm", "trainer",
                 "trainer_args", "env", "settings"}


def _plan(recipe, gpus, model=None, **over):
    rc = load_run_config(recipe, over or None)
    return plan_from_config(rc, gpus=gpus, model=model)


def test_3xa40_qwen_1_5b_splits_in_node(basic_recipe):
    p = _plan(basic_recipe, "3xA40").to_dict()
    assert CONTRACT_KEYS <= set(p)
    json.dumps(p)  # pure data
    assert p["fits"] and p["mode"] == "server"
    assert (p["vllm"]["nodes"], p["vllm"]["gpus"], p["vllm"]["num_gpus"]) == ([0], [0], 1)
    assert (p["trainer"]["nodes"], p["trainer"]["gpus"], p["trainer"]["num_processes"]) == ([0], [1, 2], 2)
    assert p["vllm"]["tensor_parallel_size"] == 1 and p["vllm"]["data_parallel_size"] == 1
    assert p["precision"] == "bf16" and p["attn_implementation"] == "flash_attention_2"
    ta = p["trainer_args"]
    assert ta["bf16"] is True and ta["fp16"] is False and ta["tf32"] is True
    assert ta["use_vllm"] is True and ta["vllm_mode"] == "server"
    assert ta["model_init_kwargs"]["attn_implementation"] == "flash_attention_2"
    # A40 boxes are PCIe: NCCL P2P off for the weight broadcast.
    assert p["env"]["NCCL_P2P_DISABLE"] == "1"
    assert p["vllm"]["args"]["dtype"] == "bfloat16" and p["vllm"]["args"]["max_model_len"] == 512 + 1024
    names = {s["name"] for s in p["settings"]}
    assert {"precision", "attn_implementation", "trainer.strategy", "NCCL_P2P_DISABLE"} <= names
    assert all(s["reason"] for s in p["settings"])


def test_v100_settings(basic_recipe):
    p = _plan(basic_recipe, "4xV100-32G").to_dict()
    assert p["precision"] == "fp16" and p["attn_implementation"] == "sdpa"
    ta = p["trainer_args"]
    # TRL turns bf16 on unless told: both explicit.
    assert ta["bf16"] is False and ta["fp16"] is True and ta["tf32"] is False
    assert ta["torch_compile"] is False  # no tensor cores in Triton below sm_80
    assert p["vllm"]["args"]["dtype"] == "half"
    assert "NCCL_P2P_DISABLE" not in p["env"]  # SXM2 V100 default: NVLink
    assert p["trainer"]["num_processes"] == 3


def _changes(plan) -> dict:
    return {c.key: (c.old, c.new) for c in plan.changes}


def test_v100_adapts_a40_settings_and_lists_each_change(write_recipe):
    # What open-r1's recipes set for A40/H100 runs: each becomes what sm_70 can run, listed with its reason.
    text = ("model_name_or_path: Qwen/Qwen2.5-0.5B\nbf16: true\ntorch_dtype: bfloat16\n"
            "attn_implementation: flash_attention_2\ntf32: true\n")
    p = _plan(write_recipe(text), "4xV100")
    assert p.precision is Precision.FP16 and p.attn_implementation == "sdpa"
    assert p.trainer_args.to_dict()["fp16"] is True and p.trainer_args.to_dict()["bf16"] is False and p.trainer_args.to_dict()["tf32"] is False
    assert p.trainer_args.to_dict()["model_init_kwargs"] == {"attn_implementation": "sdpa", "dtype": "float32"}
    ch = _changes(p)
    assert ch["bf16"] == (True, False) and ch["attn_implementation"] == ("flash_attention_2", "sdpa")
    assert ch["tf32"] == (True, False) and ch["torch_dtype"] == ("bfloat16", "float32")
    assert all(c.reason for c in p.changes)
    # The same recipe on A40 keeps bf16, FA2 and TF32: only the master-weight dtype differs from it.
    a40 = _changes(_plan(write_recipe(text), "3xA40"))
    assert "bf16" not in a40 and "attn_implementation" not in a40 and "tf32" not in a40
    assert a40["torch_dtype"] == ("bfloat16", "float32")
    # A user's tf32: false on an Ampere GPU is honored, not overridden.
    assert _plan(write_recipe("model_name_or_path: Qwen/Qwen2.5-0.5B\ntf32: false\n"), "3xA40").trainer_args.to_dict()[
        "tf32"] is False


def test_fp32_only_models_are_refused_on_v100(write_recipe, tiny_model_dir):
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    cfg["model_type"] = "gemma2"
    (tiny_model_dir / "config.json").write_text(json.dumps(cfg))
    short = f"model_name_or_path: {tiny_model_dir}\nmax_completion_length: 64\nogrpo:\n  max_prompt_length: 64\n"
    with pytest.raises(ConfigError, match="only in fp32"):
        _plan(write_recipe(short), "2xV100")
    assert _plan(write_recipe(short), "2xA40").fits


def test_vllm_settings_from_the_recipe(write_recipe):
    base = "model_name_or_path: Qwen/Qwen2.5-1.5B-Instruct\nper_device_train_batch_size: 8\nnum_generations: 8\n"
    # TRL's defaults (use_vllm false, vllm_mode colocate) differ from O-GRPO's server: listed, not silent.
    ch = _changes(_plan(write_recipe(base), "3xA40"))
    assert ch["use_vllm"] == (False, True) and ch["vllm_mode"] == ("colocate", "server")
    # Set explicitly, they keep their meaning: colocated, with the recipe's share of the device.
    p = _plan(write_recipe(base + "use_vllm: true\nvllm_mode: colocate\nvllm_gpu_memory_utilization: 0.35\n",
                           "c.yaml"), "3xA40")
    assert p.mode is Mode.COLOCATE and p.trainer_args.to_dict()["vllm_gpu_memory_utilization"] == 0.35
    assert p.vllm.args.to_dict()["gpu_memory_utilization"] == 0.35
    # the vLLM keys are kept; what is listed is what the plan sets for keys the recipe leaves unset (TF32 ...)
    assert not {"use_vllm", "vllm_mode", "vllm_gpu_memory_utilization"} & set(_changes(p))
    assert all("not set in the recipe" in c.reason for c in p.changes)
    # Server share, tensor and data parallel sizes from the recipe (8 GPUs: 2 x 2 for the server, 4 trainers).
    p = _plan(write_recipe(base + "use_vllm: true\nvllm_mode: server\nvllm_gpu_memory_utilization: 0.7\n"
                           "vllm_tensor_parallel_size: 2\nvllm_data_parallel_size: 2\nnum_processes: 4\n", "s.yaml"),
              "8xA40")
    assert p.vllm.args.to_dict()["gpu_memory_utilization"] == 0.7
    assert (p.vllm.tensor_parallel_size, p.vllm.data_parallel_size, p.vllm.gpus) == (2, 2, [0, 1, 2, 3])
    assert p.vllm.args.to_dict()["data_parallel_size"] == 2 and p.trainer.num_processes == 4
    assert all("not set in the recipe" in c.reason for c in p.changes)  # nothing the recipe set is changed
    # One that cannot be kept is listed with its reason: TP 5 does not divide 12 heads.
    ch = _changes(_plan(write_recipe(base + "use_vllm: true\nvllm_mode: server\nvllm_tensor_parallel_size: 5\n",
                                     "t.yaml"), "8xA40"))
    assert ch["vllm_tensor_parallel_size"][0] == 5


def test_deepspeed_eval_and_output_dir_are_reported(write_recipe):
    text = ("model_name_or_path: Qwen/Qwen2.5-1.5B-Instruct\ndeepspeed: ds/zero3.json\n"
            "eval_strategy: steps\noutput_dir: data/x\n")
    # B 8 x (512 + 512) tokens, no accumulation: DDP holds fp32 weights, Adam and all-reduce buckets (4 + 8 + 4 B
    # x 1.544e9 = 23.0 GiB), the larger of its gradients (4 B/param, 5.75) and activations + logits chunk
    # (1.3 + 0.37), + 1 = 29.75 GiB, over 4xV100-16G's 14.4: ZeRO-2 (11.4 GiB), with the plan's own DeepSpeed file.
    p = _plan(write_recipe(text), "4xV100-16G")
    assert p.trainer.strategy is Strategy.ZERO2
    ch = _changes(p)
    assert ch["deepspeed"] == ("ds/zero3.json", "deepspeed.json")
    assert p.trainer_args.to_dict()["deepspeed"] is None and p.trainer_args.to_dict()["eval_strategy"] == "no"
    assert ch["eval_strategy"] == ("steps", "no") and ch["output_dir"][0] == "data/x"
    # On 3xA40 DDP fits (29.75 of 40.5 GiB): the recipe's file is dropped and none replaces it.
    ddp = _plan(write_recipe(text, "ddp.yaml"), "3xA40")
    assert ddp.trainer.strategy is Strategy.DDP and _changes(ddp)["deepspeed"] == ("ds/zero3.json", None)


def test_one_gpu_colocates(basic_recipe):
    p = _plan(basic_recipe, "1xA40").to_dict()
    assert p["mode"] == "colocate" and p["vllm"]["num_gpus"] == 0
    assert p["trainer"]["gpus"] == [0] and p["trainer"]["num_processes"] == 1
    assert p["trainer_args"]["vllm_mode"] == "colocate"
    assert p["trainer_args"]["vllm_gpu_memory_utilization"] == 0.3


def test_multi_node_server_gets_node_zero(basic_recipe):
    p = _plan(basic_recipe, "2x8xA100-80G", model="Qwen/Qwen2.5-7B-Instruct").to_dict()
    assert p["vllm"]["nodes"] == [0] and p["trainer"]["nodes"] == [1]
    assert p["trainer"]["gpus"] == list(range(8)) and p["trainer"]["num_processes"] == 8
    # 7.6B in bf16 (15 GiB) and a KV cache fit one 80 GB GPU: TP 1, and the node's other 7 GPUs hold replicas
    # (data parallel 8) rather than sitting idle or widening one replica's KV cache.
    assert p["vllm"]["tensor_parallel_size"] == 1 and p["vllm"]["data_parallel_size"] == 8
    assert p["vllm"]["gpus"] == list(range(8))
    assert "NCCL_P2P_DISABLE" not in p["env"]
    assert not any("idle" in w for w in p["warnings"])


@pytest.mark.parametrize("trl, tp, dp, idle", [
    ({"vllm_tensor_parallel_size": 4}, 4, 2, False),  # the recipe's TP kept; replicas fill the node
    ({"vllm_data_parallel_size": 1}, 1, 1, True),  # the recipe's DP kept; the idle GPUs are reported
    ({"vllm_tensor_parallel_size": 2, "vllm_data_parallel_size": 2}, 2, 2, True),
])
def test_multi_node_server_data_parallel_follows_the_recipe(basic_recipe, trl, tp, dp, idle):
    p = _plan(basic_recipe, "2x8xA100-80G", model="Qwen/Qwen2.5-7B-Instruct", **trl).to_dict()
    assert (p["vllm"]["tensor_parallel_size"], p["vllm"]["data_parallel_size"]) == (tp, dp)
    assert p["vllm"]["gpus"] == list(range(tp * dp))
    assert any("idle" in w for w in p["warnings"]) is idle
    assert not [c for c in p["changes"] if c["key"].startswith("vllm_") and "parallel" in c["key"]]


def test_one_node_server_takes_no_trainer_gpu_for_replicas(basic_recipe):
    p = _plan(basic_recipe, "8xA40").to_dict()  # replicas would take trainer GPUs: not planned on one node
    assert p["vllm"]["data_parallel_size"] == 1 and len(p["vllm"]["gpus"]) == p["vllm"]["tensor_parallel_size"]


def test_valid_tp_sizes():
    assert valid_tp_sizes(resolve_model("Qwen/Qwen2.5-7B"), 8) == [1, 2, 4]
    assert valid_tp_sizes(resolve_model("Qwen/Qwen2.5-1.5B"), 8) == [1, 2, 4]  # 12 heads, 2 KV heads, MLP 8960 (not /6)
    assert valid_tp_sizes(resolve_model("meta-llama/Llama-3.1-8B"), 8) == [1, 2, 4, 8]


def test_vllm_gpus_override(basic_recipe):
    p = _plan(basic_recipe, "4xA40", **{"ogrpo": {"vllm_gpus": 2}}).to_dict()
    assert p["vllm"]["gpus"] == [0, 1] and p["vllm"]["tensor_parallel_size"] == 2 and p["trainer"]["gpus"] == [2, 3]
    p0 = _plan(basic_recipe, "4xA40", **{"ogrpo": {"vllm_gpus": 0}}).to_dict()
    assert p0["mode"] == "colocate" and p0["trainer"]["num_processes"] == 4
    with pytest.raises(ConfigError, match="must divide the 12 attention heads"):
        _plan(basic_recipe, "8xA40", **{"ogrpo": {"vllm_gpus": 3}})
    with pytest.raises(ConfigError, match="leaves no trainer GPU"):
        _plan(basic_recipe, "2xA40", **{"ogrpo": {"vllm_gpus": 2}})


def test_strategy_escalates_with_memory(basic_recipe):
    # 1.5B, B 8 x (512 + 1024) tokens, linear_logprobs on (one 0.37 GiB chunk of logits and its gradient), no
    # accumulation. DDP:
    # fp32 weights, Adam and all-reduce buckets (4 + 8 + 4 B/param, 23.0 GiB) + the larger of the gradients
    # (4 B/param, 5.75) and activations + logits (1.95 + 0.37) + 1 = 29.75 GiB: fits an A40 (40.5), not a
    # V100-32G (28.8).
    assert _plan(basic_recipe, "3xA40").trainer.strategy is Strategy.DDP
    # V100-32G and V100-16G (14.4): ZeRO-2 over 3 ranks, (2 + 12 / 3) B/param (8.6 GiB) + the larger of the
    # gradient partition (2 / 3 B/param, 1.0) and activations + logits (2.32) + 1 = 11.9 GiB.
    assert _plan(basic_recipe, "4xV100-32G").trainer.strategy is Strategy.ZERO2
    assert _plan(basic_recipe, "4xV100-16G").trainer.strategy is Strategy.ZERO2
    # 2xV100-16G: one trainer GPU shards nothing; only offloading the optimizer (4 B/param, 5.8 GiB) fits.
    assert _plan(basic_recipe, "2xV100-16G").trainer.strategy is Strategy.ZERO3_OFFLOAD
    # TRL's own log-prob path (kernels off) with 2048-token completions holds B x C x V x 8 B = 18.5 GiB of
    # logits: DDP needs 17.3 (weights, Adam) + 5.75 buckets + 3.25 activations + 18.5 logits (they outweigh the
    # 5.75 of gradients) + 1 = 45.8 GiB > 40.5 on an A40 (the kernel's chunk: 29.75), so the same run escalates
    # to ZeRO-2 there.
    long = {"max_completion_length": 2048}
    assert _plan(basic_recipe, "3xA40", **long).trainer.strategy is Strategy.DDP
    assert _plan(basic_recipe, "3xA40", **long, ogrpo={"kernels": False}).trainer.strategy is Strategy.ZERO2


def test_7b_on_8xa40_takes_zero2(basic_recipe):
    # Qwen2.5-7B: P = 7.616e9 params, 28 layers, hidden 3584, MLP 18944. 8xA40: the server takes 1 GPU, the
    # trainer 7; each A40 keeps 45 x (1 - 0.10 headroom) = 40.5 GiB. bf16 with fp32 master weights.
    P, GiB, n, budget = 7.616e9, 2**30, 7, 45 * 0.9
    # activations with checkpointing: 8 x 1536 tokens x (28 x 3584 + 10 x 3584 + 3 x 18944) x 2 B = 4.4 GiB;
    # linear_logprobs holds one chunk of logits and its gradient (2 x 331 rows x V x 4 B); 1 GiB runtime.
    acts_logits = (8 * 1536 * (28 * 3584 + 10 * 3584 + 3 * 18944) * 2 + 2 * 331 * 152064 * 4) / GiB
    # No accumulation: gradients and activations are not held at once, the step holds the larger.
    # DDP: fp32 weights 4 + Adam 8 + all-reduce buckets 4 B/param, and 4 B/param of gradients: 143 GiB
    ddp = (4 + 8 + 4) * P / GiB + max(4 * P / GiB, acts_logits) + 1.0
    # ZeRO-2: bf16 weights; fp32 master + Adam over 7, and the larger of activations + logits and the bf16
    # gradient partition: 32.3 GiB
    zero2 = (2 + 12 / n) * P / GiB + max(2 * P / n / GiB, acts_logits) + 1.0
    assert ddp > budget >= zero2  # the cheapest that fits is ZeRO-2 (ZeRO-3 would shard more, for nothing)
    p = _plan(basic_recipe, "8xA40", model="Qwen/Qwen2.5-7B-Instruct")
    assert p.fits and p.trainer.num_processes == n and p.trainer.gradient_checkpointing
    assert p.trainer.strategy is Strategy.ZERO2
    assert abs(p.trainer.memory_gib_per_gpu - zero2) < 0.1 and p.trainer.memory_terms["budget_gib"] == budget


def test_no_fit_names_fixes(basic_recipe):
    # (1.5B fits one V100-16G with ZeRO-3 + optimizer offload: the GPU keeps only the fp16 weights, 2.9 GiB; 7.6B
    # does not, with 14.2 GiB of fp16 weights.)
    assert _plan(basic_recipe, "1xV100-16G").trainer.strategy is Strategy.ZERO3_OFFLOAD
    p = _plan(basic_recipe, "1xV100-16G", model="Qwen/Qwen2.5-7B-Instruct")
    assert not p.fits and p.reasons and p.fixes
    assert [f.text for f in p.fix_actions] == p.fixes
    # 7.6e9 params with TRL's own log-prob path (kernels off, as the conservative profile runs): logits of
    # 8 x 1024 completion tokens x 152k vocab (9.3 GiB) do not shrink with more GPUs, so the V100-16G answer
    # needs a smaller micro-batch as well: the largest that fits (4, with accumulation 2 keeping the batch).
    big = _plan(basic_recipe, "2xV100-16G", model="Qwen/Qwen2.5-7B-Instruct", ogrpo={"kernels": False})
    assert not big.fits and any(
        "xV100-16G with per_device_train_batch_size 4 and gradient_accumulation_steps 2" in f for f in big.fixes)
    # With linear_logprobs the logits are one 0.37 GiB chunk: more V100-16Gs alone are the answer.
    on = _plan(basic_recipe, "2xV100-16G", model="Qwen/Qwen2.5-7B-Instruct")
    assert not on.fits
    assert any(f.cli.get("gpus", "").endswith("xV100-16G") and f.config == {} for f in on.fix_actions)
    # Hardware fixes name the fewest GPUs first, of any type at least this large: one A40 (colocated, ZeRO-3 +
    # offload: the GPU keeps the 14.2 GiB of fp16 weights, the gradients and optimizer are in host RAM) before
    # five V100-16Gs (a TP-2 server and three ZeRO-3 + offload trainer GPUs; seven while the gradients counted).
    assert on.fixes[0] == "1xA40" and "5xV100-16G" in on.fixes


def test_batch_arithmetic(write_recipe):
    # 3 trainer GPUs x 8 per device x 1 step = 24 completions, not divisible by 16 generations.
    path = write_recipe("model_name_or_path: Qwen/Qwen2.5-0.5B\nper_device_train_batch_size: 8\n"
                        "num_generations: 16\n")
    p = _plan(path, "4xA40")
    assert not p.fits
    assert any("not divisible by num_generations 16" in r for r in p.reasons)
    # 16 / gcd(3, 16) = 16: per_device_train_batch_size 16 gives 48 = 3 x 16.
    assert "per_device_train_batch_size 16" in p.fixes
    assert "num_generations 12" in p.fixes  # the largest divisor of 24
    assert p.batch.generation_batch_size == 24


def test_generation_batch_size_must_divide(write_recipe):
    path = write_recipe("model_name_or_path: Qwen/Qwen2.5-0.5B\nper_device_train_batch_size: 4\n"
                        "num_generations: 4\ngeneration_batch_size: 10\n")
    p = _plan(path, "3xA40")
    assert any("generation_batch_size 10 is not divisible by the global batch" in r for r in p.reasons)


@pytest.mark.parametrize("gpus, mode, server, trainer_procs", [
    ("cpu", "colocate", [], 1),
    ("2xcpu", "server", [0], 1),
    ("3xcpu", "server", [0], 2),
])
def test_cpu_embedded_default(tiny_recipe, gpus, mode, server, trainer_procs):
    p = _plan(tiny_recipe, gpus).to_dict()
    assert p["fits"], p["reasons"]
    assert p["mode"] == mode and p["vllm"]["gpus"] == server and p["trainer"]["num_processes"] == trainer_procs
    assert p["precision"] == "fp32" and p["attn_implementation"] == "sdpa"
    assert p["trainer_args"]["use_cpu"] is True and p["trainer_args"]["bf16"] is False
    assert p["trainer"]["strategy"] == "ddp" and p["trainer"]["num_gpus"] == 0
    if mode == "server":
        assert p["trainer"]["env"]["OMP_NUM_THREADS"] == "1"
        assert p["vllm"]["args"]["dtype"] == "float32"
        # one engine process computing on all the server's cores, no per-step stats (ogrpo bench rollout)
        assert p["vllm"]["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert p["vllm"]["args"]["disable_log_stats"] is True
    else:
        assert p["trainer_args"]["vllm_mode"] == "colocate"
    # an explicit KV budget, not a share of host memory: every sequence of the generation batch, in whole
    # 128-token blocks plus a spare, at fp32 K and V per layer and KV head
    args, b = p["vllm"]["args"], p["batch"]
    assert "gpu_memory_utilization" not in args
    per_token = 2 * p["model"]["num_layers"] * p["model"]["num_kv_heads"] * p["model"]["head_dim"] * 4
    blocks = -(-b["max_model_len"] // 128) + 1
    assert args["kv_cache_memory_bytes"] == args["max_num_seqs"] * blocks * 128 * per_token
    assert p["vllm"]["memory_terms"]["max_concurrent_seqs"] >= args["max_num_seqs"]


def test_two_cpu_nodes_give_the_server_node_0(tiny_recipe):
    """--gpus 2x2xcpu (a Slurm partition of CPU nodes): like GPU nodes, the server owns node 0 and the trainer
    runs every process of node 1 (tests/slurm/test_slurm_two_node.py runs 2x1xcpu for real)."""
    p = _plan(tiny_recipe, "2x2xcpu", use_vllm=True).to_dict()
    assert p["fits"], p["reasons"]
    assert p["mode"] == "server" and p["vllm"]["nodes"] == [0]
    assert p["trainer"]["nodes"] == [1] and p["trainer"]["num_processes"] == 2


def test_cpu_kv_budget_beyond_the_host_share_does_not_fit(tiny_recipe):
    batch = {"per_device_train_batch_size": 64, "num_generations": 8}  # 64 sequences in the KV budget
    big = _plan(tiny_recipe, "2xcpu-64G", **batch).to_dict()["vllm"]["memory_terms"]
    kv = big["terms"]["kv_cache"]
    fixed = sum(v for k, v in big["terms"].items() if k != "kv_cache")  # total_gib is rounded to 0.01
    assert kv > 0.004  # larger than the rounding of the terms below
    # a host whose 0.2 share holds the weights and overhead but only half the KV budget
    host = (fixed + kv / 2) / 0.2
    p = _plan(tiny_recipe, f"2xcpu-{host:.4f}G", **batch)
    assert not p.fits
    assert any(r.startswith("vLLM server: ") and "+ KV for" in r and "host RAM" in r for r in p.reasons), p.reasons
    assert _plan(tiny_recipe, f"2xcpu-{(fixed + kv * 1.5) / 0.2:.4f}G", **batch).fits


def test_cpu_without_vllm(tiny_recipe):
    p = _plan(tiny_recipe, "2xcpu", **{"use_vllm": False})
    assert p.mode is Mode.NONE and p.trainer.num_processes == 2 and p.trainer_args.to_dict()["use_vllm"] is False


def test_profiles(basic_recipe):
    con = _plan(basic_recipe, "3xA40", **{"ogrpo": {"profile": "conservative"}}).to_dict()
    agg = _plan(basic_recipe, "3xA40", **{"ogrpo": {"profile": "aggressive"}}).to_dict()
    assert con["vllm"]["args"]["gpu_memory_utilization"] < agg["vllm"]["args"]["gpu_memory_utilization"]
    assert con["vllm"]["args"]["enforce_eager"] is True and agg["vllm"]["args"]["enforce_eager"] is False
    assert con["trainer"]["gradient_checkpointing"] is True
    assert agg["trainer_args"]["torch_compile"] is True  # sm_86: Triton has tensor cores
    with pytest.raises(OgrpoError, match="conservative, balanced, aggressive"):
        make_plan(parse_gpus("3xA40"), resolve_model("Qwen/Qwen2.5-1.5B"), load_run_config(basic_recipe), "fast")


def test_user_gradient_checkpointing_is_respected(write_recipe):
    p = _plan(write_recipe("model_name_or_path: Qwen/Qwen2.5-1.5B\ngradient_checkpointing: false\n"), "3xA40")
    assert p.trainer.gradient_checkpointing is False


def test_plan_is_pure_and_imports_no_torch(basic_recipe):
    import subprocess

    code = (f"import sys; from ogrpo.config import load_run_config; from ogrpo.plan import plan_from_config; "
            f"plan_from_config(load_run_config({str(basic_recipe)!r}), gpus='3xA40'); "
            "print([m for m in ('torch', 'trl', 'transformers', 'vllm') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    a = _plan(basic_recipe, "3xA40").to_dict()
    b = _plan(basic_recipe, "3xA40").to_dict()
    assert a == b


def test_plan_from_config_defaults_to_config_gpus_then_cpu(tiny_recipe, write_recipe, tiny_model_dir):
    assert plan_from_config(load_run_config(tiny_recipe)).cluster.spec == "cpu"
    rc = load_run_config(write_recipe(f"model_name_or_path: {tiny_model_dir}\nogrpo:\n  gpus: 2xcpu\n"))
    assert plan_from_config(rc).cluster.spec == "2xcpu"


def test_prompt_length_default_fits_small_models(write_recipe):
    # The tiny model has 256 positions: with 32 completion tokens the default prompt budget is 224, not 512.
    p = _plan(write_recipe("model_name_or_path: ogrpo:tiny\nmax_completion_length: 32\nuse_vllm: true\n"
                           "per_device_train_batch_size: 4\nnum_generations: 4\n"), "2xcpu")
    assert p.fits, p.reasons
    assert p.batch.prompt_length == 224 and p.vllm.args.to_dict()["max_model_len"] == 256
    too_long = _plan(write_recipe("model_name_or_path: ogrpo:tiny\nmax_completion_length: 200\n"
                                  "num_generations: 4\nper_device_train_batch_size: 4\n"
                                  "ogrpo:\n  max_prompt_length: 128\n", "long.yaml"), "2xcpu")
    assert not too_long.fits and any("exceed the model's 256 positions" in r for r in too_long.reasons)
    assert "max_completion_length 128" in too_long.fixes
    # no prompt budget in the recipe: the completion leaves too little room for one; the plan says that (not "prompt
    # 512", a budget nobody set) and the fix it names leaves the prompt its minimum, not 1 token of completion
    no_room = _plan(write_recipe("model_name_or_path: ogrpo:tiny\nmax_completion_length: 245\nnum_generations: 4\n"
                                 "per_device_train_batch_size: 4\n", "noroom.yaml"), "2xcpu")
    assert not no_room.fits and ("completion 245 tokens leave 11 of the model's 256 positions for the prompt (at "
                                 "least 16; ogrpo.max_prompt_length sets the prompt budget)") in no_room.reasons
    assert no_room.fixes == ["max_completion_length 240"]


def test_colocated_vllm_share_grows_to_hold_the_weights(basic_recipe):
    # 7.6e9 params x 2 B = 14.2 GiB of weights: 0.3 x 45 GiB = 13.5 is too small, 0.4 x 45 = 18 holds them
    # plus overhead and a KV cache. The trainer keeps 45 x (1 - 0.1 - 0.4) = 22.5 GiB: ZeRO-3 with offload fits it
    # (the GPU keeps the 14.2 GiB of fp16 weights; DeepSpeed holds the gradients and optimizer in host RAM), DDP
    # does not, and with DDP pinned LoRA is the fix named.
    auto = _plan(basic_recipe, "1xA40", model="Qwen/Qwen2.5-7B-Instruct")
    assert auto.fits and auto.trainer.strategy is Strategy.ZERO3_OFFLOAD
    ddp = {"strategy": "ddp"}
    p = _plan(basic_recipe, "1xA40", model="Qwen/Qwen2.5-7B-Instruct", ogrpo=ddp).to_dict()
    assert p["mode"] == "colocate"
    assert p["trainer_args"]["vllm_gpu_memory_utilization"] == 0.4 == p["vllm"]["args"]["gpu_memory_utilization"]
    assert p["vllm"]["memory_terms"]["max_concurrent_seqs"] >= 1
    assert not p["fits"] and p["trainer"]["memory_terms"]["budget_gib"] == pytest.approx(22.5)
    # LoRA: the bf16 base (14.2 GiB) + 4.4 activations + one 0.37 GiB logits chunk + 1 fits 22.5 GiB alone.
    assert "LoRA (use_peft: true)" in p["fixes"]
    # TRL's own log-prob path (kernels off): LoRA alone leaves 8 x 1024 x 152k logits (9.3 GiB) over the
    # budget, so it is offered with the largest micro-batch that fits: 4 (4.6 GiB of logits), accumulation 2.
    off = _plan(basic_recipe, "1xA40", model="Qwen/Qwen2.5-7B-Instruct", ogrpo={**ddp, "kernels": False}).to_dict()
    assert off["trainer"]["memory_terms"]["budget_gib"] == pytest.approx(22.5)
    assert "LoRA (use_peft: true)" not in off["fixes"]
    assert ("LoRA (use_peft: true) with per_device_train_batch_size 4 and gradient_accumulation_steps 2"
            in off["fixes"])
    assert _plan(basic_recipe, "1xA100-80G", model="Qwen/Qwen2.5-7B-Instruct").fits


def test_batch_rules_train_and_eval():
    from ogrpo.plan import batch_rules

    # 8196 completions per generation with 3 processes x 8 and 16 generations: divisible by neither 24 nor 16.
    # The fix is the nearest multiple of lcm(24, 16) = 48: 171 x 48 = 8208 (= 342 x 24 = 513 x 16).
    r = batch_rules(8, 1, 16, 3, gbs_user=8196)
    assert len(r["reasons"]) == 2
    assert [f.config for f in r["fixes"]][0] == {"generation_batch_size": 8208}
    # TRL's eval rule: per_device_eval_batch_size x processes divisible by num_generations(_eval).
    assert batch_rules(16, 4, 16, 3, eval_batch=16)["reasons"] == []
    r = batch_rules(16, 4, 16, 3, eval_batch=10)
    assert r["reasons"] == ["eval batch 10 x 3 processes is not divisible by num_generations 16"]
    assert r["fixes"][0].config == {"per_device_eval_batch_size": 16}  # 16 / gcd(3, 16) = 16
    assert batch_rules(16, 4, 16, 3, eval_batch=10, eval_generations=2)["reasons"] == []


@pytest.mark.parametrize("gpus", ["cpu", "2xcpu", "3xA40", "4xV100-16G", "2x8xA100-80G"])
def test_plan_object_round_trips_through_its_dict(basic_recipe, gpus):
    # manifest.json and run.yaml carry the dict; render and launch read it back as the typed Plan
    from ogrpo.planner.types import Plan

    d = _plan(basic_recipe, gpus).to_dict()
    back = Plan.from_dict(json.loads(json.dumps(d)))
    assert back.to_dict() == d
    assert back.trainer.strategy == d["trainer"]["strategy"] and back.is_cpu == d["cluster"]["gpu"]["is_cpu"]
    # an older manifest without the newer sections still reads
    old = {k: v for k, v in d.items() if k not in ("batch", "kernels", "fix_actions", "changes")}
    assert Plan.from_dict(old).batch.generation_batch_size == 0


def test_every_catalog_gpu_follows_its_facts(basic_recipe):
    # one rules object per device kind: a catalog entry's bf16/TF32/flash-attn facts decide the settings
    from ogrpo.hardware import known_types

    for name in known_types():
        gpu = parse_gpus(name if name == "cpu" else f"8x{name}").gpu
        p = _plan(basic_recipe, name if name == "cpu" else f"8x{name}", model="Qwen/Qwen2.5-0.5B-Instruct")
        want = "fp32" if gpu.is_cpu else "bf16" if gpu.bf16 else "fp16"
        assert p.precision == want, name
        assert p.attn_implementation == ("flash_attention_2" if gpu.fa2 else "sdpa"), name
        assert p.trainer_args.to_dict().get("tf32", False) is gpu.tf32, name
        assert (p.trainer.num_gpus == 0) is gpu.is_cpu, name


# --- issue 23: LoRA under ZeRO, the recipe's num_processes, fixes that are the smallest and sane ------------------

LORA_MOE = ("model_name_or_path: Qwen/Qwen3-30B-A3B\nper_device_train_batch_size: 8\nnum_generations: 8\n"
            "max_completion_length: 1024\nuse_peft: true\nlora_target_modules: all-linear\n")


def test_lora_strategy_is_chosen_by_memory_and_zero3_shards_the_frozen_base(write_recipe):
    from ogrpo.planner.memory import lora_params
    from ogrpo.planner.lora import lora_spec

    # Qwen3-30B-A3B: P = 30,532,122,624 (bf16 base 56.9 GiB); LoRA r 16 on all linear layers (peft's MoE layout:
    # attention + router + fused experts) T = 996,507,648 adapters. 2x8xA100-80G: the trainer's 8 GPUs keep
    # 80 x 0.9 = 72 GiB each. It used to be DDP-only: "does not fit even with DDP".
    P, T, n, GiB = 30_532_122_624, 996_507_648, 8, 2**30
    model = resolve_model("Qwen/Qwen3-30B-A3B")
    assert model.params == P and lora_params(model, lora_spec({"use_peft": True, "lora_target_modules": "all-linear"},
                                                              "bf16")) == (T, 0)
    ddp = _plan(write_recipe(LORA_MOE + "ogrpo:\n  strategy: ddp\n", "ddp.yaml"), "2x8xA100-80G")
    # DDP: bf16 base 2P + fp32 adapters 4T, their grads 4T, Adam 8T, all-reduce buckets 4T: 76.4 GiB
    assert not ddp.fits and ddp.trainer.memory_gib_per_gpu > 72
    # The cheapest that fits: ZeRO-2. The whole base and half-precision adapters on each GPU (2P + 2T), the
    # adapters' gradients (2T / 8) and fp32 master + Adam (12T / 8) sharded.
    auto = _plan(write_recipe(LORA_MOE), "2x8xA100-80G")
    assert auto.fits and auto.trainer.strategy is Strategy.ZERO2 and auto.trainer.num_processes == n
    terms = auto.trainer.memory_terms["terms"]
    assert terms["weights"] == pytest.approx((2 * P + 2 * T) / GiB, abs=1e-3)
    assert terms["optimizer"] == pytest.approx(12 * T / n / GiB, abs=1e-3)
    assert terms["gradients"] == pytest.approx(2 * T / n / GiB, abs=1e-3)
    assert "LoRA" in next(s for s in auto.settings if s.name == "trainer.strategy").reason
    # ZeRO-3 (asked for: `--strategy zero3` with use_peft used to exit 2) shards the frozen base too: (2P + 2T) / 8
    # = 7.3 GiB. TRL gathers the whole model to merge the adapters before each weight push, so that phase holds
    # 2 (P + T) beside the partitions, less the loss step's activations, logits and layer gathers it replaces.
    z3 = _plan(write_recipe(LORA_MOE + "ogrpo:\n  strategy: zero3\n", "z3.yaml"), "2x8xA100-80G")
    t3 = z3.trainer.memory_terms["terms"]
    assert z3.fits and z3.trainer.strategy is Strategy.ZERO3
    assert t3["weights"] == pytest.approx((2 * P + 2 * T) / n / GiB, abs=1e-3)
    assert t3["zero3_lora_full_gather"] == pytest.approx(
        2 * (P + T) / GiB - t3["activations"] - t3["logits"] - t3["zero3_gather"], abs=5e-3)
    assert z3.trainer.memory_gib_per_gpu <= 72


def test_recipe_num_processes_is_kept_or_the_change_explained(write_recipe):
    base = ("model_name_or_path: Qwen/Qwen2.5-7B-Instruct\nper_device_train_batch_size: 16\nnum_generations: 16\n"
            "gradient_accumulation_steps: 4\nnum_processes: 7\n")
    # Two nodes: the server owns node 0, the trainer node 1's 8 GPUs: 7 processes as the recipe says (it used to
    # become 8), one GPU idle and said so.
    two = _plan(write_recipe(base), "2x8xA100-80G")
    assert two.fits and two.trainer.num_processes == 7 and two.trainer.gpus == list(range(7))
    assert "num_processes" not in _changes(two) and two.batch.num_processes == 7
    assert any("num_processes 7" in w and "1 trainer device(s)" in w for w in two.warnings)
    # One node of 8: one GPU for the server leaves exactly 7.
    assert _plan(write_recipe(base, "one.yaml"), "8xA100-80G").trainer.num_processes == 7
    # 4xA40 cannot hold 7: listed, with where the devices went and what keeps it.
    small = _plan(write_recipe(base, "small.yaml"), "4xA40")
    change = next(c for c in small.changes if c.key == "num_processes")
    assert (change.old, change.new) == (7, 3)
    assert "the vLLM server takes 1" in change.reason and "--gpus 8xA40" in change.reason


def test_hardware_fixes_are_the_fewest_gpus_that_fit(write_recipe):
    from ogrpo.planner.fixes import apply_fix

    # Qwen2.5-32B with 7 trainer processes on 8xV100-32G does not fit. The fixes used to be 6x8xV100-32G (48 GPUs)
    # and 8xH100; now: the fewest GPUs of any type at least this large, then the fewest V100-32Gs (with the
    # largest micro-batch that fits), each re-planning to a fit.
    text = ("model_name_or_path: Qwen/Qwen2.5-32B-Instruct\nper_device_train_batch_size: 16\nnum_generations: 16\n"
            "gradient_accumulation_steps: 4\nnum_processes: 7\n")
    p = _plan(write_recipe(text), "8xV100-32G")
    assert not p.fits
    hw = [f for f in p.fix_actions if "gpus" in f.cli]
    counts = [parse_gpus(f.cli["gpus"]).total_gpus for f in hw]
    assert counts == sorted(counts) and counts[0] <= 8 and max(counts) <= 16, p.fixes
    rc = load_run_config(write_recipe(text, "again.yaml"))
    for f in hw:
        fixed = apply_fix(rc, f)
        assert make_plan(parse_gpus(f.cli["gpus"]), resolve_model("Qwen/Qwen2.5-32B-Instruct"), fixed).fits, f
    # The recipe as written (7 trainer processes + the server) fits 8xA100-80G.
    a100 = _plan(write_recipe(text, "a100.yaml"), "8xA100-80G")
    assert a100.fits and a100.trainer.num_processes == 7 and "num_processes" not in _changes(a100)


def test_an_absurd_batch_is_refused_not_fixed_with_accumulation(write_recipe):
    # per_device_train_batch_size 10**12 used to plan "does not fit" with a fix of gradient accumulation 4e12.
    path = write_recipe("model_name_or_path: Qwen/Qwen2.5-1.5B-Instruct\nper_device_train_batch_size: 1000000000000\n"
                        "num_generations: 8\n")
    with pytest.raises(ConfigError) as err:
        _plan(path, "3xA40")
    assert "\n" not in str(err.value)
    assert "2,000,000,000,000 completions per generation on 2 trainer process(es)" in str(err.value)
    # A large real batch still plans, and its micro-batch fix keeps the effective batch (B x accumulation).
    big = _plan(write_recipe("model_name_or_path: Qwen/Qwen2.5-7B-Instruct\nper_device_train_batch_size: 64\n"
                             "num_generations: 8\nogrpo:\n  kernels: false\n", "big.yaml"), "3xA40")
    micro = [f.config for f in big.fix_actions if "gradient_accumulation_steps" in f.config]
    assert micro and all(c["per_device_train_batch_size"] * c["gradient_accumulation_steps"] == 64 for c in micro)


def test_params_on_a_known_model_warns_which_count_wins(write_recipe):
    path = write_recipe("model_name_or_path: Qwen/Qwen2.5-7B-Instruct\n")
    p = plan_from_config(load_run_config(path), gpus="3xA40", params="3B")
    assert p.model.params == 3_000_000_000 and p.model.hidden_size == 3584
    assert any(w.startswith("--params 3B overrides Qwen/Qwen2.5-7B-Instruct's 7.62B parameters")
               and "--params wins" in w for w in p.warnings), p.warnings
    assert not any("--params" in w for w in _plan(path, "3xA40").warnings)


@pytest.mark.parametrize("bad", ["0B", "-3B", "0", "nan", "1e30", "seven"])
def test_params_zero_negative_or_nonsense_exit_2_in_one_line(tiny_recipe, run_cli, bad):
    out = run_cli("plan", "--gpus", "3xA40", "--config", tiny_recipe, f"--params={bad}")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert [ln for ln in out.stderr.splitlines() if "--params" in ln] == [out.stderr.strip()], out.stderr


# --- issue 33: planner accuracy -------------------------------------------------------------------------------------


def test_zero3_offload_keeps_gradients_off_the_gpu_qwen3_30b_on_v100s(basic_recipe):
    """Qwen3-30B-A3B on 8xV100-32G: a TP-4 server and 4 trainer GPUs with ZeRO-3 + optimizer offload. DeepSpeed keeps
    the gradient partition on the host with the optimizer, so a GPU holds the fp16 weights' quarter (14.2 GiB), not
    that plus 14.2 GiB of gradients (it said 35.3 GiB needed, no fit); the host counts the 18 B per parameter."""
    from ogrpo.planner.host_memory import step_host_gib

    p = _plan(basic_recipe, "8xV100-32G", model="Qwen/Qwen3-30B-A3B")
    t = p.trainer
    assert p.fits and t.strategy is Strategy.ZERO3_OFFLOAD and t.num_processes == 4
    P = p.model.params
    assert t.memory_terms["terms"]["gradients"] == 0 and t.memory_gib_per_gpu < 22
    assert sum(t.memory_terms["host_terms"].values()) == pytest.approx(18 * P / 4 / 2**30, abs=0.01)
    # host RAM per node: 4 processes x (3 GiB runtime + the fp32-loaded weights' quarter + 18·P/4), + 10 %
    per_proc = 3 + 4 * P / 4 / 2**30 + 18 * P / 4 / 2**30
    assert step_host_gib(p)["trainer"] == pytest.approx(-(-4 * per_proc * 1.1 // 1), abs=1)


def test_one_gpu_no_fit_names_the_ddp_figure(basic_recipe, write_recipe):
    """7B LoRA colocated on one H100 with 0.7 of it for vLLM: nothing fits the 15.9 GiB left. ZeRO-3 used to be
    named with its layer and merge gathers (29.4 GiB), which one process never allocates; DDP's figure is named."""
    from ogrpo.planner.memory import trainer_estimate

    text = (basic_recipe.read_text().replace("Qwen2.5-1.5B-Instruct", "Qwen2.5-7B-Instruct")
            + "use_peft: true\nvllm_gpu_memory_utilization: 0.7\n")
    p = _plan(write_recipe(text), "1xH100")
    assert not p.fits and p.trainer.num_processes == 1
    reason = next(r for r in p.reasons if r.startswith("trainer:"))
    assert p.trainer.strategy is Strategy.DDP and "with DDP" in reason and "gather" not in reason
    assert reason.startswith(f"trainer: {p.trainer.memory_gib_per_gpu:.1f} GiB per GPU needed")
    # DDP's own estimate, as the plan's inputs give it
    b = p.batch
    from ogrpo.planner.lora import lora_spec

    ddp = trainer_estimate(p.model, num_processes=1, strategy="ddp", precision=p.precision,
                           micro_batch=b.per_device_train_batch_size, prompt_len=b.prompt_length,
                           completion_len=b.completion_length, gradient_checkpointing=p.trainer.gradient_checkpointing,
                           beta=0.0, lora=lora_spec({"use_peft": True}, p.precision),
                           fused_logprobs=bool(p.kernels.to_dict().get("linear_logprobs")),
                           grad_accumulation_steps=b.gradient_accumulation_steps)
    assert f"{ddp.total_gib:.1f} GiB per GPU needed" in reason


def test_many_trainer_nodes_on_one_server_node_is_a_note_with_numbers(basic_recipe):
    """TRL's client reaches one server, so the plan keeps one server node; with 999 trainer nodes it says so, with
    the rounds of the server's concurrent sequences one step's generation batch takes."""
    p = _plan(basic_recipe, "1000x8xA100-80G")
    assert p.vllm.nodes == [0] and len(p.trainer.nodes) == 999
    note = next(w for w in p.warnings if "one vLLM server node" in w)
    gbs = p.batch.generation_batch_size
    at_once = min(p.vllm.args.to_dict()["max_num_seqs"], p.vllm.memory_terms["max_concurrent_seqs"]) * p.vllm.data_parallel_size
    assert gbs == 8 * 999 * 8 and "999 trainer nodes (7992 GPUs)" in note
    assert f"generation batch of {gbs} completions is {-(-gbs // at_once)} round(s) of at most {at_once}" in note
    assert not any("one vLLM server node" in w for w in _plan(basic_recipe, "2x8xA100-80G").warnings)
    assert any("2 trainer nodes" in w for w in _plan(basic_recipe, "3x8xA100-80G").warnings)


def test_num_processes_one_on_3xa40_names_the_gpu_it_runs_on(basic_recipe, write_recipe, tmp_path):
    """num_processes 1 on 3xA40: the trainer runs on GPU 1, GPU 2 idle; the placement printed used to list [1, 2]."""
    from ogrpo.config import load_run_config
    from ogrpo.jobspec import build_jobspec

    path = write_recipe(basic_recipe.read_text() + "num_processes: 1\n", "n1.yaml")
    p = _plan(path, "3xA40")
    assert p.trainer.num_processes == 1 and p.trainer.gpus == [1]
    assert p.setting("placement") == "server GPU(s) [0], trainer GPU(s) [1]; GPU(s) [2] idle"
    assert any("GPU(s) [2]" in w and "trainer runs on node 0, GPU(s) [1]" in w for w in p.warnings)
    steps = {s.role: s for s in build_jobspec(p, load_run_config(path), tmp_path).steps}
    assert steps["trainer"].gpus == [1] and steps["server"].gpus == [0]


def _server_compile(p) -> tuple[bool, str]:
    setting = next(s for s in p.settings if s.name == "vllm.enforce_eager")
    assert p.vllm.args.enforce_eager is setting.value
    return setting.value, setting.reason


def test_the_cpu_server_compiles_where_the_run_repays_it(tiny_recipe):
    # tiny_recipe: 4 completions x 32 tokens a step
    short_eager, why = _server_compile(_plan(tiny_recipe, "2xcpu", max_steps=50))
    assert short_eager is True and "6,400 completion tokens" in why and "vllm_compile: on" in why
    long_eager, why = _server_compile(_plan(tiny_recipe, "2xcpu", max_steps=5000))
    assert long_eager is False and "640,000" in why
    # counted in epochs: the dataset decides how long, and a dataset is rarely a handful of prompts
    assert _server_compile(_plan(tiny_recipe, "2xcpu", max_steps=-1))[0] is False
    # num_iterations reuses each generation batch: a quarter of the tokens
    assert _server_compile(_plan(tiny_recipe, "2xcpu", max_steps=1000, num_iterations=4))[0] is True
    assert _server_compile(_plan(tiny_recipe, "2xcpu", max_steps=50, ogrpo={"vllm_compile": "on"}))[0] is False
    off, why = _server_compile(_plan(tiny_recipe, "2xcpu", max_steps=5000, ogrpo={"vllm_compile": "off"}))
    assert off is True and "ogrpo.vllm_compile: off" in why


def test_vllm_compile_overrides_the_profile_on_gpus(basic_recipe):
    assert _server_compile(_plan(basic_recipe, "3xA40", ogrpo={"profile": "conservative",
                                                               "vllm_compile": "on"}))[0] is False
    assert _server_compile(_plan(basic_recipe, "3xA40", ogrpo={"vllm_compile": "off"}))[0] is True
    with pytest.raises(ConfigError, match="vllm_compile"):
        _plan(basic_recipe, "3xA40", ogrpo={"vllm_compile": "fast"})
