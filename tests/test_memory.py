"""The memory model, with the expected numbers worked out by hand (GiB = 2^30 bytes)."""

from __future__ import annotations

import pytest

from ogrpo.planner.memory import CPU_TERMS, server_estimate, trainer_estimate
from ogrpo.models import resolve_model

GiB = 2**30
QWEN15 = resolve_model("Qwen/Qwen2.5-1.5B-Instruct")  # P = 1,543,714,304; H 1536, L 28, I 8960, V 151936
QWEN7 = resolve_model("Qwen/Qwen2.5-7B-Instruct")  # P = 7,615,616,512


SCORES_BF16 = 8 * 12 * 1536 ** 2 * 2  # B x heads x S^2 x 2 B: one layer's attention probabilities (Qwen 1.5B)


def _trainer(model=QWEN15, **kw):
    args = dict(num_processes=2, strategy="ddp", precision="bf16", micro_batch=8, prompt_len=512,
                completion_len=1024, gradient_checkpointing=True, beta=0.0, budget_gib=40.5)
    args.update(kw)
    return trainer_estimate(model, **args)


def test_ddp_terms_qwen_1_5b():
    e = _trainer()
    P = 1_543_714_304
    # DDP keeps fp32 master weights (4 B), fp32 grads (4 B) and Adam m+v (8 B) per parameter on every GPU.
    assert e.terms["weights"] == pytest.approx(P * 4 / GiB)  # 5.75 GiB
    assert e.terms["gradients"] == pytest.approx(P * 4 / GiB)  # 5.75 GiB
    assert e.terms["optimizer"] == pytest.approx(P * 8 / GiB)  # 11.50 GiB
    # Activations with checkpointing: 8 x (512+1024) = 12288 tokens; per token L·H (layer inputs: 28·1536 =
    # 43008) + one recomputed layer (10·1536 + 3·8960 = 42240) = 85248 values of 2 bytes -> 1.95 GiB.
    assert e.terms["activations"] == pytest.approx(12288 * 85248 * 2 / GiB)
    assert e.terms["activations"] == pytest.approx(1.951, abs=1e-3)
    # Logits: 8 x 1024 completion tokens x 151936 vocab x (2 bf16 + 4 fp32 log-softmax + 2 grad) = 9.27 GiB.
    assert e.terms["logits"] == pytest.approx(8 * 1024 * 151936 * 8 / GiB)
    assert e.terms["logits"] == pytest.approx(9.273, abs=1e-3)
    assert e.terms["reference_model"] == 0.0  # beta 0 (TRL 1.16's default): no reference model
    # Two processes: torch DDP's flat all-reduce buckets hold the fp32 gradients once more.
    assert e.terms["ddp_buckets"] == pytest.approx(P * 4 / GiB)  # 5.75 GiB
    assert e.terms["runtime"] == 1.0
    # 5.75 + 5.75 + 11.50 + 1.95 + 9.27 + 5.75 + 1.0 = 40.98 GiB: just over an A40's 40.5.
    assert e.total_gib == pytest.approx(40.977, abs=1e-2)
    assert not e.fits


def test_terms_measured_on_cpu_and_which_count_on_gpu():
    P = 1_543_714_304
    acts = 12288 * 85248 * 2  # as in test_ddp_terms_qwen_1_5b
    # DDP's buckets are torch's, on every device, but only with something to all-reduce.
    assert "ddp_buckets" not in _trainer(num_processes=1).terms
    # ZeRO-2's full gradients (2 B/param at the backward peak) and ZeRO-3's reference gather were measured over
    # gloo only: CPU plans count them, GPU plans not yet.
    z2 = dict(strategy="zero2", num_processes=4)
    assert "zero2_full_gradients" not in _trainer(**z2).terms
    assert _trainer(**z2, device=CPU_TERMS).terms["zero2_full_gradients"] == pytest.approx(P * 2 / GiB)
    z3 = dict(strategy="zero3", num_processes=4, beta=0.04, liger=True)
    assert "zero3_reference_gather" not in _trainer(**z3).terms
    # The reference pass keeps two bf16 copies gathered, each capped at DeepSpeed's stage3_max_live_parameters
    # (1e9 < P): 2 x 1e9 x 2 B; what exceeds the loss's activations (liger: no logits) counts.
    # (on CPU the loss's activations also hold attention probabilities: the recomputed layer's and one gradient)
    cpu_acts = acts + 2 * SCORES_BF16
    assert _trainer(**z3, device=CPU_TERMS).terms["zero3_reference_gather"] == pytest.approx(
        (2 * 1e9 * 2 - cpu_acts) / GiB)


