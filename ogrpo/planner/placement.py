"""Placement: where vLLM and the trainer run.

One device colocates vLLM inside the trainer; a single node splits in-node (the server gets the smallest
tensor-parallel group that holds the model and a KV cache, the trainer the rest); several nodes give the server
whole node(s). `--vllm-gpus N` overrides. On CPU, "devices" are processes: `cpu` colocates, `NxCPU` runs one
server process and N-1 trainer processes. Where the recipe leaves the choice to the plan, a server is used only
when measured per-token costs say it is cheaper than generating inside the trainer (ogrpo/planner/costs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ogrpo.errors import ConfigError
from ogrpo.lengths import MIN_PROMPT_ROOM, budget
from ogrpo.lengths import max_model_len as lengths_max_model_len
from ogrpo.planner.memory import Estimate, kv_budget_bytes, kv_bytes_per_token_per_gpu, server_estimate
from ogrpo.models import ModelFacts
from ogrpo.planner import costs as _costs
from ogrpo.planner.draft import Draft
from ogrpo.planner.fixes import set_key


def valid_tp_sizes(model: ModelFacts, limit: int) -> list[int]:
    """Tensor-parallel sizes vLLM accepts: divide the attention heads and the MLP width, and divide or be a
    multiple of the KV heads (which vLLM then replicates)."""
    out = []
    for t in range(1, max(1, limit) + 1):
        if (model.num_heads % t == 0 and model.intermediate_size % t == 0
                and (model.num_kv_heads % t == 0 or t % model.num_kv_heads == 0)):
            out.append(t)
    return out


def lengths(run_config, model: ModelFacts) -> tuple[int, int]:
    """(prompt, completion) tokens to budget for. TRL 1.16 does not truncate prompts, so the prompt length is
    O-GRPO's planning assumption: ogrpo.max_prompt_length, else an old recipe's max_prompt_length, else 512
    capped to what the model's positions leave after the completion."""
    return budget(run_config.trl, run_config.ogrpo.max_prompt_length, model.max_position_embeddings)


class ServerSizer:
    """vLLM's memory estimate for a tensor-parallel size, at the sequence cap and memory share the plan holds
    now (both change as the plan learns the generation batch)."""

    def __init__(self, d: Draft, max_model_len: int, max_num_seqs: int, util: float):
        self.d = d
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.util = util

    def estimate(self, t: int, util: float | None = None) -> Estimate:
        d, r = self.d, self.d.rules
        kv_bytes = (kv_budget_bytes(kv_bytes_per_token_per_gpu(d.model, 1, r.dtype_bytes), self.max_num_seqs,
                                    self.max_model_len) if r.kv_policy == "kv_bytes" else None)
        return server_estimate(d.model, tensor_parallel_size=t, dtype_bytes=r.dtype_bytes,
                               memory_gib=d.gpu.memory_gib, gpu_memory_utilization=self.util if util is None else util,
                               max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                               enforce_eager=d.server_eager()[0], device=r.memory_terms,
                               kv_cache_bytes=kv_bytes)

    @staticmethod
    def ok(e: Estimate) -> bool:
        return e.notes["max_concurrent_seqs"] >= 1 and e.fits


@dataclass
class Placement:
    mode: str  # "server" | "colocate" | "none"
    prompt_len: int
    completion_len: int
    sizer: ServerSizer
    want_util: float | None  # the recipe's vllm_gpu_memory_utilization
    want_tp: int | None
    want_dp: int | None
    vllm_gpus: int | None  # --vllm-gpus / ogrpo.vllm_gpus
    server_nodes: list[int] = field(default_factory=list)
    server_gpus: list[int] = field(default_factory=list)
    trainer_nodes: list[int] = field(default_factory=lambda: [0])
    trainer_gpus: list[int] = field(default_factory=list)
    tp: int = 1
    dp: int = 1
    trainer_env: dict[str, str] = field(default_factory=dict)
    server_env: dict[str, str] = field(default_factory=dict)
    costs: _costs.Costs | None = None  # the measured-cost comparison that chose the placement, if one did
    # the "placement" setting's reason, worded by the placer; its value is written from the final devices
    # (_describe), after a recipe's num_processes may have left some idle
    why: str = ""
    idle: str = ""  # the trainer devices the recipe's num_processes leaves idle, in words ("" when none)

    @property
    def max_model_len(self) -> int:
        return lengths_max_model_len(self.prompt_len, self.completion_len)

    @property
    def num_processes(self) -> int:
        return len(self.trainer_nodes) * len(self.trainer_gpus)


