"""The plan as one typed object: what crosses plan → render → launch.

`Plan.to_dict()` is the JSON form (`plan --json`, manifest.json, run.yaml's `ogrpo.plan`); `Plan.from_dict`
reads it back, older manifests included (missing keys take their defaults, unknown ones are ignored). A run
config carries the dict form (`ogrpo.plan`); whoever loads it parses it once with `Plan.from_dict` and hands the
`Plan` on, so no consumer reads plan dicts. `to_dict` writes the same JSON as the dict form always had: run
records compare old plans with new ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from dataclasses import replace as _replace
from enum import StrEnum

from ogrpo.errors import OgrpoError
from ogrpo.hardware import Cluster, GpuType
from ogrpo.models import ModelFacts


def _choices(name: str, doc: str, values: str) -> type[StrEnum]:
    """A StrEnum whose members are `values` (space-separated), each named as its value in capitals."""
    kind = StrEnum(name, [(v.upper().replace("-", "_"), v) for v in values.split()], module=__name__)
    kind.__doc__ = doc
    return kind


# Where generation runs: a vLLM server on its own GPUs, vLLM inside the trainer, or no vLLM (HF generate).
Mode = _choices("Mode", "Where generation runs (server | colocate | none).", "server colocate none")
# The trainer's precision (torch/vLLM names: ogrpo.dtypes).
Precision = _choices("Precision", "The trainer's precision (fp32 | bf16 | fp16).", "fp32 bf16 fp16")
# ogrpo.overlap: whether server and trainer work at the same time (ogrpo/overlap/pipeline.py).
Overlap = _choices("Overlap", "ogrpo.overlap (off | lossless | one-step).", "off lossless one-step")
# How a lossless run takes a batch from the server (ogrpo/planner/overlap_stream.py).
OverlapStream = _choices("OverlapStream", "How a lossless run takes a batch (groups | batch).", "groups batch")
# Where the old policy's log-probs come from (ogrpo/planner/settings.py `old_policy_pass`, ogrpo/trainer/old_policy.py).
OldPolicyPass = _choices("OldPolicyPass", "The old policy's log-probs (from_loss | separate | none).",
                         "from_loss separate none")


class Strategy(StrEnum):
    """The trainer's memory strategy, cheapest first: DDP, DeepSpeed ZeRO-2, ZeRO-3, ZeRO-3 + optimizer offload."""

    DDP = "ddp"
    ZERO2 = "zero2"
    ZERO3 = "zero3"
    ZERO3_OFFLOAD = "zero3_offload"

    @property
    def uses_deepspeed(self) -> bool:
        return self is not Strategy.DDP

    @property
    def is_zero3(self) -> bool:
        """ZeRO-3, with or without offload: parameters are sharded (collective forward passes)."""
        return self in (Strategy.ZERO3, Strategy.ZERO3_OFFLOAD)

    @property
    def offloads(self) -> bool:
        return self is Strategy.ZERO3_OFFLOAD

    @property
    def zero_stage(self) -> int:
        """DeepSpeed's ZeRO stage (0: DDP)."""
        return 0 if self is Strategy.DDP else 2 if self is Strategy.ZERO2 else 3


def _enum(kind, value):
    """`value` as a member of `kind` (None stays None)."""
    return None if value is None else kind(value)


def _plain_value(value):
    """A JSON/YAML-safe value: an enum member as its plain string (YAML's safe dumper refuses str subclasses)."""
    return value.value if isinstance(value, StrEnum) else value


def _mapping(d, where: str) -> dict:
    """`d` (None: empty) as the mapping a plan part is read from; TypeError (a damaged plan) otherwise."""
    d = d or {}
    if not isinstance(d, dict):
        raise TypeError(f"plan.{where}: {d!r} is not a mapping")
    return d


class _Unset:
    """Typed options whose None means "not set": left out of the JSON form, which keeps the fields' order."""

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


