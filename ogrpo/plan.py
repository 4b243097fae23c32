"""The planner: (cluster, model, run config, profile) -> Plan. Pure: no I/O, no torch.

`make_plan` runs the steps of ogrpo/planner in order: the recipe's TRL line, precision and attention,
placement, TRL's batch rules, vLLM's memory fit, the trainer strategy (the cheapest that fits: DDP → ZeRO-2 →
ZeRO-3 → ZeRO-3 + optimizer offload), the trainer/vLLM/environment settings, the recipe keys the job replaces,
the changes the plan-time input checks made (handed in: the checks read files, the planner does not), the
recipe's opt-out of the code sandbox, the preemption policy (from the cluster's facts, handed in: the command asks
scontrol), then (when it does not fit) the fixes that hold. What differs per device kind lives in
ogrpo/planner/device_rules.py. Every change and warning of a plan is listed here, in this order.
"""

from __future__ import annotations

from collections.abc import Sequence

from ogrpo import packages
from ogrpo.errors import OgrpoError
from ogrpo.fields import config_changes
from ogrpo.hardware import Cluster, parse_gpus
from ogrpo.lengths import DEFAULT_PROMPT_LENGTH
from ogrpo.models import ModelFacts, resolve_model
from ogrpo.planner import batch as _batch
from ogrpo.planner import input_changes as _input_changes
from ogrpo.planner import placement as _placement
from ogrpo.planner import preemption as _preemption
from ogrpo.planner import sandbox_opt_out as _sandbox_opt_out
from ogrpo.planner import settings as _settings
from ogrpo.planner import strategy as _strategy
from ogrpo.planner.batch import batch_rules
from ogrpo.planner.device_rules import CPU_VLLM_UTIL, rules_for
from ogrpo.planner.draft import PROFILES, Draft
from ogrpo.planner.fixes import Fix, fixes_that_hold
from ogrpo.planner.kernels import plan_kernels
from ogrpo.planner.placement import valid_tp_sizes
from ogrpo.planner.preemption import PreemptionFacts
from ogrpo.planner.types import BatchPart, Change, Kernels, Plan, TrainerArgs, TrainerPart, VllmArgs, VllmPart

__all__ = ["CPU_VLLM_UTIL", "DEFAULT_PROMPT_LENGTH", "PROFILES", "BatchPart", "Fix", "Plan", "PreemptionFacts",
           "TrainerPart", "VllmPart", "batch_rules", "cluster_of", "make_plan", "plan_from_config", "plan_kernels",
           "valid_tp_sizes"]


