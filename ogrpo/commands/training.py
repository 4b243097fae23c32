"""`ogrpo train` (owned by the training area). Imports the trainer only when the command runs."""
from __future__ import annotations

from typing import List, Optional

import typer


def train(
    config: str = typer.Option(..., "--config", "-c", help="Run config YAML or a built-in recipe name (tiny)."),
    output_dir: Optional[str] = typer.Option(None, "--output-dir", "-o",
                                             help="Run directory (default: runs/<config>-<time>)."),
    vllm_url: Optional[str] = typer.Option(None, "--vllm-url", help="vLLM server base URL (server mode)."),
    resume: Optional[str] = typer.Option(None, "--resume",
                                         help="'auto' (last complete checkpoint) or a checkpoint directory."),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="Plan for these GPUs when the config has no plan."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help="Override a run-config key: KEY=VALUE."),
) -> None:
    """Train with TRL's GRPOTrainer using the plan's settings; profile every step; write a run directory."""
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.train import parse_overrides
    from ogrpo.trainer.assembly import leave_process_group, train as run_train

    run_train(config, output_dir=output_dir, vllm_url=vllm_url, resume=resume,
              overrides=parse_overrides(overrides), gpus=gpus, own_process=True)
    leave_process_group()
