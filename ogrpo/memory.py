"""Memory model per device and role, as named terms in GiB (pure arithmetic, no torch).

Trainer (per process/GPU), P parameters, N trainer processes:
- weights / gradients / optimizer: mixed precision keeps fp32 master weights and fp32 Adam moments, so a
  parameter costs 16 bytes in all: DDP holds 4 (fp32 weights) + 4 (fp32 grads) + 8 (Adam m, v) on every
  GPU; DeepSpeed holds 2 (half weights) + 2 (half grads) + 12 (fp32 master + m + v), with ZeRO-2 sharding
  grads and optimizer over N, ZeRO-3 also the weights, and offload moving the optimizer to host RAM.
- activations: per token and layer a decoder keeps about 10·H + 3·I values for backward (norm inputs, q/k/v,
  attention output, o-proj input, residual: ≈10·H; gate, up, act(gate)·up: 3·I). With gradient
  checkpointing only each layer's input (H per token per layer) stays, plus one layer recomputed.
- logits: TRL computes logits for completion tokens only (B·C·V): half-precision logits, an fp32
  log-softmax working copy and the logits' gradient; `use_liger_kernel` chunks them away, and O-GRPO's
  linear_logprobs kernel keeps one chunk (<= 2 x 256 MiB) whatever B·C.
- reference model (beta > 0): a half-precision copy of the weights (sharded under ZeRO-3).
- runtime: CUDA context + allocator slack, ~1 GiB per process.

vLLM server (per GPU, tensor parallel size t): weights (half precision, /t), the profiled activation peak,
CUDA graphs, and the KV cache that fills the rest of `gpu_memory_utilization` x memory; the plan checks it
holds at least one max-length sequence and reports how many run at once. On CPU the KV cache is an explicit
budget for the plan's max_num_seqs sequences (`kv_budget_bytes`), checked against the host-memory share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ogrpo.models import ModelFacts

if TYPE_CHECKING:
    from ogrpo.train.peft_config import LoraSpec

GiB = float(2**30)
RUNTIME_GIB = 1.0  # CUDA context (~0.5 GiB) + caching-allocator fragmentation
CPU_RUNTIME_GIB = 0.5  # python + torch + gloo per CPU process
CUDA_GRAPHS_GIB = 0.5  # vLLM's captured graphs at the default capture sizes
VLLM_BATCHED_TOKENS = 8192  # vLLM's default max_num_batched_tokens for its activation profile run


@dataclass
class Estimate:
    role: str
    terms: dict[str, float]  # GiB per device
    budget_gib: float  # what this role may use per device
    notes: dict = field(default_factory=dict)

    @property
    def total_gib(self) -> float:
        return sum(self.terms.values())

    @property
    def fits(self) -> bool:
        return self.total_gib <= self.budget_gib + 1e-9

    def to_dict(self) -> dict:
        return {"total_gib": round(self.total_gib, 2), "budget_gib": round(self.budget_gib, 2),
                "terms": {k: round(v, 3) for k, v in self.terms.items()}, **self.notes}


def state_bytes_per_param(strategy: str, precision: str) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter before sharding."""
    if strategy == "ddp":
        # fp32 master weights (AMP autocasts the forward), fp32 grads, Adam m and v in fp32.
        return 4.0, 4.0, 8.0
    # DeepSpeed: half weights and grads (fp32 on CPU, not used), fp32 master + m + v in the optimizer.
    half = 4.0 if precision == "fp32" else 2.0
    return half, half, 12.0


