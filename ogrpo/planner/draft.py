"""The state the planner's steps share while one plan is made: the inputs, the device rules, and the lists every
step appends to (settings with reasons, changes from the recipe, reasons it does not fit, candidate fixes,
warnings). Steps return their own decisions as values; only these lists are shared."""

from __future__ import annotations

from dataclasses import dataclass, field

from ogrpo.hardware import Cluster
from ogrpo.models import ModelFacts
from ogrpo.planner import compile_choice
from ogrpo.planner.device_rules import DeviceRules
from ogrpo.planner.types import Change, Setting

# Per profile: share of device memory kept free, vLLM's share (server / colocated), max concurrent sequences.
PROFILE = {
    "conservative": {"headroom": 0.15, "server_util": 0.85, "colocate_util": 0.25, "max_seqs": 128, "eager": True},
    "balanced": {"headroom": 0.10, "server_util": 0.90, "colocate_util": 0.30, "max_seqs": 256, "eager": False},
    "aggressive": {"headroom": 0.05, "server_util": 0.92, "colocate_util": 0.40, "max_seqs": 512, "eager": False},
}
PROFILES = tuple(PROFILE)


class Settings:
    """Every hardware-aware setting with its reason, in the order the plan decided them."""

    def __init__(self):
        self.items: list[Setting] = []

    def add(self, name: str, value, reason: str):
        self.items.append(Setting(name, value, reason))
        return value


class Changes:
    """How the run differs from the recipe as written, the first reason per key."""

    def __init__(self, trl: dict):
        self.trl = trl
        self.items: list[Change] = []

    def add(self, key: str, old, new, reason: str) -> None:
        if not any(c.key == key for c in self.items):
            self.items.append(Change(key, old, new, reason))

    def adapt(self, key: str, value, reason: str):
        """The plan's value for a key: listed when the recipe set the key to something else."""
        user = self.trl.get(key)
        if user is not None and user != value:
            self.add(key, user, value, reason)
        return value


@dataclass
class Draft:
    cluster: Cluster
    model: ModelFacts
    run_config: object
    profile: str
    rules: DeviceRules
    settings: Settings = field(default_factory=Settings)
    changes: Changes = None  # type: ignore[assignment]
    reasons: list[str] = field(default_factory=list)
    fixes: list = field(default_factory=list)  # list[Fix]
    warnings: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.changes is None:
            self.changes = Changes(self.trl)
        if not self.warnings:
            self.warnings = list(self.run_config.warnings)

    @property
    def trl(self) -> dict:
        return self.run_config.trl

    @property
    def prof(self) -> dict:
        return PROFILE[self.profile]

    @property
    def gpu(self):
        return self.cluster.gpu

    def user_set(self, key: str) -> bool:
        return key in self.trl and self.trl[key] is not None

    def server_eager(self) -> tuple[bool, str]:
        """(vLLM's enforce_eager, why): ogrpo.vllm_compile, else the profile (GPU) or the run's length (CPU)."""
        return compile_choice.decide(getattr(self.run_config.ogrpo, "vllm_compile", None), self.prof["eager"],
                                     self.rules.torch_device == "cpu", compile_choice.generated_tokens(self.trl))
