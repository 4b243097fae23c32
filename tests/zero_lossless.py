"""Groups trained ahead under DeepSpeed ZeRO (ogrpo/overlap/deepspeed_ahead.py) against TRL's own micro-batches, on
the installed TRL line (tests/test_train_ahead.py, tests/trl19/test_trl19_lossless.py).

Each run of tests/lossless_checks.py's tiny task goes in a process of its own (DeepSpeed takes a one-process gloo
group, which must not outlive the run): `python tests/zero_lossless.py STAGE CASE MODE OUT.json`. MODE: `trl`
(TRL's own passes), `ahead` (groups streamed and trained as they arrive, ogrpo/overlap/train_ahead.py), `completions`
(the same, each completion's passes and loss forward as it ends), `fallback` (groups, with every group's advantages
off by 1, so TRL's batch differs from what the groups trained on and their gradients must be dropped). Writes the
logged rows, the fallbacks and the engine's stage."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def zero_config(stage: int, recipe_path: Path) -> dict:
    """The deepspeed.json the plan renders for a one-process CPU run of the tiny recipe under ZeRO-`stage`."""
    import yaml

    from ogrpo.config import load_run_config
    from ogrpo.plan import plan_from_config
    from ogrpo.render import deepspeed_config

    recipe = yaml.safe_load((HERE.parent / "ogrpo" / "recipes" / "tiny.yaml").read_text())
    recipe["ogrpo"].update({"gpus": "cpu", "strategy": f"zero{stage}"})
    recipe_path.write_text(yaml.safe_dump(recipe))
    return deepspeed_config(plan_from_config(load_run_config(str(recipe_path))))


def main(stage: int, case: str, mode: str, out: str) -> None:
    import torch

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", "29533"), "DS_ACCELERATOR": "cpu"})
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    import lossless_checks
    from ogrpo.overlap import train_ahead

    if mode == "fallback":
        real = train_ahead.advantages
        train_ahead.advantages = lambda *a: real(*a) + 1.0
    try:
        rows, _, _, trainer = lossless_checks.run(out + ".run", case, from_loss=mode != "trl", ahead=mode != "trl",
                                                  completions=mode == "completions",
                                                  deepspeed=zero_config(stage, Path(out + ".recipe.yaml")))
        engine = trainer.accelerator.deepspeed_engine_wrapped.engine
        result = {"rows": rows, "stage": engine.zero_optimization_stage(),
                  "fallbacks": trainer.overlap.train_ahead_fallbacks if trainer.overlap is not None else None}
    finally:
        torch.distributed.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)


def run_in_process(tmp_path, stage: int, case: str, mode: str) -> dict:
    """This file's run in a process of its own; its result, once it and anything it started are gone."""
    import pytest

    from ogrpo.launch.ports import free_ports, release_ports

    pytest.importorskip("deepspeed")
    out = tmp_path / f"zero{stage}-{case}-{mode}.json"
    port = free_ports(1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "MASTER_PORT": str(port[0])}
    proc = subprocess.Popen([sys.executable, __file__, str(stage), case, mode, str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=600)
    finally:
        release_ports(port)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    survivors = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert survivors == [], survivors  # its session (it led one) is empty: nothing it started is left
    return json.loads(out.read_text())


def assert_trained_ahead_as_trl(tmp_path, stage: int, case: str = "dapo-chunked") -> None:
    """Under ZeRO-`stage`, groups trained ahead (dapo-chunked: chunks of 2 rows, 4 micro-batches a step, the batch's
    token count dividing the gradients at the step), their completions' forwards run as each ends or not, give
    TRL's losses, grad norms and metrics; with TRL's batch other than what they trained on, their gradients are
    dropped and TRL's micro-batches give them alone."""
    from overlap_jobs import PACKED

    runs = {mode: run_in_process(tmp_path, stage, case, mode) for mode in ("trl", "ahead", "completions", "fallback")}
    assert {r["stage"] for r in runs.values()} == {stage}
    theirs = runs["trl"]["rows"]
    assert len(theirs) == 2 and all(r["grad_norm"] > 0 for r in theirs)
    for mode, trained in (("ahead", 2.0), ("completions", 2.0), ("fallback", 0.0)):
        ours = runs[mode]["rows"]
        assert [r["overlap/trained_ahead"] for r in ours] == [trained, trained], (mode, ours)
        # the groups' chunks sum in another order than TRL's micro-batches (fp32 noise, which the step's large
        # update carries into step 2: tests/lossless_checks.py's bar); dropped, TRL's micro-batches train alone
        rel, abs_ = (PACKED["rel"], PACKED["abs"]) if mode != "fallback" else (1e-5, 1e-6)
        for x, y in zip(theirs, ours):
            for key in ("loss", "grad_norm", "reward", "entropy", "kl", "sampling/importance_sampling_ratio/mean"):
                assert math.isclose(y[key], x[key], rel_tol=rel, abs_tol=abs_), (mode, x["step"], key, x[key], y[key])
    # forwards held until their group's backward; no completion's backward before its group is whole under
    # DeepSpeed (the engine reduces each backward into its partitions)
    assert all(r["overlap/forwarded_early"] >= 1 and r["overlap/backward_early"] == 0
               for r in runs["completions"]["rows"]), runs["completions"]["rows"]
    assert runs["ahead"]["fallbacks"] == runs["completions"]["fallbacks"] == []
    assert len(runs["fallback"]["fallbacks"]) == 2 and all("differs" in w for w in runs["fallback"]["fallbacks"])


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
    # the result is written: skip the interpreter's teardown, where a thread DeepSpeed or gloo left running aborted
    # the process once in CI ("terminate called without an active exception", torch 2.10)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
