"""One run of tests/lossless_checks.py's tiny task under DeepSpeed ZeRO in a process of its own (DeepSpeed takes a
one-process gloo group, which must not outlive the run): `python tests/zero_lossless.py STAGE CASE MODE OUT.json`.
MODE: `trl` (TRL's own passes), `ahead` (groups streamed and trained as they arrive, ogrpo/overlap/train_ahead.py),
`fallback` (the same, with every group's advantages off by 1, so TRL's batch differs from what the groups trained
on and their gradients must be dropped). Writes the logged rows, the fallbacks and the engine's stage."""

from __future__ import annotations

import json
import os
import sys


def zero_config(stage: int) -> dict:
    """The CPU deepspeed.json the plan renders for a ZeRO strategy (ogrpo.render.deepspeed_config)."""
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto")
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_optimization": zero,
            "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}


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
                                                  deepspeed=zero_config(stage))
        engine = trainer.accelerator.deepspeed_engine_wrapped.engine
        result = {"rows": rows, "stage": engine.zero_optimization_stage(),
                  "fallbacks": trainer.overlap.train_ahead_fallbacks if trainer.overlap is not None else None}
    finally:
        torch.distributed.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
