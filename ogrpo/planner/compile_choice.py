"""Whether vLLM compiles its model (`enforce_eager` off) or runs it eagerly: `ogrpo.vllm_compile`.

On GPUs the profile decides (CUDA graphs and torch.compile, except under `conservative`). On CPU compiling costs
start-up time once per server start (inductor's C++ codegen: 12 s more for a 4.2M model here, more for deeper
ones) and then decodes about 20% faster (1.6 vs 2.0 s for 2,048 tokens of the 4.2M bench model on one core,
2026-11-29); the plan compiles where the run generates enough to repay it, from the recipe's own numbers.
"""

from __future__ import annotations

# Completion tokens (at the cap) from which compiling repays itself on CPU: ~40k real tokens at a 0.4 mean share
# of the cap take ~80 s at 500 tokens/s, of which 20% is more than the ~12-25 s the compile costs.
CPU_COMPILE_TOKENS = 100_000


def generated_tokens(trl: dict, processes: int = 1) -> int | None:
    """Completion tokens the run generates at most (max_steps x completions per step x the cap); None where the
    length is counted in epochs (the dataset's size decides)."""
    steps = int(trl.get("max_steps") or -1)
    if steps <= 0:
        return None
    per_step = (int(trl.get("per_device_train_batch_size") or 8) * int(trl.get("gradient_accumulation_steps") or 1)
                * max(1, processes))
    reuse = max(1, int(trl.get("num_iterations") or 1))  # a generation batch trains num_iterations times
    return -(-steps * per_step // reuse) * int(trl.get("max_completion_length") or 256)


def decide(wanted: str | None, profile_eager: bool, on_cpu: bool, tokens: int | None) -> tuple[bool, str]:
    """(enforce_eager, why)."""
    if wanted == "on":
        return False, "set in the run config (ogrpo.vllm_compile: on)"
    if wanted == "off":
        return True, "set in the run config (ogrpo.vllm_compile: off): the model runs eagerly"
    if not on_cpu:
        return profile_eager, ("the conservative profile: no CUDA graphs or torch.compile (less memory, slower "
                               "decoding)" if profile_eager else "CUDA graphs and torch.compile (faster decoding)")
    if tokens is not None and tokens < CPU_COMPILE_TOKENS:
        return True, (f"CPU: the run generates at most {tokens:,} completion tokens (< {CPU_COMPILE_TOKENS:,}), "
                      "too few to repay compiling at start-up; ogrpo.vllm_compile: on compiles anyway")
    what = "an epoch-counted run" if tokens is None else f"up to {tokens:,} completion tokens"
    return False, (f"CPU: {what} repays compiling at start-up (10-25 s) with ~20% faster decoding; "
                   "ogrpo.vllm_compile: off runs eagerly")
