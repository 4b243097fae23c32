"""Memory model per device and role, as named terms in GiB (pure arithmetic, no torch).

Trainer (per process/GPU), P parameters, N trainer processes:
- weights / gradients / optimizer: mixed precision keeps fp32 master weights and fp32 Adam moments, so a
  parameter costs 16 bytes in all: DDP holds 4 (fp32 weights) + 4 (fp32 grads) + 8 (Adam m, v) on every
  GPU; DeepSpeed holds 2 (half weights) + 2 (half grads) + 12 (fp32 master + m + v), with ZeRO-2 sharding
  grads and optimizer over N, ZeRO-3 also the weights. ZeRO-3 with optimizer offload keeps only the half
  weights' partition on the GPU: DeepSpeed 0.19.8's stage3.py allocates the optimizer's fp32 master weights,
  Adam moments, fp32 gradients *and* the gradient partition (`grad_partitions_flat_buffer`, in the half dtype)
  on `self.device`, the CPU when `offload_optimizer` is set: 12 + 4 + 2 bytes per trainable parameter over N,
  in host RAM (`Estimate.notes["host_terms"]`, what ogrpo/planner/host_memory.py counts). On a CPU device that
  host RAM is the device memory: the terms stay in the estimate.
- DDP buckets: with more than one process, torch DDP keeps flat all-reduce buckets as large as the gradients
  (+4 bytes per parameter; measured, docs/memory-calibration.md).
- gradients vs activations: without gradient accumulation (`grad_accumulation_steps` 1) gradients are freed
  after each step and rebuilt as backward frees the activations, so DDP and ZeRO-2 peak at the larger of the
  two (`grads_activations_overlap` subtracts the smaller); with accumulation both are held.
- activations: per token and layer a decoder keeps about 10·H + 3·I values for backward (norm inputs, q/k/v,
  attention output, o-proj input, residual: ≈10·H; gate, up, act(gate)·up: 3·I). With gradient
  checkpointing only each layer's input (H per token per layer) stays, plus one layer recomputed.
  Where the attention is not a fused kernel (PyTorch SDPA on CPU), each layer also keeps its B·heads·S²
  probabilities, and backward builds one layer's gradient of them.
- logits: TRL computes logits for completion tokens only (B·C·V): half-precision logits, an fp32
  log-softmax working copy and the logits' gradient; `use_liger_kernel` chunks them away, and O-GRPO's
  linear_logprobs kernel keeps one chunk (<= 2 x 192 MiB) whatever B·C.
- reference model (beta > 0): a copy of the weights in the policy's load dtype under DDP (fp32 master
  weights), in the half dtype under DeepSpeed (sharded under ZeRO-3). LoRA has none: the base with its
  adapters disabled is the reference.
- LoRA: the frozen base carries no gradient or optimizer state; under DeepSpeed the base and adapters are in
  the half dtype, ZeRO-3 shards the base too, and TRL gathers the whole model once per weight push to merge
  the adapters (a phase of its own: `zero3_lora_full_gather`).
- runtime: CUDA context + allocator slack, ~1 GiB per process (the interpreter on CPU); not a tensor, so not
  in what the calibration measures (`tensor_gib`).
- one process: ZeRO-3's partition is the whole parameter and DeepSpeed's gather returns it in place
  (partition_parameters.py `_no_gather_coalesced` when the partition world size is 1): no gather terms.

vLLM server (per GPU, tensor parallel size t): weights (half precision, /t), the profiled activation peak,
CUDA graphs, and the KV cache that fills the rest of `gpu_memory_utilization` x memory; the plan checks it
holds at least one max-length sequence and reports how many run at once. KV per token as vLLM lays it out:
K and V per KV head and layer, or MLA's latent (DeepSeek V2/V3: kv_lora_rank + qk_rope_head_dim per layer, on
every tensor-parallel rank); sliding-window layers reserve the window, not the sequence. On CPU the KV cache
is an explicit budget for the plan's max_num_seqs sequences (`kv_budget_bytes`), checked against the
host-memory share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ogrpo import dtypes
from ogrpo.kernels.linear_logprobs.sizing import peak_logits_bytes
from ogrpo.models import ModelFacts
from ogrpo.planner.lora import lora_spec

if TYPE_CHECKING:
    from ogrpo.planner.lora import LoraSpec

GiB = float(2**30)
# DeepSpeed terms measured only on CPU over gloo (docs/memory-calibration.md: zero2_full_gradients,
# zero3_reference_gather). DeepSpeed's NCCL path may hold its buffers differently, so GPU plans leave them out
# until a GPU calibration run (tests/test_memory_calibration.py's gpu-marked test, DDP only so far) confirms
# them. DDP's buckets are documented torch behaviour on every device and always count.
DEEPSPEED_CPU_TERMS_ON_GPU = False
ZERO3_MAX_LIVE_PARAMETERS = 1e9  # DeepSpeed's stage3_max_live_parameters default (the plan leaves it unset)
RUNTIME_GIB = 1.0  # CUDA context (~0.5 GiB) + caching-allocator fragmentation
CPU_RUNTIME_GIB = 0.5  # python + torch + gloo per CPU process
CUDA_GRAPHS_GIB = 0.5  # vLLM's captured graphs at the default capture sizes
VLLM_BATCHED_TOKENS = 8192  # vLLM's default max_num_batched_tokens for its activation profile run
KV_BLOCK_TOKENS = 128  # vLLM's CPU block size (GPU blocks are 16 tokens; 128 rounds up for both)
GPU_KV_BLOCK_TOKENS = 16  # vLLM's default block size on CUDA


@dataclass(frozen=True)
class DeviceTerms:
    """The terms that differ per device kind. The numbers live here, with the model; which set a plan uses is
    the device's rules' decision (`DeviceRules.memory_terms`, ogrpo/planner/device_rules.py)."""

    runtime_gib: float  # per process, beside the tensors
    kv_block_tokens: int  # vLLM's KV block size
    cuda_graphs: bool  # whether vLLM captures CUDA graphs (unless enforce_eager)
    # DeepSpeed's zero2_full_gradients / zero3_reference_gather terms, measured on CPU over gloo
    measured_deepspeed_terms: bool
    # whether the trainer's attention keeps each layer's B·heads·S² probabilities for backward: PyTorch's CPU
    # SDPA takes its math path under the padding mask TRL passes; flash-attn 2 and SDPA's CUDA kernels do not
    attention_scores: bool = False
    # whether the host RAM that ZeRO-Offload moves state to is this device's own memory (CPU processes)
    offload_is_local: bool = False


GPU_TERMS = DeviceTerms(runtime_gib=RUNTIME_GIB, kv_block_tokens=GPU_KV_BLOCK_TOKENS, cuda_graphs=True,
                        measured_deepspeed_terms=DEEPSPEED_CPU_TERMS_ON_GPU)
CPU_TERMS = DeviceTerms(runtime_gib=CPU_RUNTIME_GIB, kv_block_tokens=KV_BLOCK_TOKENS, cuda_graphs=False,
                        measured_deepspeed_terms=True, attention_scores=True, offload_is_local=True)


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
                "terms": {k: _round_gib(v) for k, v in self.terms.items()}, **self.notes}


def _round_gib(v: float) -> float:
    """1 MiB steps for the GiB-sized terms of real models; 1 KiB for the small ones of tiny models, whose
    calibration against measurement needs them."""
    return round(v, 3) if abs(v) >= 0.05 else round(v, 6)


def tensor_gib(terms: dict) -> float:
    """The estimate without its runtime term: the live tensor bytes that torch.cuda.max_memory_allocated (GPU)
    or the profiler's live-tensor peak (CPU, ogrpo/profile/profiler.py) measure; neither sees the CUDA context,
    the caching allocator's slack or the interpreter."""
    return sum(v for k, v in terms.items() if k != "runtime")