def trainer_estimate(model: ModelFacts, *, num_processes: int, strategy: str, precision: str, micro_batch: int,
                     prompt_len: int, completion_len: int, gradient_checkpointing: bool, beta: float,
                     liger: bool = False, lora: LoraSpec | bool | None = None, budget_gib: float = 0.0,
                     is_cpu: bool = False, fused_logprobs: bool = False) -> Estimate:
    """`lora`: the run's LoRA (`peft_config.lora_spec`); True means TRL's defaults on a half-precision base."""
    n = max(1, num_processes)
    P = model.params
    w_b, g_b, o_b = state_bytes_per_param(strategy, precision)
    act_b = 4 if precision == "fp32" else 2
    if lora:
        if lora is True:
            from ogrpo.train.peft_config import lora_spec

            lora = lora_spec({"use_peft": True}, precision)
        w_b = DTYPE_BYTES[lora.base_dtype]
        weights, grads, optim = lora_state_bytes(model, lora)
    else:
        shard_w = n if strategy.startswith("zero3") else 1
        shard_g = n if strategy in ("zero2", "zero3", "zero3_offload") else 1
        shard_o = n if strategy != "ddp" else 1
        weights = P * w_b / shard_w
        grads = P * g_b / shard_g
        optim = 0.0 if strategy == "zero3_offload" else P * o_b / shard_o
    # A MoE token's MLP activations are its top-k experts' (+ shared): the active width, not the dense one.
    H, L, I, V = model.hidden_size, model.num_layers, model.active_intermediate_size, model.vocab_size
    tokens = micro_batch * (prompt_len + completion_len)
    per_layer = 10 * H + 3 * I
    if gradient_checkpointing:
        acts = tokens * (L * H + per_layer) * act_b
    else:
        acts = tokens * L * per_layer * act_b
    if liger:
        logits = 0.0
    elif fused_logprobs:  # ogrpo.kernels.linear_logprobs: one chunk of fp32 logits at a time, never B·C·V
        from ogrpo.kernels.linear_logprobs.sizing import peak_logits_bytes

        logits = float(peak_logits_bytes(micro_batch * completion_len, V))
    else:
        logits = micro_batch * completion_len * V * (2 * act_b + 4)
    ref = 0.0
    if beta and beta > 0 and not lora:
        ref = P * (4.0 if precision == "fp32" else 2.0) / (n if strategy.startswith("zero3") else 1)
    terms = {
        "weights": weights / GiB,
        "gradients": grads / GiB,
        "optimizer": optim / GiB,
        "activations": acts / GiB,
        "logits": logits / GiB,
        "reference_model": ref / GiB,
    }
    if strategy.startswith("zero3") and not lora:
        # ZeRO-3 gathers one layer (or the embedding) at a time, with one more prefetched.
        layer_params = (P - V * H * (1 if model.tie_word_embeddings else 2)) / max(1, L)
        terms["zero3_gather"] = 2 * max(layer_params, V * H) * w_b / GiB
    terms["runtime"] = CPU_RUNTIME_GIB if is_cpu else RUNTIME_GIB
    notes = {"offloaded_optimizer_gib_per_process": round(P * o_b / n / GiB, 2)} if strategy == "zero3_offload" \
        else {}
    return Estimate("trainer", terms, budget_gib, notes)


DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}

# LoRA (DDP; a frozen base is never sharded by the plan). The base weights cost P x the dtype the trainer loads
# them in and carry no gradient or optimizer state. Adapters: A (r x in) and B (out x r) per targeted linear
# layer, r·(in + out) parameters (+ out for DoRA's magnitude vector), kept in fp32 by peft
# (autocast_adapter_dtype), so 4 (weights) + 4 (grads) + 8 (Adam m, v) bytes each. `modules_to_save` keeps a
# trainable copy of each named module in the base dtype b: b + b + 2b bytes per parameter.


def lora_linear_shapes(model: ModelFacts) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of one decoder layer, by the module names peft matches."""
    H, I = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H), "qkv_proj": (H, q + 2 * kv),
            "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H), "gate_up_proj": (H, 2 * I)}


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
# "all-linear": every nn.Linear of the decoder layers. Phi-3 fuses q/k/v and gate/up (qkv_proj, gate_up_proj).
_ALL_LINEAR = {"phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
_ALL_LINEAR_DEFAULT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_params(model: ModelFacts, lora) -> tuple[int, int]:
    """(adapter parameters, modules_to_save parameters) of a LoRA on this model."""
    targets = lora.targets(model.model_type)
    adapters = 0
    if targets == "all-linear" and model.is_moe:
        # peft 0.21 turns all-linear on a fused-expert MoE (transformers 5) into attention projections plus
        # parameter LoRA on each MoE layer's router and experts; as measured on Qwen3-MoE: router r·(H + E),
        # gate_up (E, 2I, H) gets rank 2·r·E, down (E, H, I) rank r·E; dense MLP layers get none.
        targets = ("q_proj", "k_proj", "v_proj", "o_proj")
        H, E, Ie, r = model.hidden_size, model.num_experts, model.moe_intermediate_size, lora.r
        adapters += model.num_moe_layers * (r * (H + E) + 2 * r * E * (H + 2 * Ie) + r * E * (Ie + H))
    elif targets == "all-linear":
        targets = _ALL_LINEAR.get(model.model_type, _ALL_LINEAR_DEFAULT)
    shapes = lora_linear_shapes(model)
    # MoE layers keep their experts in fused 3-D parameters, not nn.Linear: a named MLP module exists only in
    # the dense layers.
    dense_layers = model.num_layers - model.num_moe_layers
    for name in set(targets):
        if name not in shapes:
            continue  # a module this layout does not have; peft matches nothing for it
        fan_in, fan_out = shapes[name]
        layers = model.num_layers if name in _ATTENTION else dense_layers
        adapters += layers * (lora.r * (fan_in + fan_out) + (fan_out if lora.use_dora else 0))
    embed = model.vocab_size * model.hidden_size
    saved = sum(embed for m in lora.modules_to_save if m in ("lm_head", "embed_tokens"))
    return adapters, saved


def lora_state_bytes(model: ModelFacts, lora) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of a LoRA run, base included."""
    b = DTYPE_BYTES[lora.base_dtype]
    adapters, saved = lora_params(model, lora)
    return model.params * b + adapters * 4.0 + saved * b, adapters * 4.0 + saved * b, adapters * 8.0 + saved * 2 * b


