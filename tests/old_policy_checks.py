"""The old policy from the loss forward against TRL's separate pass, in one process and on the installed TRL line
(TRL 1.16 in tests/test_old_policy.py, TRL 1.9.2 in tests/trl19/test_trl19_old_policy.py).

TRL runs its old-policy pass only for vLLM's importance-sampling correction, so the trainer here believes it talks
to a vLLM server: `ScriptedServer` stands in for TRL's VLLMGeneration (the one object TRL asks for completions and
their sampling log-probs). It answers with seeded completions of varying lengths, some cut at the cap, and with
sampling log-probs that are the current policy's own plus seeded noise, so the importance ratios spread and every
clipping and masking mode has something to clip. Everything TRL computes from there (advantages, the separate pass,
the ratios, masks, losses, its metrics) is TRL's own code."""

from __future__ import annotations

import math

import torch

from ogrpo import tiny

STEPS = 2
# every TRL loss type, each under another importance-sampling mode and a few of the options that change its masks
CASES = {
    "grpo-beta": dict(loss_type="grpo", beta=0.04),
    "dr_grpo": dict(loss_type="dr_grpo", vllm_importance_sampling_mode="token_truncate"),
    "dapo-masked": dict(loss_type="dapo", vllm_importance_sampling_mode="token_mask",
                        vllm_importance_sampling_clip_min=0.5, mask_truncated_completions=True),
    "bnpo": dict(loss_type="bnpo", vllm_importance_sampling_mode="sequence_truncate"),
    "cispo": dict(loss_type="cispo", vllm_importance_sampling_mode="token_truncate"),
    "sapo": dict(loss_type="sapo", vllm_importance_sampling_mode="token_mask",
                 vllm_importance_sampling_clip_min=0.5),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo", vllm_importance_sampling_mode="token_truncate"),
    # two micro-batches per generation (TRL shuffles the batch before splitting it), entropy-masked tokens
    "grpo-accumulated": dict(loss_type="grpo", gradient_accumulation_steps=2, steps_per_generation=2,
                             top_entropy_quantile=0.5),
}
TIMES = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos"}


class ScriptedServer:
    """TRL's VLLMGeneration as the trainer sees it: `sync_weights` and `generate`."""

    def __init__(self, trainer, max_len: int, seed: int = 0):
        self.trainer, self.max_len, self.seed, self.calls = trainer, max_len, seed, 0
        tok = trainer.processing_class
        self.eos = tok.eos_token_id
        special = set(tok.all_special_ids)
        self.tokens = torch.tensor([i for i in range(len(tok)) if i not in special])
        self.tok = tok
        self.scoring = False  # the server's own forward, not counted as one of the trainer's passes

    def sync_weights(self):
        pass

    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        g = torch.Generator().manual_seed(self.seed + self.calls)
        self.calls += 1
        completions, logprobs = [], []
        for prompt in prompts:
            n = int(torch.randint(1, self.max_len + 1, (1,), generator=g))
            # a share of the prompt's letter that differs per completion: the rewards differ within each group
            letter = self.tok.encode(tiny._letter_from_prompt(self.tok.decode(prompt)), add_special_tokens=False)
            pick = torch.rand(n, generator=g) < torch.rand(1, generator=g)
            ids = torch.where(pick, letter[0], self.tokens[torch.randint(len(self.tokens), (n,), generator=g)])
            ids = ids.tolist()
            if n < self.max_len or torch.rand(1, generator=g).item() < 0.5:
                ids[-1] = self.eos  # finished; the others are cut at the cap
            own = self._policy_logps(prompt, ids)
            noise = 0.4 * torch.randn(n, generator=g, dtype=torch.float64)
            completions.append(ids)
            logprobs.append([[float(x)] for x in (own + noise)])
        return prompts, completions, logprobs, None

    def _policy_logps(self, prompt, ids):
        model = self.trainer.model
        full = torch.tensor([list(prompt) + ids])
        self.scoring = True
        try:
            with torch.no_grad():
                logits = model(input_ids=full).logits[0, len(prompt) - 1:-1].double()
        finally:
            self.scoring = False
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]


def run(out_dir, case: str, from_loss: bool):
    """Trains STEPS steps of the tiny task; returns (log rows, final parameters, no-grad policy forwards)."""
    from trl import GRPOConfig

    from ogrpo.trainer.grpo import OgrpoGRPOTrainer

    keys = dict(CASES[case])
    max_len = 10
    args = GRPOConfig(output_dir=str(out_dir), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=max_len, max_steps=STEPS, learning_rate=5e-3, logging_steps=1,
                      report_to="none", save_strategy="no", seed=7, use_cpu=True, bf16=False, use_vllm=False,
                      vllm_importance_sampling_correction=True, dataloader_num_workers=0, **keys)
    torch.manual_seed(0)
    trainer = OgrpoGRPOTrainer(model=str(tiny.ensure_tiny_model()), reward_funcs=tiny.letter_reward, args=args,
                               train_dataset=tiny.toy_dataset(64))
    server = ScriptedServer(trainer, max_len)
    # what TRL's __init__ sets up for use_vllm=True, the server's client aside
    trainer.use_vllm, trainer.vllm_mode, trainer._last_loaded_step = True, "server", -1
    trainer.vllm_generation = server
    if from_loss:
        assert trainer.old_policy_from_loss() is None
    forwards = []
    trainer.model.register_forward_pre_hook(
        lambda *_: forwards.append(1) if not torch.is_grad_enabled() and not server.scoring else None)
    trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r]
    params = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    return rows, params, len(forwards)


def assert_same_training(tmp_path, case: str) -> dict:
    """from_loss trains exactly as TRL's separate pass: every logged value (losses, rewards, grad norm, TRL's
    sampling/* statistics, clip ratios, entropy) and the final weights; with no old-policy forward left."""
    rows = {}
    for kind in ("separate", "from_loss"):
        rows[kind] = run(tmp_path / kind, case, from_loss=kind == "from_loss")
    (a, pa, fa), (b, pb, fb) = rows["separate"], rows["from_loss"]
    assert len(a) == len(b) == STEPS
    assert all(x["reward_std"] > 0 for x in a), a  # advantages to train on in every step
    sampling = sorted(k for k in a[0] if k.startswith("sampling/"))
    assert len(sampling) == 5, a[0]
    for x, y in zip(a, b):
        assert x.keys() == y.keys(), (x.keys() ^ y.keys())
        for key in x.keys() - TIMES:
            if isinstance(x[key], float) and not math.isnan(x[key]):
                assert math.isclose(y[key], x[key], rel_tol=1e-5, abs_tol=1e-6), (case, x["step"], key, x[key],
                                                                                     y[key])
            elif isinstance(x[key], float):
                assert math.isnan(y[key]), (case, key)
            else:
                assert y[key] == x[key], (case, key)
    for name, value in pa.items():
        assert torch.allclose(pb[name], value, rtol=1e-5, atol=1e-6), (case, name)
    # the ratios spread (so a ratio taken from anything but the old policy's log-probs would show)
    assert any(x["sampling/importance_sampling_ratio/min"] < x["sampling/importance_sampling_ratio/max"] for x in a)
    # TRL's pass ran once per generation batch (per micro-batch chunk), the loss forward's replaced all of them
    assert fa >= STEPS and fb == 0, (case, fa, fb)
    return {"separate": a, "from_loss": b}