class _Section:
    """A frozen plan section: attributes for code, `to_dict`/`from_dict` for JSON. No dict-style reads: code
    that still expects the dict form fails at once instead of reading a default."""

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict | None):
        d = _mapping(d, cls.__name__)
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def _plain(value):
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list):
        return list(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return _plain_value(value)


@dataclass(frozen=True)
class VllmArgs(_Unset):
    """The vLLM engine arguments the plan sets (`vllm serve` options), one typed field each, in the order of the
    JSON form. None: not set, left out of the JSON (a plan without vLLM has none; only a server gets
    `disable_log_stats`; the memory budget is either `gpu_memory_utilization`, a share of the device, or
    `kv_cache_memory_bytes`, an explicit KV budget)."""

    dtype: str | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool | None = None
    tensor_parallel_size: int | None = None
    data_parallel_size: int | None = None
    logprobs_mode: str | None = None
    disable_log_stats: bool | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> VllmArgs:
        d = _mapping(d, "vllm.args")
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"plan.vllm.args: unknown vLLM options {', '.join(unknown)}")
        return cls(**d)

    def __bool__(self) -> bool:
        return bool(self.to_dict())


@dataclass(frozen=True)
class Kernels(_Unset):
    """O-GRPO's own kernels (ogrpo/kernels) the plan turns on; None: not in the plan (one written before them)."""

    linear_logprobs: bool | None = None
    fused_sample: bool | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> Kernels:
        d = _mapping(d, "kernels")
        names = {f.name for f in fields(cls)}
        return cls(**{k: bool(v) for k, v in d.items() if k in names})


@dataclass(frozen=True)
class TrainerArgs:
    """What the trainer's GRPOConfig gets from the plan. The keys vary with the plan (and their order is the JSON
    form's), so they are held in order; the ones code reads by name are typed properties."""

    values: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dict(self.values)

    @classmethod
    def from_dict(cls, d: dict | None) -> TrainerArgs:
        return cls(dict(_mapping(d, "trainer_args")))

    def items(self):
        """(GRPOConfig key, value) in the plan's order: what the trainer's settings apply."""
        return self.values.items()

    @property
    def model_init_kwargs(self) -> dict:
        """What from_pretrained gets (attention, the load dtype; the recipe's own keys)."""
        return dict(self.values.get("model_init_kwargs") or {})

    @property
    def tf32(self) -> bool | None:
        return self.values.get("tf32")

    @property
    def vllm_gpu_memory_utilization(self) -> float | None:
        """Colocated vLLM's share of the device (TRL's GRPOConfig key; the server's is VllmArgs')."""
        return self.values.get("vllm_gpu_memory_utilization")


@dataclass(frozen=True)
class Setting:
    """One hardware-aware setting the plan chose, with its reason (`{name, value, reason}` in JSON)."""

    name: str
    value: object
    reason: str

    def to_dict(self) -> dict:
        return {"name": self.name, "value": self.value, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict) -> Setting:
        return cls(name=d["name"], value=d.get("value"), reason=d.get("reason", ""))


@dataclass(frozen=True)
class Change:
    """One way the run differs from the recipe as written: `key` goes from `old` to `new` (`{key, from, to,
    reason}` in JSON: `from` is a Python keyword)."""

    key: str
    old: object
    new: object
    reason: str

    def to_dict(self) -> dict:
        return {"key": self.key, "from": self.old, "to": self.new, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict) -> Change:
        return cls(key=d["key"], old=d.get("from"), new=d.get("to"), reason=d.get("reason", ""))


@dataclass(frozen=True)
class Fix:
    """A suggested fix: its text and the overrides that apply it (run-config keys, `ogrpo` options included
    under "ogrpo"; command-line options `gpus` / `vllm_gpus`)."""

    text: str
    config: dict = field(default_factory=dict)
    cli: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"text": self.text, "config": dict(self.config), "cli": dict(self.cli)}

    @classmethod
    def from_dict(cls, d: dict) -> Fix:
        return cls(text=d["text"], config=dict(d.get("config") or {}), cli=dict(d.get("cli") or {}))