KV_BLOCK_TOKENS = 128  # vLLM's CPU block size (GPU blocks are 16 tokens; 128 rounds up for both)


def kv_budget_bytes(per_token_bytes: float, seqs: int, max_model_len: int) -> int:
    """KV bytes that hold `seqs` sequences of `max_model_len` tokens at once, each rounded up to whole blocks
    plus a spare block.

    What CPU plans and `ogrpo bench rollout` give vLLM (`kv_cache_memory_bytes`) instead of a memory share:
    vLLM's CPU worker takes the share of the NUMA node's memory and subtracts the process's whole RSS
    (compiler included), so a share that works on one machine fails on a smaller node or a cold compile cache."""
    blocks = -(-max_model_len // KV_BLOCK_TOKENS) + 1
    return int(seqs * blocks * KV_BLOCK_TOKENS * per_token_bytes)


def server_estimate(model: ModelFacts, *, tensor_parallel_size: int, dtype_bytes: int, memory_gib: float,
                    gpu_memory_utilization: float, max_model_len: int, max_num_seqs: int,
                    enforce_eager: bool, is_cpu: bool = False, kv_cache_bytes: int | None = None) -> Estimate:
    """`kv_cache_bytes`: an explicit KV budget (vLLM's kv_cache_memory_bytes) instead of the rest of the
    share; the estimate then fits when weights + overhead + that KV stay within the share."""
    t = max(1, tensor_parallel_size)
    budget = memory_gib * gpu_memory_utilization
    weights = model.params * dtype_bytes / t / GiB
    H, I = model.hidden_size, model.active_intermediate_size  # MoE: top-k experts per token
    # Profile run: a full batch of max_num_batched_tokens through one layer's widest tensors, plus fp32
    # sampler logits for every running sequence.
    acts = (VLLM_BATCHED_TOKENS * (4 * H + 2 * I) * dtype_bytes / t + max_num_seqs * model.vocab_size * 4) / GiB
    graphs = 0.0 if (enforce_eager or is_cpu) else CUDA_GRAPHS_GIB
    runtime = CPU_RUNTIME_GIB if is_cpu else RUNTIME_GIB
    fixed = weights + acts + graphs + runtime
    kv_per_token = kv_bytes_per_token_per_gpu(model, t, dtype_bytes)
    kv_gib = kv_cache_bytes / GiB if kv_cache_bytes is not None else max(0.0, budget - fixed)
    kv_tokens = int(kv_gib * GiB // kv_per_token) if kv_per_token else 0
    concurrent = kv_tokens // max(1, max_model_len)
    needed_one = max_model_len * kv_per_token / GiB
    terms = {"weights": weights, "activations": acts, "cuda_graphs": graphs, "runtime": runtime,
             "kv_cache": max(kv_gib, needed_one)}
    notes = {"kv_cache_tokens": kv_tokens, "max_concurrent_seqs": int(concurrent),
             "kv_bytes_per_token": int(kv_per_token), "gpu_memory_utilization": gpu_memory_utilization}
    if kv_cache_bytes is not None:
        notes["kv_cache_memory_bytes"] = int(kv_cache_bytes)
    return Estimate("server", terms, budget, notes)


def kv_bytes_per_token_per_gpu(model: ModelFacts, tp: int, dtype_bytes: int) -> float:
    # KV heads split across tensor-parallel ranks; with more ranks than KV heads vLLM replicates them.
    heads = max(1.0, model.num_kv_heads / tp)
    return 2 * model.num_layers * heads * model.head_dim * dtype_bytes