def test_gradients_and_activations_overlap_only_without_accumulation():
    P = 1_543_714_304
    acts, logits = 12288 * 85248 * 2, 8 * 1024 * 151936 * 8
    assert "grads_activations_overlap" not in _trainer(grad_accumulation_steps=2).terms
    assert "grads_activations_overlap" not in _trainer().terms  # unknown accumulation: held together
    # ga 1: the step peaks at the larger of activations + logits (11.2 GiB) and gradients (4 B/param, 5.75 GiB).
    assert acts + logits > P * 4
    one = _trainer(grad_accumulation_steps=1)
    assert one.terms["grads_activations_overlap"] == pytest.approx(-P * 4 / GiB)
    assert one.total_gib == pytest.approx(_trainer().total_gib - P * 4 / GiB)
    # ZeRO-3 keeps its gradient partition allocated through the forward.
    assert "grads_activations_overlap" not in _trainer(strategy="zero3", grad_accumulation_steps=1).terms


def test_without_checkpointing_activations_scale_with_layers():
    e = _trainer(gradient_checkpointing=False)
    # Every layer keeps its 42240 values per token: 12288 x 28 x 42240 x 2 B = 27.1 GiB.
    assert e.terms["activations"] == pytest.approx(12288 * 28 * 42240 * 2 / GiB)
    assert not e.fits


def test_zero_stages_shard_what_they_should():
    P = 1_543_714_304
    z2 = _trainer(strategy="zero2", num_processes=4)
    # ZeRO-2: half weights whole (2 B), half grads and fp32 optimizer (master + m + v = 12 B) over 4.
    assert z2.terms["weights"] == pytest.approx(2 * P / GiB)  # 2.88
    assert z2.terms["gradients"] == pytest.approx(2 * P / 4 / GiB)  # 0.72
    assert z2.terms["optimizer"] == pytest.approx(12 * P / 4 / GiB)  # 4.31
    z3 = _trainer(strategy="zero3", num_processes=4)
    assert z3.terms["weights"] == pytest.approx(2 * P / 4 / GiB)  # 0.72
    # ZeRO-3 gathers the largest unit twice (current + prefetch): the 151936 x 1536 embedding, 2 B each.
    assert z3.terms["zero3_gather"] == pytest.approx(2 * 151936 * 1536 * 2 / GiB)
    off = _trainer(strategy="zero3_offload", num_processes=4)
    assert off.terms["optimizer"] == 0.0
    assert off.notes["host_terms"]["optimizer"] == pytest.approx(12 * P / 4 / GiB, abs=0.01)
    assert _trainer().total_gib > z2.total_gib > z3.total_gib > off.total_gib


def test_reference_model_when_beta_positive():
    e = _trainer(beta=0.04)
    # DDP: TRL loads the reference with the policy's model_init_kwargs, fp32 master weights under bf16 autocast:
    # 4 B x 1.54e9 = 5.75 GiB. DeepSpeed casts it to bf16: 2 B, sharded over 4 under ZeRO-3.
    assert e.terms["reference_model"] == pytest.approx(4 * 1_543_714_304 / GiB)
    z2 = _trainer(beta=0.04, strategy="zero2", num_processes=4)
    assert z2.terms["reference_model"] == pytest.approx(2 * 1_543_714_304 / GiB)
    z3 = _trainer(beta=0.04, strategy="zero3", num_processes=4)
    assert z3.terms["reference_model"] == pytest.approx(2 * 1_543_714_304 / 4 / GiB)


