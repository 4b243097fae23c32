"""ogrpo.patches: every patch's check passes against the libraries installed here, and fails loudly (naming the
patch, the library and its version) when its target is moved away."""

from __future__ import annotations

import importlib
import inspect

import pytest

from ogrpo import patches
from ogrpo.patches.target import PatchTargetMoved, version


def test_every_check_passes_on_the_installed_libraries():
    report = patches.run_checks()
    assert set(report) == set(patches.PATCHES)
    assert {name: r["detail"] for name, r in report.items() if r["status"] == "failed"} == {}
    assert report["typer_options"]["status"] == "ok"  # the CLI's own dependency is always here
    if patches.installed("trl") and patches.installed("vllm"):  # the CPU stack: every TRL patch applies here
        expected = {name: "ok" for name, (dist, _) in patches.PATCHES.items() if dist == "trl"}
        expected["trl_stream"] = "skipped"  # `trl vllm-serve`'s handler: TRL 1.9's client only (tests/trl19)
        assert {name: r["status"] for name, r in report.items() if r["library"] == "trl"} == expected
        assert "vLLM's API server" in report["trl_stream"]["detail"]


def _vllm_generation():
    from ogrpo import compat

    return compat.vllm_generation_module()


# patch -> (module path, attribute chain of the target to take away); "@gen" is TRL's generation module
MOVES = {
    "typer_options": ("typer.core", "_TyperParameter.get_runtime_param"),
    "vllm_completions": ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest.to_sampling_params"),
    "vllm_cpu_reload": ("vllm.model_executor.model_loader.reload", "finalize_layerwise_reload"),
    "trl_colocate_cpu": ("@gen", "VLLMGeneration.sync_weights"),
    "trl_linear_logprobs": ("trl", "GRPOTrainer._get_per_token_logps_and_entropies"),
    "transformers_fused_sample": ("transformers.generation.utils", "GenerationMixin._sample"),
    "trl_vllm_client": ("@gen", "VLLMClient.init_communicator"),
    "trl_vllm_serve": ("trl.scripts.vllm_serve", "make_parser"),
    "trl_stream": ("vllm", "LLM.enqueue"),  # TRL 1.9's line only: tests/trl19/test_trl19_patches.py
    "trl_overlap": ("trl.trainer.grpo_trainer", "GRPOTrainer._calculate_rewards"),
    "trl_trainer_overrides": ("trl.trainer.grpo_trainer", "GRPOTrainer._generate_and_score_completions"),
    "trl_vllm_wraps": ("@gen", "VLLMClient.reset_prefix_cache"),
    "trl_zero3_push": ("trl.distributed", "DistributedBackend.gather_params"),
    "starlette_job_key": ("starlette.applications", "Starlette.__call__"),
    "submitit_adapter": ("submitit.slurm.slurm", "_make_sbatch_string"),
}


def test_every_patch_has_a_move_test():
    assert set(MOVES) == set(patches.PATCHES)


@pytest.mark.parametrize("name", sorted(MOVES))
def test_check_fails_loudly_when_its_target_moves(name, monkeypatch):
    dist, _ = patches.PATCHES[name]
    for need in (dist, *patches.REQUIRES.get(name, ())):
        if not patches.installed(need):
            pytest.skip(f"{need} is not installed")
    why_not = getattr(patches.module(name), "not_applicable", lambda: None)()
    if why_not:
        pytest.skip(f"{name}: {why_not}")
    where, chain = MOVES[name]
    owner = _vllm_generation() if where == "@gen" else importlib.import_module(where)
    *parents, attr = chain.split(".")
    for part in parents:
        owner = getattr(owner, part)
    assert attr in vars(owner), f"{chain} is not defined where the test removes it"
    module = patches.module(name)
    module.check()  # passes while the target is there
    monkeypatch.delattr(owner, attr)
    with pytest.raises(PatchTargetMoved) as info:
        module.check()
    text = str(info.value)
    assert f"patch {name}" in text and f"{dist} {version(dist)}" in text and attr in text, text


# --- O-GRPO's stacked wrappers of one VLLMClient method: one stated order (ogrpo.patches.trl_vllm_wraps) ---------

class _Client:
    def generate(self, prompts):
        """TRL's request."""
        self.calls.append("trl")
        return prompts


