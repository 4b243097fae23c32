"""Run by tests/test_colocate_cpu.py in its own process (vLLM needs a __main__ guard and owns the process).

Builds vLLM in-process the way TRL's colocate mode does (external_launcher, fp32), changes the HF model's
weights with a few optimizer steps, pushes them with O-GRPO's CPU colocate sync, and prints JSON with the
greedy outputs of both engines before and after the push.
"""

import json
import os
import sys
from types import SimpleNamespace


def main(model_dir: str) -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:  # a free port: several test runs may share the machine
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from ogrpo import tiny
    from ogrpo.patches import trl_colocate_cpu as colocate_cpu

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.1, max_model_len=256,
              distributed_executor_backend="external_launcher", seed=0, max_num_batched_tokens=4096)
    prompts = [tiny.prompt_for(c) for c in tiny.LETTERS]
    ids = [tok(p)["input_ids"] for p in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)

    def vllm_out():
        outs = llm.generate([{"prompt_token_ids": i} for i in ids], greedy, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def hf_out():
        res = []
        for i in ids:
            x = torch.tensor([i])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=16,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            res.append(y[0, len(i):].tolist())
        return res

    before_vllm, before_hf = vllm_out(), hf_out()
    # Train the HF copy towards "always answer 'h'" so that greedy outputs change.
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    batch = tok([p + " hhhhhhhh" + tok.eos_token for p in prompts], return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    for _ in range(30):
        model(**batch, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    trained_hf = hf_out()
    stale_vllm = vllm_out()
    stand_in = SimpleNamespace(llm=llm, _iter_named_params=lambda: ((n, p.data) for n, p in model.named_parameters()))
    colocate_cpu.cpu_sync_weights(stand_in)
    pushed_vllm = vllm_out()
    print("RESULT " + json.dumps({"before_vllm": before_vllm, "before_hf": before_hf, "trained_hf": trained_hf,
                                  "stale_vllm": stale_vllm, "pushed_vllm": pushed_vllm,
                                  "decoded": tok.batch_decode(pushed_vllm, skip_special_tokens=True)}))


if __name__ == "__main__":
    main(sys.argv[1])