def make_plan(cluster: Cluster, model: ModelFacts, run_config, profile: str = "balanced",
              check_fixes: bool = True, input_changes: Sequence[Change] = (),
              preemption: PreemptionFacts | None = None) -> Plan:
    """`check_fixes`: re-plan every suggested fix with it applied and keep those that fit (off inside that
    re-planning). `input_changes`: what the plan-time input checks changed in the recipe
    (ogrpo/trainer/inputs.py), listed after the planner's own changes. `preemption`: the cluster's facts the
    command gathered (ogrpo/launch/slurm/grace.py `gather`); None: the plan has no preemption policy."""
    profile = profile or run_config.ogrpo.profile or "balanced"
    if profile not in PROFILES:
        raise OgrpoError(f"--profile {profile!r}: choose one of {', '.join(PROFILES)}")
    rules = rules_for(cluster.gpu)
    d = Draft(cluster=cluster, model=model, run_config=run_config, profile=profile, rules=rules)

    for c in config_changes(d.trl, rules.trl_line):  # fields.py, below the planner, lists them as dicts
        d.changes.add(c["key"], c["from"], c["to"], c["reason"])

    precision = _settings.precision(d)
    attn = _settings.attention(d)
    place = _placement.place(d)
    batch = _batch.check_batch(d, place)
    vfit = _strategy.fit_vllm(d, place, batch)
    tfit = _strategy.fit_trainer(d, place, batch, vfit, precision)
    targs = _settings.trainer_args(d, place, vfit, tfit, precision, attn, batch)
    _settings.replaced_by_job(d, targs, tfit.strategy)
    env = _settings.job_env(d)
    _refuse_missing_packages(d, targs, attn, tfit.strategy)
    vargs, server_env = _settings.vllm_args(d, place, vfit, precision)
    d.warnings += list(model.warnings) + ([] if model.exact_shapes else
                                          [f"{model.name}: shapes extrapolated from --params; activations are rough"])
    # Last, after the planner's own changes and the model's warnings: the order in which `plan --json` and the
    # manifests have always listed them.
    _input_changes.record_input_changes(d, input_changes)
    _sandbox_opt_out.note_sandbox_opt_out(d)
    preempt = _preemption.plan_preemption(d, preemption)

    n = place.num_processes
    vest = vfit.estimate
    vllm = VllmPart(nodes=place.server_nodes, gpus=place.server_gpus,
                    num_gpus=len(place.server_nodes) * len(place.server_gpus) if rules.counts_gpus else 0,
                    tensor_parallel_size=place.tp if place.mode != "none" else 0,
                    data_parallel_size=place.dp if place.mode == "server" else 0,
                    memory_gib_per_gpu=round(vest.total_gib, 2) if vest else 0.0,
                    memory_terms=vest.to_dict() if vest else {}, env={**place.server_env, **server_env},
                    args=VllmArgs(**vargs))
    trainer = TrainerPart(nodes=place.trainer_nodes, gpus=place.trainer_gpus, num_gpus=n if rules.counts_gpus else 0,
                          num_processes=n, strategy=tfit.strategy,
                          memory_gib_per_gpu=round(tfit.estimate.total_gib, 2),
                          memory_terms=tfit.estimate.to_dict(), gradient_checkpointing=tfit.gradient_checkpointing,
                          env=place.trainer_env)
    fits = not d.reasons
    held: list[Fix] = []
    if not fits and check_fixes:
        held = fixes_that_hold(d.fixes, cluster, model, run_config, profile, rules,
                               replan=lambda c, m, rc, prof: make_plan(c, m, rc, prof, check_fixes=False))
    return Plan(cluster=cluster, model=model, profile=profile, fits=fits, reasons=d.reasons,
                fixes=[f.text for f in held], precision=precision, attn_implementation=attn, mode=place.mode,
                vllm=vllm, trainer=trainer, trainer_args=TrainerArgs(targs), env=env, settings=d.settings.items,
                batch=BatchPart(**batch), warnings=d.warnings, changes=d.changes.items, fix_actions=held,
                kernels=Kernels(**{name: on for name, (on, _) in tfit.kernels.items()}), preemption=preempt)


def _refuse_missing_packages(d: Draft, targs: dict, attn: str, strategy: str) -> None:
    """Exit 2 (with the fix) when the run enables a feature whose package the target stack does not carry
    (ogrpo/packages.py): such a job would fail at its first line, after its wait in the queue."""
    stack = d.rules.stack
    lines = packages.refusals(stack, packages.enabled_features({**d.trl, **targs}, attn, strategy))
    if lines:
        raise OgrpoError("; ".join(lines))


def cluster_of(run_config, gpus: str | None = None) -> Cluster:
    """The cluster a plan is made for: `gpus`, else the config's ogrpo.gpus, else this machine's CPU."""
    return parse_gpus(gpus or run_config.ogrpo.gpus or "cpu")


def plan_from_config(run_config, gpus: str | None = None, profile: str | None = None, model: str | None = None,
                     params=None, input_changes: Sequence[Change] = (),
                     preemption: PreemptionFacts | None = None) -> Plan:
    """Parse gpus (`cluster_of`), resolve the model, plan. `input_changes`, `preemption`: see make_plan
    (ogrpo/load_plan.py passes those of its input checks and the command's cluster facts)."""

    cluster = cluster_of(run_config, gpus)
    name = model or run_config.ogrpo.model or run_config.model_name_or_path
    facts = resolve_model(name, params if params is not None else run_config.ogrpo.params)
    return make_plan(cluster, facts, run_config, profile or run_config.ogrpo.profile or "balanced",
                     input_changes=input_changes, preemption=preemption)
