"""The plan as one typed object: what crosses plan → render → launch.

`Plan.to_dict()` is the JSON form (`plan --json`, manifest.json, run.yaml's `ogrpo.plan`); `Plan.from_dict`
reads it back, older manifests included (missing keys take their defaults, unknown ones are ignored). A run
config carries the dict form (`ogrpo.plan`); whoever loads it parses it once with `Plan.from_dict` and hands the
`Plan` on, so no consumer reads plan dicts. `to_dict` writes the same JSON as the dict form always had: run
records compare old plans with new ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ogrpo.errors import OgrpoError
from ogrpo.hardware import Cluster, GpuType
from ogrpo.models import ModelFacts


class _Section:
    """A frozen plan section: attributes for code, `to_dict`/`from_dict` for JSON. No dict-style reads: code
    that still expects the dict form fails at once instead of reading a default."""

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict | None):
        d = d or {}
        if not isinstance(d, dict):
            raise TypeError(f"plan.{cls.__name__}: {d!r} is not a mapping")
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def _plain(value):
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list):
        return list(value)
    return value


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
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TrainerPart(_Section):
    nodes: list[int] = field(default_factory=lambda: [0])
    gpus: list[int] = field(default_factory=list)
    num_gpus: int = 0
    num_processes: int = 1
    strategy: str = "ddp"
    memory_gib_per_gpu: float = 0.0
    memory_terms: dict = field(default_factory=dict)
    gradient_checkpointing: bool = False
    env: dict = field(default_factory=dict)


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


@dataclass
class Plan:
    cluster: Cluster
    model: ModelFacts
    profile: str
    fits: bool
    reasons: list[str]
    fixes: list[str]
    precision: str
    attn_implementation: str
    mode: str  # "server" | "colocate" | "none"
    vllm: VllmPart
    trainer: TrainerPart
    trainer_args: dict  # what the trainer's GRPOConfig gets from the plan
    env: dict[str, str]
    settings: list[Setting]
    batch: BatchPart
    warnings: list[str] = field(default_factory=list)
    # Every way the run differs from the recipe as written (the rules per key: ogrpo/fields.py).
    changes: list[Change] = field(default_factory=list)
    # The fixes as data; each was re-planned with it applied and fits.
    fix_actions: list[Fix] = field(default_factory=list)
    # O-GRPO's own kernels the trainer installs: {"linear_logprobs": bool, "fused_sample": bool}.
    kernels: dict = field(default_factory=dict)

    @property
    def is_cpu(self) -> bool:
        return self.cluster.is_cpu

    @property
    def has_server(self) -> bool:
        return self.mode == "server"

    def setting(self, name: str, default=None):
        """The value the plan chose for one of its settings (`overlap`, ...), else `default`."""
        return next((item.value for item in self.settings if item.name == name), default)

    def change(self, key: str) -> Change | None:
        """The change the plan makes to `key`, else None."""
        return next((c for c in self.changes if c.key == key), None)

    def to_dict(self) -> dict:
        return {
            "fits": self.fits,
            "reasons": list(self.reasons),
            "fixes": list(self.fixes),
            "precision": self.precision,
            "attn_implementation": self.attn_implementation,
            "mode": self.mode,
            "profile": self.profile,
            "cluster": self.cluster.to_dict(),
            "model": self.model.to_dict(),
            "vllm": self.vllm.to_dict(),
            "trainer": self.trainer.to_dict(),
            "batch": self.batch.to_dict(),
            "trainer_args": self.trainer_args,
            "env": dict(self.env),
            "settings": [s.to_dict() for s in self.settings],
            "warnings": list(self.warnings),
            "changes": [c.to_dict() for c in self.changes],
            "fix_actions": [f.to_dict() for f in self.fix_actions],
            "kernels": dict(self.kernels),
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
                   trainer=TrainerPart.from_dict(d.get("trainer")), trainer_args=dict(d.get("trainer_args") or {}),
                   env=dict(d.get("env") or {}),
                   settings=[Setting.from_dict(s) for s in d.get("settings") or []],
                   batch=BatchPart.from_dict(d.get("batch")), warnings=list(d.get("warnings") or []),
                   changes=[Change.from_dict(c) for c in d.get("changes") or []],
                   fix_actions=[Fix.from_dict(f) for f in d.get("fix_actions") or []],
                   kernels=dict(d.get("kernels") or {}))


def as_plan(plan) -> Plan:
    """A Plan from a Plan or its dict form (a manifest read back)."""
    return plan if isinstance(plan, Plan) else Plan.from_dict(plan)


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


__all__ = ["BatchPart", "Change", "Fix", "Plan", "Setting", "TrainerPart", "VllmPart", "as_plan", "cluster_from_dict",
           "model_from_dict"]
