"""A minimal server-mode GRPO trainer for the integration tests (run under `accelerate launch`).

Stands in for `python -m ogrpo.train` so the serving tests depend only on TRL, vLLM and ogrpo.serve:
TRL's GRPOTrainer with use_vllm=True, vllm_mode="server", and ogrpo's CPU weight-sync client.
Usage: serve_grpo_script.py MODEL_DIR SERVER_URL OUTPUT_DIR MAX_STEPS
"""

import json
import sys
from pathlib import Path


def main() -> None:
    model_dir, url, out, steps = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    from ogrpo.serve.client import install_cpu_client

    install_cpu_client({"model": model_dir, "dtype": "float32", "min_max_model_len": 48})

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    prompts = [f"{a} + {b} =" for a in range(8) for b in range(8)]
    dataset = Dataset.from_list([{"prompt": p} for p in prompts])

    def reward_digits(completions, **kwargs):
        return [sum(ch.isdigit() for ch in c) / 8.0 for c in completions]

    class JsonlMetrics(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs:
                out.mkdir(parents=True, exist_ok=True)
                with open(out / "metrics.jsonl", "a") as f:
                    f.write(json.dumps({"step": state.global_step, "world_size": args.world_size, **logs}) + "\n")

    config = GRPOConfig(
        output_dir=str(out), use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
        vllm_server_timeout=600, per_device_train_batch_size=4, num_generations=4, max_completion_length=16,
        max_steps=steps, learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
        save_strategy="no", seed=0, model_init_kwargs={"dtype": "float32"}, temperature=1.0,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward_digits, args=config, train_dataset=dataset,
                          callbacks=[JsonlMetrics()])
    trainer.train()


if __name__ == "__main__":
    main()