def _too_long(d: Draft, prompt_len: int, completion_len: int, positions: int) -> None:
    """Prompt + completion past the model's positions: the reason, and the fixes that leave a prompt room."""
    if d.run_config.ogrpo.max_prompt_length or d.trl.get("max_prompt_length"):  # the recipe's own prompt budget
        d.reasons.append(f"prompt {prompt_len} + completion {completion_len} tokens exceed the model's {positions} "
                         "positions")
        if positions - prompt_len >= 1:
            d.fixes.append(set_key("max_completion_length", positions - prompt_len))
        if positions - completion_len >= MIN_PROMPT_ROOM:
            d.fixes.append(set_key("ogrpo.max_prompt_length", positions - completion_len))
        return
    # no prompt budget set: the plan would have fitted one in, but the completion leaves too little room for it
    d.reasons.append(f"completion {completion_len} tokens leave {max(0, positions - completion_len)} of the model's "
                     f"{positions} positions for the prompt (at least {MIN_PROMPT_ROOM}; ogrpo.max_prompt_length "
                     "sets the prompt budget)")
    if positions > MIN_PROMPT_ROOM:
        d.fixes.append(set_key("max_completion_length", positions - MIN_PROMPT_ROOM))


def place(d: Draft) -> Placement:
    cluster, model, trl, s, ch = d.cluster, d.model, d.trl, d.settings, d.changes
    prompt_len, completion_len = lengths(d.run_config, model)
    max_model_len = lengths_max_model_len(prompt_len, completion_len)
    if max_model_len > model.max_position_embeddings:
        _too_long(d, prompt_len, completion_len, model.max_position_embeddings)
    mode, costs = _mode(d, prompt_len, completion_len)
    total = cluster.total_gpus
    gen_batch_guess = int(d.run_config.get("per_device_train_batch_size")) * max(1, total - 1) * int(
        d.run_config.get("steps_per_generation") or d.run_config.get("gradient_accumulation_steps"))
    want_util = trl.get("vllm_gpu_memory_utilization")
    want_util = float(want_util) if want_util is not None else None
    sizer = ServerSizer(d, max_model_len, max(1, min(gen_batch_guess, d.rules.max_seqs(d.prof["max_seqs"]))),
                        d.rules.server_util(want_util, d.prof["server_util"]))
    dropped = d.rules.util_change_reason()
    if dropped and want_util is not None and mode != "none":
        ch.add("vllm_gpu_memory_utilization", want_util, None, dropped)
    # A recipe's server tensor/data parallel sizes are honored where the hardware allows (TRL reads them only
    # when colocated; `trl vllm-serve` takes them as flags).
    p = Placement(mode=mode, prompt_len=prompt_len, completion_len=completion_len, sizer=sizer, want_util=want_util,
                  want_tp=trl.get("vllm_tensor_parallel_size"), want_dp=trl.get("vllm_data_parallel_size"),
                  vllm_gpus=d.run_config.ogrpo.vllm_gpus, trainer_gpus=list(range(cluster.gpus_per_node)),
                  costs=costs)
    if mode == "server":
        _SERVER_PLACERS[d.rules.server_placement](d, p)
    elif mode == "colocate":
        p.trainer_nodes, p.trainer_gpus = [0], list(range(total))
        if cluster.nodes > 1:
            p.trainer_nodes, p.trainer_gpus = list(range(cluster.nodes)), list(range(cluster.gpus_per_node))
        p.why = "one device (or --vllm-gpus 0): vLLM shares it with the trainer"
    else:
        p.trainer_nodes, p.trainer_gpus = list(range(cluster.nodes)), list(range(cluster.gpus_per_node))
        p.why = "use_vllm is false"
    _keep_num_processes(d, p)
    s.add("placement", _describe(d, p), p.why)
    _sizes_changed(d, p)
    return p


def _span(items: list[int]) -> str:
    return f"{items[0]}-{items[-1]}" if len(items) > 1 else f"{items[0]}"