@dataclass(frozen=True)
class VllmPart(_Section):
    """Where vLLM runs and with what engine arguments (`args`); empty parts without vLLM."""

    nodes: list[int] = field(default_factory=list)
    gpus: list[int] = field(default_factory=list)
    num_gpus: int = 0
    tensor_parallel_size: int = 0
    data_parallel_size: int = 0
    memory_gib_per_gpu: float = 0.0
    memory_terms: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    args: VllmArgs = field(default_factory=VllmArgs)

    @classmethod
    def from_dict(cls, d: dict | None):
        part = super().from_dict(d)
        return part if isinstance(part.args, VllmArgs) else \
            _replace(part, args=VllmArgs.from_dict(part.args))


@dataclass(frozen=True)
class TrainerPart(_Section):
    nodes: list[int] = field(default_factory=lambda: [0])
    gpus: list[int] = field(default_factory=list)
    num_gpus: int = 0
    num_processes: int = 1
    strategy: Strategy = Strategy.DDP
    memory_gib_per_gpu: float = 0.0
    memory_terms: dict = field(default_factory=dict)
    gradient_checkpointing: bool = False
    env: dict = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "strategy", Strategy(self.strategy))


@dataclass(frozen=True)
class BatchPart(_Section):
    per_device_train_batch_size: int = 0
    gradient_accumulation_steps: int = 1
    num_generations: int = 0
    steps_per_generation: int = 1
    generation_batch_size: int = 0
    prompts_per_generation: int = 0
    num_processes: int = 1
    prompt_length: int = 0
    completion_length: int = 0
    max_model_len: int = 0


@dataclass(frozen=True)
class Grace:
    """What the cluster gives a job between SIGTERM and SIGKILL (read from scontrol: ogrpo/launch/slurm/grace.py)."""

    kill_wait_s: int
    grace_time_s: int = 0  # the partition's preemption grace (GraceTime)
    preempt_type: str = "preempt/none"
    preempt_mode: str = "OFF"  # the partition's, else the cluster's
    partition: str | None = None

    @property
    def preempts(self) -> bool:
        return self.preempt_type != "preempt/none" and self.preempt_mode.upper().split(",")[0] not in ("OFF", "")

    @property
    def window_s(self) -> int:
        """SIGTERM → SIGKILL on the path that requeues this job: a preemption (GraceTime, then the usual
        SIGTERM-KillWait-SIGKILL) where the partition preempts, else `scontrol requeue`/a drain (KillWait)."""
        return self.kill_wait_s + (self.grace_time_s if self.preempts else 0)

    def describe(self) -> str:
        where = f"partition {self.partition}" if self.partition else "this cluster"
        text = f"KillWait {self.kill_wait_s} s"
        if self.preempts:
            text += f" + GraceTime {self.grace_time_s} s of {where} (PreemptMode {self.preempt_mode})"
        return text

    def to_dict(self) -> dict:
        return {**asdict(self), "window_s": self.window_s, "preempts": self.preempts}


@dataclass(frozen=True)
class Preemption:
    """What the job does about preemption (ogrpo/planner/preemption.py): the time-limit warning's lead time and
    the checkpoint frequency, from the cluster's SIGTERM window and the step and save estimates."""

    step_s: float
    step_source: str
    save_s: float
    need_s: float  # one step (with margin) and its checkpoint: what a signal must leave the trainer to lose nothing
    signal_delay_s: int
    grace: Grace | None = None
    save_steps: int | None = None  # the plan's value when it changes the recipe's, else None

    def to_dict(self) -> dict:
        return {"step_s": self.step_s, "step_source": self.step_source, "save_s": self.save_s,
                "need_s": round(self.need_s, 1), "signal_delay_s": self.signal_delay_s,
                "grace": self.grace.to_dict() if self.grace else None, "save_steps": self.save_steps}