def test_liger_and_lora():
    assert _trainer(liger=True).terms["logits"] == 0.0
    lora = _trainer(lora=True)
    P = 1_543_714_304
    # TRL's default LoRA (r 16 on q_proj, v_proj): per layer 16·(1536+1536) + 16·(1536+256) = 77,824; x 28 layers
    # = 2,179,072 fp32 adapter parameters. Frozen bf16 base (2 B) + adapters (4 B); grads 4 B, Adam 8 B.
    A = 28 * 16 * (1536 + 1536 + 1536 + 256)
    assert lora.terms["weights"] == pytest.approx((2 * P + 4 * A) / GiB)
    assert lora.terms["optimizer"] == pytest.approx(8 * A / GiB)


def test_fp32_on_cpu():
    e = _trainer(precision="fp32", device=CPU_TERMS)
    # fp32 activations are 4 B: twice the bf16 number; logits 4 + 4 + 4 = 12 B per value. CPU SDPA keeps each
    # layer's attention probabilities, B x 12 heads x S^2 (checkpointing: the recomputed layer's), and backward
    # one layer's gradient of them.
    assert e.terms["activations"] == pytest.approx((12288 * 85248 * 4 + 2 * 2 * SCORES_BF16) / GiB)
    assert _trainer(precision="fp32", device=CPU_TERMS, gradient_checkpointing=False).terms["activations"] \
        == pytest.approx((12288 * 28 * (10 * 1536 + 3 * 8960) * 4 + 29 * 2 * SCORES_BF16) / GiB)
    # GPU attention kernels hold no B·heads·S²
    assert _trainer(precision="fp32").terms["activations"] == pytest.approx(12288 * 85248 * 4 / GiB)
    assert e.terms["logits"] == pytest.approx(8 * 1024 * 151936 * 12 / GiB)
    assert e.terms["runtime"] == 0.5