def _describe(d: Draft, p: Placement) -> str:
    """The "placement" setting: the devices each role runs on, as the job runs them."""
    if p.mode == "colocate":
        where = "vLLM colocated in each trainer process"
    elif p.mode == "none":
        where = "no vLLM: the trainer generates with transformers"
    elif d.cluster.nodes > 1:
        server = "" if d.rules.server_placement == "one_process" else f" (GPUs {_span(p.server_gpus)})"
        where = (f"server on node 0{server}, trainer on node{'s' if len(p.trainer_nodes) > 1 else ''} "
                 f"{_span(p.trainer_nodes)}")
        if d.rules.server_placement == "one_process":
            where += f" ({len(p.trainer_gpus)} process(es) each)"
    elif d.rules.server_placement == "one_process":
        where = f"1 server process + {p.num_processes} trainer process(es)"
    else:
        where = f"server GPU(s) {p.server_gpus}, trainer GPU(s) {p.trainer_gpus}"
    return where + (f"; {p.idle} idle" if p.idle else "")


def _keep_num_processes(d: Draft, p: Placement) -> None:
    """A recipe's num_processes (accelerate's trainer processes) is kept when the devices the placement leaves the
    trainer can hold it: fewer processes leave devices idle (a warning); more than there are is a change the plan
    lists with where the devices went (_sizes_changed)."""
    want = d.trl.get("num_processes")
    if isinstance(want, bool) or not isinstance(want, int) or want < 1 or want >= p.num_processes:
        return
    gpn, nodes, gpus = len(p.trainer_gpus), list(p.trainer_nodes), list(p.trainer_gpus)
    unit = d.rules.unit
    if want <= gpn:
        p.trainer_nodes, p.trainer_gpus = p.trainer_nodes[:1], p.trainer_gpus[:want]
        # the devices named as the job names them: the step's GPU indices (CPU: a count of processes)
        idle = (f"{gpn - want} trainer process(es)" if not d.rules.counts_gpus else
                f"{unit}(s) {gpus[want:]}" + (f" of node {nodes[0]}" if d.cluster.nodes > 1 else ""))
        if len(nodes) > 1:
            idle += f" and node(s) {_span(nodes[1:])}"
    elif want % gpn == 0:
        p.trainer_nodes = p.trainer_nodes[:want // gpn]
        idle = f"node(s) {_span(nodes[want // gpn:])}"
    else:
        return  # a multi-node trainer fills whole nodes: _sizes_changed says so
    p.idle = idle
    d.settings.add("trainer.num_processes", want, f"num_processes {want} in the run config")
    d.warnings.append(f"num_processes {want} in the run config leaves {gpn * len(nodes) - p.num_processes} trainer "
                      f"device(s) of {d.cluster.spec} idle: {idle}; the trainer runs on {_trainer_where(d, p)}")


def _trainer_where(d: Draft, p: Placement) -> str:
    if not d.rules.counts_gpus:
        return f"{p.num_processes} process(es)"
    node = f"node {p.trainer_nodes[0]}" if len(p.trainer_nodes) == 1 else f"nodes {_span(p.trainer_nodes)}"
    return f"{node}, {d.rules.unit}(s) {p.trainer_gpus}"


def _by_cost(d: Draft, prompt_len: int, completion_len: int) -> _costs.Costs | None:
    """The measured-cost comparison of a server and generation inside the trainer, where the recipe leaves the
    choice to the plan (no use_vllm, vllm_mode or vllm_gpus given) on one node; None otherwise."""
    trl, opts = d.trl, d.run_config.ogrpo
    if any(v is not None for v in (opts.use_vllm, trl.get("use_vllm"), trl.get("vllm_mode"), opts.vllm_gpus)):
        return None  # the user's choice is honored, never weighed against
    if d.cluster.nodes != 1:
        return None
    per_process = int(d.run_config.get("per_device_train_batch_size")) * int(
        d.run_config.get("steps_per_generation") or d.run_config.get("gradient_accumulation_steps"))
    # bf16 samples differ from the fp32 trainer's by ~1e-2 in log-prob: weighed only where the importance-
    # sampling correction that covers the gap stays on
    bf16 = (d.rules.is_cpu and _costs.bf16_capable(_costs.cpu_flags())
            and trl.get("vllm_importance_sampling_correction") is not False)
    return _costs.estimate(_costs.table(), "cpu" if d.rules.is_cpu else d.gpu.name, d.model.params,
                           total=d.cluster.total_gpus, per_process=per_process, prompt_len=prompt_len,
                           completion_len=completion_len, bf16=bf16)


def bf16_server(p: Placement) -> str | None:
    """Why the server runs bf16 where the measured costs chose a bf16 server (see costs.py), else None."""
    c = p.costs
    if p.mode != "server" or c is None or c.server_dtype != "bfloat16":
        return None
    units = ", ".join(sorted(_costs.BF16_FLAGS & _costs.cpu_flags())) or "bf16 units"
    return (f"this CPU has bf16 matrix units ({units}): a bf16 server's step costs {c.server_s:.3f} s vs "
            f"{c.fp32_server_s:.3f} s in fp32 (measured per-token costs, {c.source}); TRL's importance-sampling "
            "correction (vllm_importance_sampling_correction, on) covers its ~1e-2 log-prob gap to the fp32 "
            "trainer")


def _mode(d: Draft, prompt_len: int, completion_len: int) -> tuple[str, _costs.Costs | None]:
    """server | colocate | none, with the changes to use_vllm and vllm_mode that it makes, and the measured-cost
    comparison when one chose it."""
    trl, ch = d.trl, d.changes
    use_vllm = d.run_config.ogrpo.use_vllm
    costs = _by_cost(d, prompt_len, completion_len)
    if costs is not None:
        where = "a vLLM server" if costs.mode == "server" else "inside the trainer (transformers generate)"
        d.settings.add("generation", where, costs.text() + "; use_vllm in the recipe (or ogrpo.use_vllm) decides "
                                                           "instead")
        use_vllm = costs.mode == "server"
    if use_vllm is None:
        use_vllm = trl.get("use_vllm", True) is not False
    if use_vllm and trl.get("use_vllm") is None:
        ch.add("use_vllm", False, True, "TRL's default generates with transformers; O-GRPO generates with vLLM "
                                        + (costs.text() if costs is not None else "(several times faster)")
                                        + " unless use_vllm: false")
    elif trl.get("use_vllm") is not None and bool(trl["use_vllm"]) != use_vllm:
        ch.add("use_vllm", trl["use_vllm"], use_vllm, "ogrpo.use_vllm")
    vllm_gpus = d.run_config.ogrpo.vllm_gpus
    total = d.cluster.total_gpus
    want_mode = trl.get("vllm_mode")
    if want_mode is not None and want_mode not in ("server", "colocate"):
        raise ConfigError([f"vllm_mode {want_mode!r}: TRL's modes are server and colocate (or leave it out: the "
                           "plan picks by placement)"], d.run_config.source)
    if not use_vllm:
        # settings of the vLLM generation a run without vLLM cannot honor: refused, not dropped
        unused = [f"ogrpo.{key} {value}" for key, value in (("vllm_gpus", vllm_gpus),
                                                             ("vllm_compile", d.run_config.ogrpo.vllm_compile))
                  if value not in (None, 0, "auto")]
        if unused:
            raise ConfigError([f"{', '.join(unused)} with use_vllm false (no vLLM in this run); drop one of them"],
                              d.run_config.source)
        return "none", costs
    if (trl.get("vllm_mode") == "colocate" and vllm_gpus is None) or vllm_gpus == 0 or (
            vllm_gpus is None and total == 1):
        mode = "colocate"
    else:
        mode = "server"
    if want_mode is None and mode == "server":
        ch.add("vllm_mode", "colocate", "server", f"TRL's default colocates vLLM in each trainer process; on "
                                                  f"{total} devices O-GRPO gives the server its own")
    elif want_mode is not None and want_mode != mode:
        ch.add("vllm_mode", want_mode, mode, "--vllm-gpus" if vllm_gpus is not None else
               "one device: the server cannot have its own, so vLLM is colocated")
    return mode, costs


def _server_process(d: Draft, p: Placement) -> None:
    """CPU: the server is one process, the trainer the others."""
    total, src = d.cluster.total_gpus, d.run_config.source
    if total < 2:
        raise ConfigError(["a vLLM server on CPU needs its own process: use --gpus 2xcpu or more, or "
                           "ogrpo.vllm_gpus 0 to colocate"], src)
    n_server = p.vllm_gpus or 1
    if n_server >= total:
        raise ConfigError([f"--vllm-gpus {n_server} leaves no trainer process on {d.cluster.spec}; use at "
                           f"most {total - 1}"], src)
    if n_server != 1:
        raise ConfigError(["on CPU the server is one process: --vllm-gpus 1 (or 0 to colocate)"], src)
    p.tp = 1
    p.server_nodes, p.server_gpus = [0], [0]
    if d.cluster.nodes > 1:  # NxMxcpu on Slurm: as with GPU nodes, the server gets node 0
        nodes, gpn = d.cluster.nodes, d.cluster.gpus_per_node
        p.trainer_nodes, p.trainer_gpus = list(range(1, nodes)), list(range(gpn))
        p.why = "multi-node: the server gets a whole node so the trainer's collectives stay off it"
        return
    p.trainer_nodes, p.trainer_gpus = [0], list(range(1, total))
    p.why = "CPU devices are processes: the server gets one, the trainer the rest"
    # the server's core(s) and the trainer's, disjoint (ogrpo/launch/cpu_slots.py): as GPUs are on a GPU node
    p.server_env["OGRPO_CPU_SLOTS"] = f"0:1:{total}"
    p.trainer_env["OGRPO_CPU_SLOTS"] = d.settings.add(
        "cpu_slots", f"1:{total - 1}:{total}", f"the machine's cores in {total} shares: the server's first, the "
        "trainer's the rest, each process pinned to its own (vLLM's CPU engine would spread over all of them)")
    p.trainer_env["OMP_NUM_THREADS"] = d.settings.add(
        "OMP_NUM_THREADS", "1", "vLLM's CPU worker pins a core; a trainer with 2 threads beside it ran "
        "1.8x slower than with 1 (measured on a 2-core host)")


def _server_gpus(d: Draft, p: Placement) -> None:
    """GPUs: a tensor-parallel (x data-parallel) server within node 0; the trainer gets the rest."""
    cluster, model, s, src = d.cluster, d.model, d.settings, d.run_config.source
    total, gpn, vllm_gpus = cluster.total_gpus, cluster.gpus_per_node, p.vllm_gpus
    choices = valid_tp_sizes(model, gpn)
    room = gpn if cluster.nodes > 1 else total - 1  # server GPUs that leave the trainer its own
    if vllm_gpus is not None:
        if vllm_gpus >= total and cluster.nodes == 1:
            raise ConfigError([f"--vllm-gpus {vllm_gpus} leaves no trainer GPU on {cluster.spec}; use at "
                               f"most {total - 1} (or 0 to colocate)"], src)
        if vllm_gpus > gpn:
            raise ConfigError([f"--vllm-gpus {vllm_gpus}: a tensor-parallel server stays within one node "
                               f"({gpn} GPUs); use at most {gpn}"], src)
        if vllm_gpus not in choices:
            raise ConfigError([f"--vllm-gpus {vllm_gpus}: tensor parallel size must divide the "
                               f"{model.num_heads} attention heads ({model.num_kv_heads} KV heads); use one of "
                               f"{', '.join(map(str, choices))}"], src)
        p.tp = vllm_gpus
        s.add("vllm.tensor_parallel_size", p.tp, "--vllm-gpus")
    elif p.want_tp and p.want_tp in choices and p.want_tp <= room:
        p.tp = int(p.want_tp)
        s.add("vllm.tensor_parallel_size", p.tp, "vllm_tensor_parallel_size in the run config")
    else:
        cands = [t for t in choices if t <= max(1, room)] or [1]
        p.tp = next((t for t in cands if p.sizer.ok(p.sizer.estimate(t))), cands[-1])
        s.add("vllm.tensor_parallel_size", p.tp,
              f"smallest size dividing {model.num_heads} heads that holds the weights and a KV cache")
    if p.want_dp and p.want_dp > 1 and p.tp * p.want_dp <= room:
        p.dp = s.add("vllm.data_parallel_size", int(p.want_dp), "vllm_data_parallel_size in the run config")
    elif p.want_dp is None and vllm_gpus is None and cluster.nodes > 1 and room // p.tp > 1:
        # The server owns node 0 whatever its size: replicas on the GPUs a tensor-parallel group leaves idle
        # generate that many more sequences at once, where a wider group would only add KV cache to one.
        p.dp = s.add("vllm.data_parallel_size", room // p.tp,
                     f"{room // p.tp} replicas of tensor parallel {p.tp} fill the server node's {room} GPUs")
    width = p.tp * p.dp
    p.server_nodes, p.server_gpus = [0], list(range(width))
    if cluster.nodes > 1:
        p.trainer_nodes, p.trainer_gpus = list(range(1, cluster.nodes)), list(range(gpn))
        p.why = "multi-node: the server gets a whole node so the trainer's collectives stay off it"
        if width < gpn:
            d.warnings.append(f"node 0 keeps {gpn - width} GPU(s) idle: the server uses tensor parallel {p.tp}"
                              f" x data parallel {p.dp}")
    else:
        p.trainer_nodes, p.trainer_gpus = [0], list(range(width, gpn))
        p.why = "one node: the server takes the fewest GPUs that hold the model, the trainer the rest"


_SERVER_PLACERS = {"one_process": _server_process, "tensor_parallel": _server_gpus}


def server_load_note(d: Draft, p: Placement, generation_batch: int, est: Estimate) -> None:
    """A note, with numbers, where one server node generates for several trainer nodes.

    The plan keeps one server node however many trainer nodes there are, and says what that means rather than
    adding server nodes: TRL's client reaches one server (vllm_server_base_url) and `trl vllm-serve` keeps its
    data-parallel replicas within one node, so a second server node is nothing the job could use. What grows
    instead is each step's generation: the whole trainer's batch in rounds of the sequences the server holds at
    once, while every trainer device waits for it."""
    nodes = len(p.trainer_nodes)
    if p.mode != "server" or d.cluster.nodes < 2 or nodes < 2 or not ServerSizer.ok(est):
        return
    at_once = max(1, min(p.sizer.max_num_seqs, est.notes["max_concurrent_seqs"])) * p.dp
    rounds = -(-generation_batch // at_once)
    unit = d.rules.unit
    d.warnings.append(
        f"one vLLM server node (tensor parallel {p.tp} x data parallel {p.dp}) generates for {nodes} trainer nodes "
        f"({p.num_processes} {unit}s): each step's generation batch of {generation_batch} completions is {rounds} "
        f"round(s) of at most {at_once} sequences at once, up to {p.completion_len} tokens each, while the trainer "
        f"waits; TRL reaches one server, so more trainer nodes make each step's generation longer, not shorter")


def _sizes_changed(d: Draft, p: Placement) -> None:
    ch, spec = d.changes, d.cluster.spec
    if p.mode != "none":
        ch.adapt("vllm_tensor_parallel_size", p.tp, "colocated vLLM runs tensor parallel 1 in each trainer process"
                 if p.mode == "colocate" else f"--vllm-gpus {p.vllm_gpus}" if p.vllm_gpus is not None else
                 f"tensor parallel {p.want_tp} does not divide the model's {d.model.num_heads} heads or leaves no "
                 f"trainer device on {spec}")
    if p.want_dp is not None and p.want_dp != p.dp:
        ch.add("vllm_data_parallel_size", p.want_dp, p.dp, "no separate vLLM server in this placement"
               if p.mode != "server" else f"{p.tp} x {p.want_dp} server GPUs leave no trainer device on {spec}")
    n = p.num_processes
    want = d.trl.get("num_processes")
    server = len(p.server_nodes) * len(p.server_gpus) if p.mode == "server" else 0
    if isinstance(want, int) and want > n and server and d.cluster.nodes == 1:
        why = (f"{spec} has {d.cluster.total_gpus} devices and the vLLM server takes {server} (tensor parallel "
               f"{p.tp} x data parallel {p.dp}): the trainer gets {n}; {want} trainer processes need "
               f"{want + server} devices (--gpus {want + server}x{d.cluster.gpu.name})")
    elif isinstance(want, int) and want > n:
        why = (f"{spec} leaves the trainer {n} device(s)"
               + (f" after the vLLM server's {server}" if server else "")
               + ("; a multi-node trainer fills whole nodes" if d.cluster.nodes > 1 else ""))
    else:
        why = f"a multi-node trainer fills whole nodes of {spec}: the trainer gets {n}"
    ch.adapt("num_processes", n, why)