# What ZeRO-3's optimizer offload keeps on the host per trainable parameter, beyond the optimizer's 12 bytes:
# the fp32 gradient the CPU optimizer steps on (stage3.py's subgroup_gradient_buffer, fp32_partitioned_groups_flat
# .grad), besides the gradient partition in the half (accumulation) dtype.
OFFLOAD_FP32_GRAD_BYTES = 4.0


def state_bytes_per_param(strategy: str, precision: str) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter before sharding."""
    if strategy == "ddp":
        # fp32 master weights (AMP autocasts the forward), fp32 grads, Adam m and v in fp32.
        return 4.0, 4.0, 8.0
    # DeepSpeed: half weights and grads (fp32 on CPU, not used), fp32 master + m + v in the optimizer.
    half = float(dtypes.nbytes(precision))
    return half, half, 12.0


def trainer_estimate(model: ModelFacts, *, num_processes: int, strategy: str, precision: str, micro_batch: int,
                     prompt_len: int, completion_len: int, gradient_checkpointing: bool, beta: float,
                     liger: bool = False, lora: LoraSpec | bool | None = None, budget_gib: float = 0.0,
                     device: DeviceTerms = GPU_TERMS, fused_logprobs: bool = False,
                     grad_accumulation_steps: int | None = None) -> Estimate:
    """`device`: the device kind's terms (`DeviceRules.memory_terms`). `lora`: the run's LoRA (`planner.lora.lora_spec`); True means TRL's defaults on a half-precision base.
    `grad_accumulation_steps`: 1 lets the estimate use that no gradient is held while the forward builds its
    activations (the trainer frees them after each optimizer step); None or more than 1 keeps them side by
    side (accumulated gradients live through the next micro-batch's forward)."""
    n = max(1, num_processes)
    P = model.params
    w_b, g_b, o_b = state_bytes_per_param(strategy, precision)
    act_b = dtypes.nbytes(precision)
    if lora is True:
        lora = lora_spec({"use_peft": True}, precision)
    if lora and strategy == "ddp":
        w_b = float(dtypes.nbytes(lora.base_dtype))
        weights, grads, optim = lora_state_bytes(model, lora)
    elif lora:
        # DeepSpeed casts the whole module (frozen base and adapters) to its half dtype and keeps fp32 master
        # weights and Adam moments for the trainable parameters only: the frozen base costs its half weights,
        # sharded by ZeRO-3 like any parameter (ZeRO-2 leaves it whole); the adapters cost what a full fine-tune
        # parameter costs under the same stage.
        trainable = sum(lora_params(model, lora))
        weights = P * w_b / (n if strategy.startswith("zero3") else 1) + trainable * w_b / (
            n if strategy.startswith("zero3") else 1)
        grads = trainable * g_b / n
        optim = trainable * o_b / n
    else:
        trainable = P
        shard_w = n if strategy.startswith("zero3") else 1
        shard_g = n if strategy in ("zero2", "zero3", "zero3_offload") else 1
        shard_o = n if strategy != "ddp" else 1
        weights = P * w_b / shard_w
        grads = P * g_b / shard_g
        optim = P * o_b / shard_o
    host: dict[str, float] = {}
    if strategy == "zero3_offload":
        # the optimizer and both gradient copies live in host RAM (see the module's docstring)
        host = {"optimizer": optim, "gradients": grads + trainable * OFFLOAD_FP32_GRAD_BYTES / n}
        if device.offload_is_local:
            optim, grads, host = host["optimizer"], host["gradients"], {}
        else:
            optim = grads = 0.0
    # A MoE token's MLP activations are its top-k experts' (+ shared): the active width, not the dense one.
    H, L, I, V = model.hidden_size, model.num_layers, model.active_intermediate_size, model.vocab_size
    tokens = micro_batch * (prompt_len + completion_len)
    per_layer = 10 * H + 3 * I
    if gradient_checkpointing:
        acts = tokens * (L * H + per_layer) * act_b
    else:
        acts = tokens * L * per_layer * act_b
    if device.attention_scores:
        S = prompt_len + completion_len
        scores = micro_batch * model.num_heads * S * S * act_b
        # the kept probabilities of every layer (of the one recomputed, with checkpointing) and the gradient
        # backward builds for one layer at a time
        acts += ((1 if gradient_checkpointing else L) + 1) * scores
    if liger:
        logits = 0.0
    elif fused_logprobs:  # ogrpo.kernels.linear_logprobs: one chunk of fp32 logits at a time, never B·C·V

        logits = float(peak_logits_bytes(micro_batch * completion_len, V))
    else:
        logits = micro_batch * completion_len * V * (2 * act_b + 4)
    ref = 0.0
    if beta and beta > 0 and not lora:
        # TRL loads the reference model with the policy's model_init_kwargs: fp32 under DDP (the plan's master
        # weights, also with bf16/fp16 autocast); DeepSpeed's engine casts it to the half dtype it runs in.
        ref_b = 4.0 if (precision == "fp32" or strategy == "ddp") else 2.0
        ref = P * ref_b / (n if strategy.startswith("zero3") else 1)
    terms = {
        "weights": weights / GiB,
        "gradients": grads / GiB,
        "optimizer": optim / GiB,
        "activations": acts / GiB,
        "logits": logits / GiB,
        "reference_model": ref / GiB,
    }
    deepspeed_cpu_terms = device.measured_deepspeed_terms
    if strategy == "ddp" and n > 1:
        # torch DDP as accelerate builds it (gradient_as_bucket_view=False) keeps flat all-reduce buckets the
        # size of all trainable gradients beside param.grad, for the whole run.
        terms["ddp_buckets"] = grads / GiB
    backward_grads = grads
    if strategy == "zero2" and deepspeed_cpu_terms:
        # Backward computes every trainable parameter's full gradient before ZeRO-2 reduces it into this
        # process's partition; measured on CPU (gloo), the full set is held at the backward peak beside the
        # partition (LoRA: the adapters' only).
        full = (sum(lora_params(model, lora)) if lora else P) * g_b
        terms["zero2_full_gradients"] = full / GiB
        backward_grads += full
    if grad_accumulation_steps == 1 and strategy in ("ddp", "zero2"):
        # Gradients are None when the forward starts (zero_grad(set_to_none) after each step) and appear as
        # backward frees the activations: the step peaks at the larger of the two, not at their sum. ZeRO-3
        # keeps its gradient partition allocated, and accumulation keeps gradients through the next forward.
        terms["grads_activations_overlap"] = -min(backward_grads, acts + logits) / GiB
    if strategy.startswith("zero3") and n > 1:
        # ZeRO-3 gathers one layer (or the embedding) at a time, with one more prefetched. (One process gathers
        # nothing: its partition is the whole parameter, used in place.)
        layer_params = (P - V * H * (1 if model.tie_word_embeddings else 2)) / max(1, L)
        terms["zero3_gather"] = 2 * max(layer_params, V * H) * w_b / GiB
        if lora:
            # TRL cannot merge adapters into a sharded base: before each weight push to vLLM (and around HF
            # generation under ZeRO-3) it gathers every parameter at once, so each process holds the whole half
            # model beside its partitions in that phase. Its own phase (after the optimizer step, activations
            # freed): only what exceeds the loss step's activations, logits and layer gathers counts.
            whole = (P + sum(lora_params(model, lora))) * w_b
            terms["zero3_lora_full_gather"] = max(
                0.0, whole - acts - logits - terms["zero3_gather"] * GiB) / GiB
        if ref and deepspeed_cpu_terms:
            # The reference model's no-grad scoring pass has no backward to release what it gathers: DeepSpeed
            # keeps gathered parameters live up to stage3_max_live_parameters (the whole model below 1e9), and
            # measured on CPU that pass holds two full copies (the reference's and, it seems, the policy's
            # from the rollout). It is its own phase: only what exceeds the loss's activations counts.
            ref_b = ref * n / P
            scoring = 2 * min(P, ZERO3_MAX_LIVE_PARAMETERS) * ref_b
            terms["zero3_reference_gather"] = max(0.0, scoring - acts - logits) / GiB
    terms["runtime"] = device.runtime_gib
    notes = {"host_terms": {k: _round_gib(v / GiB) for k, v in host.items()}} if host else {}
    return Estimate("trainer", terms, budget_gib, notes)


# LoRA under DDP: the base weights cost P x the dtype the trainer loads them in and carry no gradient or
# optimizer state (under DeepSpeed, trainer_estimate: the engine's half dtype, sharded by ZeRO-3). Adapters: A
# (r x in) and B (out x r) per targeted linear layer, r·(in + out) parameters (+ out for DoRA's magnitude
# vector), kept in fp32 by peft (autocast_adapter_dtype), so 4 (weights) + 4 (grads) + 8 (Adam m, v) bytes
# each. `modules_to_save` keeps a trainable copy of each named module in the base dtype b: b + b + 2b bytes per
# parameter.


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
    b = float(dtypes.nbytes(lora.base_dtype))
    adapters, saved = lora_params(model, lora)
    return model.params * b + adapters * 4.0 + saved * b, adapters * 4.0 + saved * b, adapters * 8.0 + saved * 2 * b


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
                    enforce_eager: bool, device: DeviceTerms = GPU_TERMS,
                    kv_cache_bytes: int | None = None) -> Estimate:
    """`device`: the device kind's terms (`DeviceRules.memory_terms`). `kv_cache_bytes`: an explicit KV budget (vLLM's kv_cache_memory_bytes) instead of the rest of the
    share; the estimate then fits when weights + overhead + that KV stay within the share."""
    t = max(1, tensor_parallel_size)
    budget = memory_gib * gpu_memory_utilization
    weights = model.params * dtype_bytes / t / GiB
    H, I = model.hidden_size, model.active_intermediate_size  # MoE: top-k experts per token
    # Profile run: a full batch of max_num_batched_tokens through one layer's widest tensors, plus fp32
    # sampler logits for every running sequence.
    acts = (VLLM_BATCHED_TOKENS * (4 * H + 2 * I) * dtype_bytes / t + max_num_seqs * model.vocab_size * 4) / GiB
    graphs = CUDA_GRAPHS_GIB if (device.cuda_graphs and not enforce_eager) else 0.0
    runtime = device.runtime_gib
    fixed = weights + acts + graphs + runtime
    kv_per_token = kv_bytes_per_token_per_gpu(model, t, dtype_bytes)
    kv_gib = kv_cache_bytes / GiB if kv_cache_bytes is not None else max(0.0, budget - fixed)
    kv_tokens = int(kv_gib * GiB // kv_per_token) if kv_per_token else 0
    # vLLM hands out whole blocks: a sequence of max_model_len tokens takes ceil(len / block) of them, so the
    # concurrency it reports ("Maximum concurrency for N tokens per request") is blocks / blocks-per-sequence.
    # Sliding-window layers need fewer (kv_window_tokens): the blocks per sequence average over the layers.
    block = device.kv_block_tokens
    full, sliding = kv_layer_split(model)
    window_len = kv_window_tokens(model, max_model_len)
    blocks_per_seq = (full * -(-max(1, max_model_len) // block)
                      + sliding * (-(-window_len // block) + 1)) / max(1, full + sliding)
    concurrency = (kv_tokens // block) / blocks_per_seq
    needed_one = (full * max_model_len + sliding * window_len) / max(1, full + sliding) * kv_per_token / GiB
    terms = {"weights": weights, "activations": acts, "cuda_graphs": graphs, "runtime": runtime,
             "kv_cache": max(kv_gib, needed_one)}
    notes = {"kv_cache_tokens": kv_tokens, "max_concurrent_seqs": int(concurrency),
             "kv_bytes_per_token": int(kv_per_token), "gpu_memory_utilization": gpu_memory_utilization}
    if kv_cache_bytes is not None:
        notes["kv_cache_memory_bytes"] = int(kv_cache_bytes)
    return Estimate("server", terms, budget, notes)


def kv_bytes_per_token_per_gpu(model: ModelFacts, tp: int, dtype_bytes: int) -> float:
    """Bytes one token costs vLLM's KV cache on one GPU over every layer, as if each attended fully."""
    if model.is_mla:
        # MLA caches one latent (kv_lora_rank) and one rope key (qk_rope_head_dim) per token and layer, not K and V
        # per head, and every tensor-parallel rank holds all of it (the latent is not split by heads).
        return model.num_layers * (model.kv_lora_rank + model.qk_rope_head_dim) * dtype_bytes
    # KV heads split across tensor-parallel ranks; with more ranks than KV heads vLLM replicates them.
    heads = max(1.0, model.num_kv_heads / tp)
    return 2 * model.num_layers * heads * model.head_dim * dtype_bytes


def kv_layer_split(model: ModelFacts) -> tuple[int, int]:
    """(full-attention layers, sliding-window layers)."""
    sliding = min(model.sliding_layers, model.num_layers) if model.sliding_window else 0
    return model.num_layers - sliding, sliding


def kv_window_tokens(model: ModelFacts, max_model_len: int) -> int:
    """Tokens vLLM reserves per sequence in a sliding-window layer: the window's last tokens plus one scheduled
    chunk of prefill (vLLM's SlidingWindowSpec.max_memory_usage_bytes), never more than the sequence. At GRPO's
    usual lengths this is the whole sequence; only windows much shorter than max_model_len save memory."""
    if not model.sliding_window:
        return max_model_len
    return min(model.sliding_window - 1 + VLLM_BATCHED_TOKENS, max_model_len)