def test_server_kv_cache_qwen_1_5b_on_a40():
    e = server_estimate(QWEN15, tensor_parallel_size=1, dtype_bytes=2, memory_gib=45.0, gpu_memory_utilization=0.9,
                        max_model_len=1536, max_num_seqs=256, enforce_eager=False)
    assert e.budget_gib == pytest.approx(40.5)  # 0.9 x 45 GiB
    assert e.terms["weights"] == pytest.approx(2 * 1_543_714_304 / GiB)  # 2.88 GiB
    # Profile run: 8192 tokens x (4·1536 + 2·8960 = 24064) x 2 B = 0.367 GiB, plus fp32 sampler logits for
    # 256 sequences: 256 x 151936 x 4 B = 0.145 GiB.
    assert e.terms["activations"] == pytest.approx((8192 * 24064 * 2 + 256 * 151936 * 4) / GiB)
    # KV per token: K and V x 28 layers x 2 KV heads x 128 dims x 2 B = 28672 B.
    assert e.notes["kv_bytes_per_token"] == 28672
    kv_gib = 40.5 - (e.terms["weights"] + e.terms["activations"] + 0.5 + 1.0)
    assert e.terms["kv_cache"] == pytest.approx(kv_gib)  # ≈ 35.6 GiB
    # ≈ 1.33 M tokens: about 868 sequences of 1536 tokens at once.
    assert e.notes["kv_cache_tokens"] == int(kv_gib * GiB // 28672)
    assert 860 <= e.notes["max_concurrent_seqs"] <= 875
    assert e.fits


def test_server_tensor_parallel_splits_weights_and_kv():
    one = server_estimate(QWEN7, tensor_parallel_size=1, dtype_bytes=2, memory_gib=16.0, gpu_memory_utilization=0.9,
                          max_model_len=1536, max_num_seqs=256, enforce_eager=True)
    # 7.6e9 x 2 B = 14.2 GiB of weights > 14.4 GiB budget minus overhead: not one sequence fits.
    assert one.notes["max_concurrent_seqs"] == 0
    two = server_estimate(QWEN7, tensor_parallel_size=2, dtype_bytes=2, memory_gib=16.0,
                          gpu_memory_utilization=0.9, max_model_len=1536, max_num_seqs=256, enforce_eager=True)
    assert two.terms["weights"] == pytest.approx(7_615_616_512 / GiB)  # 7.09 GiB per GPU
    # 4 KV heads over 2 ranks: 2 x 28 x 2 x 128 x 2 B = 28672 B per token per GPU.
    assert two.notes["kv_bytes_per_token"] == 28672
    assert two.notes["max_concurrent_seqs"] > 0


# --- issue 23: KV layouts from config.json facts, LoRA under ZeRO ---------------------------------------------------


def test_mla_kv_cache_is_the_latent_not_full_heads():
    """DeepSeek-V2-Lite (27 layers, 16 heads, MLA: kv_lora_rank 512, qk_rope_head_dim 64): vLLM caches one 576-wide
    latent per token and layer, 27 x 576 x 2 B = 31,104 B, on every tensor-parallel rank. Planned as full
    attention it was K and V x 16 heads x 128 (hidden / heads) x 27 layers x 2 B = 221,184 B: 7.1x too big."""
    from ogrpo.models import from_config_dict

    # The hub config.json's fields (a local model directory reads the same way).
    lite = from_config_dict({"model_type": "deepseek_v2", "hidden_size": 2048, "num_hidden_layers": 27,
                             "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 10944,
                             "vocab_size": 102400, "max_position_embeddings": 163840, "torch_dtype": "bfloat16",
                             "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
                             "num_experts_per_tok": 6, "first_k_dense_replace": 1, "q_lora_rank": None,
                             "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                             "v_head_dim": 128}, "deepseek-ai/DeepSeek-V2-Lite")
    args = dict(dtype_bytes=2, memory_gib=80.0, gpu_memory_utilization=0.9, max_model_len=4096, max_num_seqs=256,
                enforce_eager=False)
    one = server_estimate(lite, tensor_parallel_size=1, **args)
    assert one.notes["kv_bytes_per_token"] == 27 * (512 + 64) * 2 == 31104
    assert one.notes["kv_cache_tokens"] == int(one.terms["kv_cache"] * GiB // 31104)
    # Tensor parallel splits the weights, not the latent: each rank holds all of it.
    two = server_estimate(lite, tensor_parallel_size=2, **args)
    assert two.notes["kv_bytes_per_token"] == 31104
    assert two.terms["weights"] == pytest.approx(one.terms["weights"] / 2)
    # The shipped facts carry the same fields.
    assert lite.params == resolve_model("deepseek-ai/DeepSeek-V2-Lite").params == 15_706_484_224
    assert resolve_model("deepseek-ai/DeepSeek-V3").kv_bytes_per_token(2) == 61 * 576 * 2


def test_sliding_window_layers_reserve_the_window_not_the_sequence():
    """gemma-3-1b-it: 26 layers, every 6th global (4), 22 sliding with a 512-token window. vLLM reserves a sliding
    layer min(window - 1 + max_num_batched_tokens, len) tokens plus a block per sequence (8703 of a 32768-token
    sequence); full layers the whole sequence. At GRPO's usual lengths (1536) nothing is saved."""
    gemma = resolve_model("google/gemma-3-1b-it")
    assert (gemma.sliding_window, gemma.sliding_layers, gemma.num_layers) == (512, 22, 26)
    per_layer = 2 * 1 * 256 * 2  # K and V x 1 KV head x head_dim 256 x 2 B
    long = server_estimate(gemma, tensor_parallel_size=1, dtype_bytes=2, memory_gib=80.0, gpu_memory_utilization=0.9,
                           max_model_len=32768, max_num_seqs=256, enforce_eager=False)
    blocks = long.notes["kv_cache_tokens"] // 16  # the pool, in 16-token blocks of every layer
    per_seq = (4 * 32768 // 16 + 22 * (-(-8703 // 16) + 1)) / 26  # blocks one sequence takes, averaged over layers
    assert long.notes["max_concurrent_seqs"] == int(blocks / per_seq)
    assert long.notes["kv_bytes_per_token"] == 26 * per_layer
    as_full = blocks / (32768 // 16)
    assert long.notes["max_concurrent_seqs"] > 2.5 * as_full  # 2.6x the sequences a full-attention plan allows
    short = server_estimate(gemma, tensor_parallel_size=1, dtype_bytes=2, memory_gib=80.0,
                            gpu_memory_utilization=0.9, max_model_len=1536, max_num_seqs=256, enforce_eager=False)
    full_blocks, slide_blocks = 1536 // 16, 1536 // 16 + 1
    assert short.notes["max_concurrent_seqs"] == int(
        (short.notes["kv_cache_tokens"] // 16) / ((4 * full_blocks + 22 * slide_blocks) / 26))


def test_lora_under_zero_shards_what_deepspeed_shards():
    """Qwen2.5-7B, TRL's default LoRA (r 16 on q_proj, v_proj): A = 5,046,272 adapters, P = 7,615,616,512.
    DeepSpeed casts the whole module to bf16 and keeps fp32 master + Adam (12 B) for the adapters only:
    ZeRO-2 over 4: base and adapters whole (2P + 2A), adapter grads 2A / 4, optimizer 12A / 4;
    ZeRO-3: also the base and adapters / 4. DDP (for contrast) keeps fp32 adapters and no sharding."""
    from ogrpo.planner.lora import lora_spec

    P, A, n = 7_615_616_512, 28 * 16 * ((3584 + 3584) + (3584 + 512)), 4
    lora = lora_spec({"use_peft": True}, "bf16")
    common = dict(model=QWEN7, num_processes=n, precision="bf16", micro_batch=4, prompt_len=256, completion_len=512,
                  gradient_checkpointing=True, beta=0.04, lora=lora, liger=True)
    ddp, z2, z3 = (_trainer(strategy=s, **common) for s in ("ddp", "zero2", "zero3"))
    assert ddp.terms["weights"] == pytest.approx((2 * P + 4 * A) / GiB)
    assert z2.terms["weights"] == pytest.approx((2 * P + 2 * A) / GiB)
    assert (z2.terms["gradients"], z2.terms["optimizer"]) == pytest.approx((2 * A / n / GiB, 12 * A / n / GiB))
    assert z3.terms["weights"] == pytest.approx((2 * P + 2 * A) / n / GiB)
    assert (z3.terms["gradients"], z3.terms["optimizer"]) == pytest.approx((2 * A / n / GiB, 12 * A / n / GiB))
    # No reference copy (the base with adapters disabled is the reference) under any strategy.
    assert ddp.terms["reference_model"] == z2.terms["reference_model"] == z3.terms["reference_model"] == 0
    # ZeRO-3 gathers a layer at a time for the loss, and TRL gathers the whole model to merge the adapters before a
    # weight push: that phase's excess over the loss step's activations and layer gathers counts.
    whole = 2 * (P + A) / GiB
    assert z3.terms["zero3_lora_full_gather"] == pytest.approx(
        whole - z3.terms["activations"] - z3.terms["logits"] - z3.terms["zero3_gather"])
    assert z2.total_gib < ddp.total_gib
    # So ZeRO-3 with LoRA peaks at no less than the whole half model plus its partitions: it beats ZeRO-2 only where
    # the loss step's activations and logits exceed the base's partition (here they do not: 1.1 GiB < 3.5 GiB).
    state = sum(z3.terms[k] for k in ("weights", "gradients", "optimizer", "runtime"))
    assert z3.total_gib == pytest.approx(state + whole) and z3.total_gib > z2.total_gib


# --- issue 33: ZeRO-3 + optimizer offload keeps the gradient partition on the host; one process gathers nothing ---


def test_zero3_offload_keeps_gradients_on_the_host():
    """DeepSpeed 0.19.8's stage3.py allocates the gradient partition (grad_partitions_flat_buffer, half dtype) and the
    fp32 gradients its CPU Adam steps on on `self.device`, the CPU once `offload_optimizer` is set: the GPU keeps
    the half weights' partition and the gathers; the host 12 (master + Adam) + 4 (fp32 grads) + 2 B per parameter."""
    P, n = 1_543_714_304, 4
    off = _trainer(strategy="zero3_offload", num_processes=n)
    assert off.terms["gradients"] == 0.0 and off.terms["optimizer"] == 0.0
    assert off.terms["weights"] == pytest.approx(2 * P / n / GiB)
    assert off.notes["host_terms"]["gradients"] == pytest.approx((4 + 2) * P / n / GiB, abs=1e-3)
    assert sum(off.notes["host_terms"].values()) == pytest.approx(18 * P / n / GiB, abs=2e-3)
    # ZeRO-3 without offload keeps its gradient partition on the GPU: offload saves exactly that and the optimizer.
    z3 = _trainer(strategy="zero3", num_processes=n)
    assert z3.total_gib - off.total_gib == pytest.approx((2 + 12) * P / n / GiB)
    # LoRA: only the adapters have gradients and optimizer states, and they go to the host too.
    from ogrpo.planner.lora import lora_spec
    from ogrpo.planner.memory import lora_params

    lora = lora_spec({"use_peft": True}, "bf16")
    A = sum(lora_params(QWEN15, lora))
    lo = _trainer(strategy="zero3_offload", num_processes=n, lora=lora)
    assert lo.terms["gradients"] == lo.terms["optimizer"] == 0.0
    assert sum(lo.notes["host_terms"].values()) == pytest.approx(18 * A / n / GiB, abs=2e-6)
    # On CPU processes the host is the device: the offloaded state stays in the estimate (nothing left over for
    # the host count), fp32 throughout: grad partition 4 + fp32 grads 4 + master and Adam 12.
    cpu = _trainer(strategy="zero3_offload", num_processes=n, precision="fp32", device=CPU_TERMS)
    assert "host_terms" not in cpu.notes
    assert cpu.terms["gradients"] == pytest.approx(8 * P / n / GiB) and cpu.terms["optimizer"] == pytest.approx(
        12 * P / n / GiB)


def test_one_process_has_no_zero3_gathers():
    """With one process DeepSpeed's partition is the whole parameter and a gather hands it back in place
    (partition_parameters.py `_no_gather_coalesced`): no layer gathers, no LoRA merge gather, no reference gather."""
    for strategy in ("zero3", "zero3_offload"):
        one = _trainer(strategy=strategy, num_processes=1, lora=True, beta=0.04)
        assert not [k for k in one.terms if "gather" in k], one.terms
        cpu = _trainer(strategy=strategy, num_processes=1, beta=0.04, precision="fp32", device=CPU_TERMS)
        assert not [k for k in cpu.terms if "gather" in k], cpu.terms
    assert _trainer(strategy="zero3", num_processes=2, lora=True, micro_batch=1,
                    liger=True).terms["zero3_lora_full_gather"] > 0


@pytest.fixture(scope="module")
def ds_stage3():
    return pytest.importorskip("deepspeed.runtime.zero.stage3")


def _ds_offload(ds_stage3, total, largest, gpn, nodes):
    """DeepSpeed's own estimate (the function its _all_cold and _all_live print) for offload_optimizer=cpu,
    parameters on the GPU, zero.Init: (host bytes per node, GPU bytes per GPU, largest layer's gather bytes)."""
    return ds_stage3.estimate_zero3_model_states_mem_needs(
        total_params=total, largest_layer_params=largest, num_gpus_per_node=gpn, num_nodes=nodes,
        cpu_offload=True, cpu_offload_params=False, zero_init=True, additional_buffer_factor=1.0)


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-32B-Instruct"])
@pytest.mark.parametrize("gpn,nodes", [(2, 1), (8, 1), (8, 4)])
def test_zero3_offload_model_states_match_deepspeeds_estimator(ds_stage3, capsys, name, gpn, nodes):
    """Model states per GPU and per node against DeepSpeed 0.19.8's estimator (offload_optimizer=cpu,
    offload_param=none, zero_init=1, no buffer factor): the GPU holds 2 B per parameter over N plus twice the
    largest layer in 2 B (the embedding, for these dense models), exactly. The host holds DeepSpeed's 16 B per
    parameter per node plus the half gradient partition, 2 B: stage3.py puts grad_partitions_flat_buffer on the
    CPU under offload, which the estimator (written for ZeRO-Infinity) leaves out."""
    model = resolve_model(name)
    P, n = model.params, gpn * nodes
    embed = model.vocab_size * model.hidden_size
    host_node, gpu, gather = _ds_offload(ds_stage3, P, embed, gpn, nodes)
    e = _trainer(model=model, num_processes=n, strategy="zero3_offload", liger=True)
    states = sum(e.terms[k] for k in ("weights", "gradients", "optimizer"))
    assert states * GiB == pytest.approx(gpu - gather, rel=1e-9)
    assert e.terms["zero3_gather"] * GiB == pytest.approx(gather)
    # (host terms are rounded to 1 MiB per term and process)
    assert gpn * sum(e.notes["host_terms"].values()) * GiB == pytest.approx(host_node + gpn * 2 * P / n,
                                                                           abs=gpn * 2**20)
    # The printed table of _all_cold carries the same figure (GB there are 2^30 bytes).
    ds_stage3.estimate_zero3_model_states_mem_needs_all_cold(total_params=P, largest_layer_params=embed,
                                                            num_gpus_per_node=gpn, num_nodes=nodes,
                                                            additional_buffer_factor=1.0)
    row = next(x for x in capsys.readouterr().out.splitlines()
               if "offload_param=none" in x and "offload_optimizer=none" not in x and "zero_init=1" in x)
    per_cpu, per_gpu = (float(c.strip().rstrip("GB")) for c in row.split("|")[:2])
    assert (per_cpu, per_gpu) == pytest.approx((host_node / GiB, gpu / GiB), abs=0.006)


def test_zero3_offload_live_model_matches_deepspeeds_count(ds_stage3):
    """_all_live's count on a real module (transformers' Qwen2, tied embeddings): total parameters (shared ones once)
    and the largest module are what the plan's model facts say, so the GPU figure is DeepSpeed's for that module."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ogrpo.models import from_config_dict

    cfg = dict(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
               num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    live = Qwen2ForCausalLM(Qwen2Config(**cfg))
    total, largest = ds_stage3.model_to_params(live)
    facts = from_config_dict({"model_type": "qwen2", "torch_dtype": "bfloat16", **cfg}, "live-qwen2")
    assert facts.params == total and largest == facts.vocab_size * facts.hidden_size
    for gpn in (2, 4):
        _, gpu, gather = _ds_offload(ds_stage3, total, largest, gpn, 1)
        e = _trainer(model=facts, num_processes=gpn, strategy="zero3_offload", liger=True)
        assert (e.terms["weights"] + e.terms["gradients"] + e.terms["optimizer"]) * GiB == pytest.approx(gpu - gather)
        # DeepSpeed's unit is one module (here the embedding); the plan's a whole decoder layer where that is
        # larger (3.8M > 2.1M parameters in this small shape): never less than DeepSpeed's
        assert e.terms["zero3_gather"] * GiB >= gather
