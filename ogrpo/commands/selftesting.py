"""`ogrpo selftest` (ogrpo/checks/selftest.py does the work; imported only when the command runs)."""
from __future__ import annotations

from typing import Optional

import typer


def selftest(
    gpu: bool = typer.Option(False, "--gpu", help="The GPU checks (FA2, TF32, CUDA ops, NCCL push); exit 2 "
                                                  "without CUDA."),
    config: str = typer.Option("tiny", "--config", "-c", help="Run config (recipe or rendered run.yaml) whose "
                                                              "model and plan are checked."),
    model: Optional[str] = typer.Option(None, "--model", help="Check this model instead of the config's."),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="NxTYPE when this GPU is not in the catalog."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Report path (default: ./ogrpo-selftest-<time>"
                                                                 ".json)."),
    ds_ops: str = typer.Option("cpu_adam,fused_adam", "--ds-ops", help="DeepSpeed ops to load (comma list)."),
    jit_ops: bool = typer.Option(True, "--jit-ops/--no-jit-ops", help="JIT-build DeepSpeed ops that are not "
                                                                      "prebuilt (minutes on a small CPU)."),
    server: bool = typer.Option(True, "--server/--no-server", help="Start vLLM and push weights."),
) -> None:
    """Check this node against what the plan relies on; write one JSON report (attach it to bug reports).
    Exit 0 when nothing failed, 1 when a check failed, 2 on bad input (e.g. --gpu without CUDA)."""
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.checks.selftest import check_inputs, run_selftest, write_report

    ops = tuple(o.strip() for o in ds_ops.split(",") if o.strip())
    check_inputs(gpus, out, ops)  # bad input: one line and exit 2 now, not a failed check (or a lost report) later

    def progress(name: str, res: dict) -> None:
        typer.echo(f"{res['status']:4}  {name}: {res.get('detail', '')}  ({res.get('seconds', 0)} s)", err=True)

    report = run_selftest(config, gpu=gpu, gpus=gpus, model=model, ds_ops=ops, jit_ops=jit_ops, server=server,
                          progress=progress)
    path = write_report(report, out)
    typer.echo(str(path))
    raise typer.Exit(1 if report["status"] == "fail" else 0)