@dataclass
class Plan:
    cluster: Cluster
    model: ModelFacts
    profile: str
    fits: bool
    reasons: list[str]
    fixes: list[str]
    precision: Precision
    attn_implementation: str
    mode: Mode
    vllm: VllmPart
    trainer: TrainerPart
    trainer_args: TrainerArgs  # what the trainer's GRPOConfig gets from the plan
    env: dict[str, str]
    settings: list[Setting]
    batch: BatchPart
    warnings: list[str] = field(default_factory=list)
    # Every way the run differs from the recipe as written (the rules per key: ogrpo/fields.py).
    changes: list[Change] = field(default_factory=list)
    # The fixes as data; each was re-planned with it applied and fits.
    fix_actions: list[Fix] = field(default_factory=list)
    # O-GRPO's own kernels the trainer installs.
    kernels: Kernels = field(default_factory=Kernels)
    # The preemption policy, when the plan was made with the cluster's facts (render, submit; `plan` for a plan
    # that does not run here). Not in the JSON form, which stays as it was: its effects are (save_steps among
    # `changes`, its `warnings`; run.yaml's save_steps), and `plan --json` prints it beside the plan.
    preemption: Preemption | None = None

    def __post_init__(self):
        self.precision = Precision(self.precision)
        self.mode = Mode(self.mode)

    @property
    def is_cpu(self) -> bool:
        return self.cluster.is_cpu

    @property
    def has_server(self) -> bool:
        return self.mode is Mode.SERVER

    @property
    def overlap(self) -> Overlap:
        """The `overlap` setting (off where the plan has none: no split placement, or an older plan)."""
        return _enum(Overlap, self.setting("overlap")) or Overlap.OFF

    @property
    def overlap_stream(self) -> OverlapStream | None:
        """The `overlap.stream` setting of a lossless run, else None."""
        return _enum(OverlapStream, self.setting("overlap.stream"))

    @property
    def train_ahead(self) -> bool | None:
        """The `overlap.train_ahead` setting of a streamed lossless run (ogrpo/overlap/train_ahead.py), else None."""
        value = self.setting("overlap.train_ahead")
        return None if value is None else value == "on"

    @property
    def early_backward(self) -> bool | None:
        """The `overlap.early_backward` setting of a run that trains groups ahead in one process
        (ogrpo/overlap/early_backward.py), else None."""
        value = self.setting("overlap.early_backward")
        return None if value is None else value == "on"

    @property
    def early_backward_groups(self) -> int:
        """How many open groups may hold their early rows' gradient sums at once (0 where none may). A plan
        written before the setting, with the early backward on, budgeted one group's sums: 1."""
        value = self.setting("overlap.early_backward_groups")
        return int(value) if value is not None else int(bool(self.early_backward))

    @property
    def rank_balance(self) -> bool | None:
        """The `rank_balance` setting of a run with several trainer processes (ogrpo/trainer/rank_balance.py)."""
        value = self.setting("rank_balance")
        return None if value is None else value == "on"

    @property
    def old_policy_pass(self) -> OldPolicyPass | None:
        """The `old_policy_pass` setting of a vLLM run, else None."""
        return _enum(OldPolicyPass, self.setting("old_policy_pass"))

    @property
    def padding_free(self) -> bool | None:
        """The `padding_free` setting: the log-prob passes packed (ogrpo/trainer/packing.py); None in older plans."""
        value = self.setting("padding_free")
        return None if value is None else value in ("on", "rows")

    @property
    def padding_free_layout(self) -> str | None:
        """"rows" where the run config holds packed passes to each row's own prompt, else None (the cost model
        picks per pass whether a prompt is computed once for its rows)."""
        return "rows" if self.setting("padding_free") == "rows" else None

    def reason_of(self, name: str) -> str | None:
        """Why the plan chose what it did for one of its settings, else None."""
        return next((item.reason for item in self.settings if item.name == name), None)

    def setting(self, name: str, default=None):
        """The value the plan chose for one of its settings, else `default` (the planner's and the tables' generic
        read; code reads a setting it acts on through its typed property: `overlap`, `overlap_stream`)."""
        return next((item.value for item in self.settings if item.name == name), default)

    def change(self, key: str) -> Change | None:
        """The change the plan makes to `key`, else None."""
        return next((c for c in self.changes if c.key == key), None)

    def to_dict(self) -> dict:
        return {
            "fits": self.fits,
            "reasons": list(self.reasons),
            "fixes": list(self.fixes),
            "precision": self.precision.value,
            "attn_implementation": self.attn_implementation,
            "mode": self.mode.value,
            "profile": self.profile,
            "cluster": self.cluster.to_dict(),
            "model": self.model.to_dict(),
            "vllm": self.vllm.to_dict(),
            "trainer": self.trainer.to_dict(),
            "batch": self.batch.to_dict(),
            "trainer_args": self.trainer_args.to_dict(),
            "env": dict(self.env),
            "settings": [s.to_dict() for s in self.settings],
            "warnings": list(self.warnings),
            "changes": [c.to_dict() for c in self.changes],
            "fix_actions": [f.to_dict() for f in self.fix_actions],
            "kernels": self.kernels.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        """A plan from its JSON form (manifest.json, run.yaml's ogrpo.plan), older ones included. A damaged one
        (no cluster, a section that is not a mapping ...) is one OgrpoError, not a traceback."""
        if not isinstance(d, dict) or not isinstance(d.get("cluster"), dict):
            raise OgrpoError("the plan names no cluster (plan.cluster); re-run `ogrpo render` instead of editing the "
                             "plan by hand")
        try:
            return cls._from_dict(d)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise OgrpoError(f"the plan cannot be read ({type(exc).__name__}: {exc}); re-run `ogrpo render` "
                             "instead of editing the plan by hand") from None

    @classmethod
    def _from_dict(cls, d: dict) -> Plan:
        return cls(cluster=cluster_from_dict(d["cluster"]), model=model_from_dict(d.get("model") or {}),
                   profile=d.get("profile", "balanced"), fits=bool(d.get("fits", True)),
                   reasons=list(d.get("reasons") or []), fixes=list(d.get("fixes") or []),
                   precision=d.get("precision", "fp32"), attn_implementation=d.get("attn_implementation", "sdpa"),
                   mode=d.get("mode", "none"), vllm=VllmPart.from_dict(d.get("vllm")),
                   trainer=TrainerPart.from_dict(d.get("trainer")), trainer_args=TrainerArgs.from_dict(d.get("trainer_args")),
                   env=dict(d.get("env") or {}),
                   settings=[Setting.from_dict(s) for s in d.get("settings") or []],
                   batch=BatchPart.from_dict(d.get("batch")), warnings=list(d.get("warnings") or []),
                   changes=[Change.from_dict(c) for c in d.get("changes") or []],
                   fix_actions=[Fix.from_dict(f) for f in d.get("fix_actions") or []],
                   kernels=Kernels.from_dict(d.get("kernels")))


def cluster_from_dict(d: dict) -> Cluster:
    g = d.get("gpu") or {}
    names = {f.name for f in fields(GpuType)}
    gpu = GpuType(**{k: v for k, v in g.items() if k in names})
    return Cluster(nodes=int(d["nodes"]), gpus_per_node=int(d["gpus_per_node"]), gpu=gpu, spec=d["spec"])


def model_from_dict(d: dict) -> ModelFacts:
    names = {f.name for f in fields(ModelFacts)}
    kw = {k: v for k, v in d.items() if k in names}
    defaults = {"name": "model", "params": 0, "hidden_size": 0, "num_layers": 0, "num_heads": 1, "num_kv_heads": 1,
                "head_dim": 0, "vocab_size": 0, "intermediate_size": 0, "tie_word_embeddings": False,
                "max_position_embeddings": 0, "torch_dtype": "bfloat16"}
    return ModelFacts(**{**defaults, **kw})


__all__ = ["BatchPart", "Change", "Fix", "Kernels", "Mode", "Overlap", "OverlapStream", "Plan", "Precision", "Setting",
           "Strategy", "TrainerArgs", "TrainerPart", "VllmArgs", "VllmPart", "cluster_from_dict", "model_from_dict"]