def _layer(name, calls):
    def make(inner):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return inner(*args, **kwargs)
        return wrapper
    return make


def test_stacked_wrappers_go_on_in_the_stated_order_and_run_outermost_first():
    from ogrpo.patches import trl_vllm_wraps as wraps

    client = _Client()
    client.calls = []
    order = wraps.ORDER[("vllm_client", "generate")]
    assert order == ("overlap", "profiler")  # what the overlap pipeline and the profiler install
    for layer in order:
        wraps.wrap(client, "generate", layer, _layer(layer, client.calls), kind="vllm_client")
    assert wraps.layers(client, "generate") == order
    assert client.generate([7]) == [7]
    assert client.calls == [*reversed(order), "trl"]
    bound = client.generate  # TRL's name, docstring and signature kept through every layer
    assert bound.__name__ == "generate" and bound.__doc__ == "TRL's request."
    assert list(inspect.signature(bound).parameters) == ["prompts"]


def test_a_wrapper_installed_out_of_order_is_refused():
    from ogrpo.errors import OgrpoError
    from ogrpo.patches import trl_vllm_wraps as wraps

    client = _Client()
    client.calls = []
    wraps.wrap(client, "generate", "profiler", _layer("profiler", client.calls), kind="vllm_client")
    before = client.generate
    with pytest.raises(OgrpoError, match="overlap must wrap vllm_client.generate before profiler does"):
        wraps.wrap(client, "generate", "overlap", _layer("overlap", client.calls), kind="vllm_client")
    assert client.generate is before  # nothing installed
    with pytest.raises(OgrpoError, match="does not list"):  # every layer of every method is stated there
        wraps.wrap(client, "generate", "zero3_push", _layer("zero3_push", client.calls), kind="vllm_client")
    with pytest.raises(OgrpoError, match="does not list"):  # the trainer's own methods are its class's, not here
        wraps.wrap(client, "training_step", "profiler", _layer("profiler", client.calls), kind="trainer")
    with pytest.raises(PatchTargetMoved, match="has no reset_prefix_cache"):
        wraps.wrap(client, "reset_prefix_cache", "overlap", _layer("overlap", client.calls), kind="vllm_client")


def test_zero3_push_serves_the_gathered_copy_and_counts_trls_own_gathers():
    """ogrpo.patches.trl_zero3_push on a stand-in VLLMGeneration whose iterator gathers as TRL's does."""
    if not (patches.installed("trl") and patches.installed("vllm")):
        pytest.skip("trl and vllm are needed")
    import contextlib

    from ogrpo.patches import trl_zero3_push

    gathered = []

    class Backend:
        is_zero3 = True

        def gather_params(self, params):
            gathered.append(len(params))
            return contextlib.nullcontext()

    class Tensor:
        def __init__(self, name):
            self.name = name

        def to(self, device, non_blocking=False):
            return (self.name, device)

    class Generation:
        _weight_metadata = None

        def __init__(self):
            self._dist = Backend()

        def _fix_param_name_to_vllm(self, name):
            return f"vllm.{name}"

        def _iter_named_params(self):
            for name in ("a", "b"):
                with self._dist.gather_params([name]):
                    yield name, name

    vg, counted, copy = Generation(), [], {"params": None}
    assert trl_zero3_push.applies(vg) and trl_zero3_push.is_zero3(vg)
    gather = trl_zero3_push.install(vg, lambda: copy["params"], lambda: counted.append(1))
    assert list(vg._iter_named_params()) == [("a", "a"), ("b", "b")]  # first push (no metadata yet): TRL's
    assert counted == [1, 1] and gathered == [1, 1]
    assert vg._dist.gather_params.__func__ is Backend.gather_params  # the backend's own gather back after it
    vg._weight_metadata = ["fixed by the first push"]
    copy["params"] = [("vllm.a", Tensor("a"), "cuda:0")]
    assert list(vg._iter_named_params()) == [("vllm.a", ("a", "cuda:0"))]  # from the copy: no collective
    assert gathered == [1, 1] and counted == [1, 1]
    with gather("p"):
        pass
    assert gathered == [1, 1, 1] and counted == [1, 1]  # the caller's own gathers are not TRL's
    assert trl_zero3_push.vllm_name(vg, "a") == "vllm.a"
