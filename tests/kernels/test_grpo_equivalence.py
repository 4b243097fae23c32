"""GRPO with linear_logprobs wired into TRL's GRPOTrainer equals GRPO without it (tiny model, CPU, fp32).

- end to end (~40 s on 2 busy cores): the same seeded 3-step run with and without the patch logs the same loss,
  reward, KL and entropy;
- the scoring method itself against TRL's own on padded batches (values, masking, gradients), and against
  TRL 1.9.2's full-logits semantics (written out below from its source, since 1.9.2 cannot be installed here);
- the self-check: a moved/changed TRL method is an OgrpoError; an unsupported head leaves TRL's path in place.
"""

from __future__ import annotations

import functools

import pytest

# torch and TRL are part of the test environment (.venv, the train extra): their absence is a failure, not a skip.
import torch  # noqa: E402
import trl  # noqa: E402,F401

from ogrpo.errors import OgrpoError  # noqa: E402
from ogrpo.kernels.linear_logprobs import op  # noqa: E402
from ogrpo.patches import trl_linear_logprobs as trl_patch  # noqa: E402

KEYS = ("loss", "reward", "kl", "entropy", "completions/mean_length")
OVERRIDES = {"max_steps": 3, "save_strategy": "no", "temperature": 0.8, "per_device_train_batch_size": 16,
             "num_iterations": 2, "logging_steps": 1}


def _trainer(tmp_path, name, **overrides):
    from ogrpo.trainer.assembly import build_trainer, prepare

    p = prepare("tiny", output_dir=tmp_path / name, overrides={**OVERRIDES, **overrides})
    return build_trainer(p)


def _logged(trainer) -> list[dict]:
    return [{k: r[k] for k in KEYS if k in r} for r in trainer.state.log_history if "loss" in r]


@pytest.mark.slow
def test_seeded_grpo_run_is_the_same_with_and_without_the_kernel(tmp_path):
    plain = _trainer(tmp_path, "plain")
    plain.train()
    patched = _trainer(tmp_path, "patched")
    result = patched.use_linear_logprobs()
    assert result == {"installed": True, "trl_line": "fused", "models": {"policy": True, "reference": True},
                      "reason": None, "implementation": {"impl": "compiled", "reason": op.STATUS["cpu"]["reason"]}}
    patched.train()
    calls = patched.logprobs_scorer.calls
    # per step: the loss pass; per generation: old-policy (num_iterations=2) and reference (beta > 0) passes
    assert calls["kernel"] >= 3 + 2 and calls["trl"] == 0, calls
    assert op.STATUS["cpu"]["impl"] == "compiled", op.STATUS
    a, b = _logged(plain), _logged(patched)
    assert len(a) == len(b) == 3
    assert len({row["loss"] for row in a}) > 1  # not trivially constant
    assert sum("reward" in row for row in a) == 2  # steps 1 and 3 generate (num_iterations=2), step 2 reuses
    for step, (x, y) in enumerate(zip(a, b), start=1):
        assert x.keys() == y.keys(), step
        for key in ("reward", "completions/mean_length"):  # same completions, same rewards: exactly
            assert x.get(key) == y.get(key), (step, key, x, y)
        # fp32 on CPU; measured differences ~5e-8 (loss), ~1e-6 (kl, entropy)
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-6), (step, x, y)
        assert y["kl"] == pytest.approx(x["kl"], rel=1e-4, abs=1e-6), (step, x, y)
        assert y["entropy"] == pytest.approx(x["entropy"], rel=1e-5, abs=1e-5), (step, x, y)


@pytest.fixture(scope="module")
def scoring(tmp_path_factory):
    """A trainer, its TRL scoring method before the patch, and a padded batch like GRPO's."""
    trainer = _trainer(tmp_path_factory.mktemp("scoring"), "run")
    original = functools.partial(trl.GRPOTrainer._get_per_token_logps_and_entropies, trainer)  # TRL's own
    assert trainer.use_linear_logprobs()["installed"]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 384, (5, 14), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding of a prompt
    mask[1, -4:] = 0  # a completion that ended early (right padding)
    mask[2, -1:] = 0
    return trainer, original, ids, mask


def _run(fn, trainer, ids, mask, keep=6, batch_size=2):
    trainer.model.zero_grad(set_to_none=True)
    logps, ents, aux = fn(trainer.model, ids, mask, keep, batch_size=batch_size, compute_entropy=True)
    gen = torch.Generator().manual_seed(1)
    (logps * torch.randn(logps.shape, generator=gen)).sum().add((ents * torch.rand(ents.shape, generator=gen))
                                                                 .sum()).backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return logps.detach(), ents.detach(), aux, grads


def test_scoring_matches_trls_own_method_on_padded_batches(scoring):
    trainer, original, ids, mask = scoring
    calls = dict(trainer.logprobs_scorer.calls)
    got = _run(trainer._get_per_token_logps_and_entropies, trainer, ids, mask)
    want = _run(original, trainer, ids, mask)
    assert trainer.logprobs_scorer.calls["kernel"] == calls["kernel"] + 1
    assert got[0].shape == want[0].shape == (5, 6) and got[2] is None and want[2] is None
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=2e-5, rtol=1e-5)
    assert (got[0][1, -4:] == 0).all() and (got[1][1, -4:] == 0).all()  # masked like TRL's label -100
    assert got[3].keys() == want[3].keys() and "model.embed_tokens.weight" in got[3]  # tied head: one parameter
    for name, g in want[3].items():
        torch.testing.assert_close(got[3][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_scoring_without_entropy_and_fallback_for_aux_loss(scoring):
    trainer, _, ids, mask = scoring
    with torch.no_grad():
        logps, ents, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 4)
    assert logps.shape == (5, 4) and ents is None
    before = dict(trainer.logprobs_scorer.calls)
    # the aux loss is TRL's business: its own path runs (and, Qwen2 having no router, fails in TRL's code)
    with pytest.raises(AttributeError, match="num_experts"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 4, compute_aux_loss=True)
    assert trainer.logprobs_scorer.calls["trl"] == before["trl"] + 1


def test_logits_line_keeps_trl_1_9_semantics(scoring):
    """TRL 1.9.2 (GPU images): logits[:, :-1][:, -k:] / T, selective_log_softmax, entropy_from_logits under
    no_grad (no entropy bonus), nothing masked. Its steps are written out here from its source."""
    trainer, _, ids, mask = scoring
    keep = 6
    model = trainer.model
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1][:, -keep:] / 0.8
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    want_logps = logp_all.gather(-1, ids[:, -keep:, None]).squeeze(-1)
    want_ents = -(logp_all.exp() * logp_all).sum(-1)
    logps, ents, aux = trl_patch._scored(trainer, "logits", model, ids, mask, keep, 2, True)
    torch.testing.assert_close(logps, want_logps, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ents, want_ents, atol=2e-5, rtol=1e-5)
    assert logps[1, -1] != 0  # padded positions are scored, not zeroed, on this line
    assert logps.requires_grad and not ents.requires_grad and aux is None


def test_a_changed_trl_method_fails_loudly():
    from trl import GRPOTrainer

    class Removed(GRPOTrainer):
        _get_per_token_logps_and_entropies = None  # as if TRL renamed it

    with pytest.raises(OgrpoError, match="Removed has no _get_per_token_logps_and_entropies"):
        trl_patch.check_trl_method(Removed)

    class Changed(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, inputs, compute_entropy=False):
            return None

    with pytest.raises(OgrpoError, match="changed its signature"):
        trl_patch.check_trl_method(Changed)

    class NewOption(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                               pixel_values=None, chunked=True):
            return None

    with pytest.raises(OgrpoError, match="changed its signature"):
        trl_patch.check_trl_method(NewOption)
    assert trl_patch.check_trl_method(GRPOTrainer) == "fused"


def test_unsupported_heads_are_left_to_trl():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ogrpo import tiny

    cfg = {k: v for k, v in tiny.model_config().items() if k not in ("model_type", "architectures", "torch_dtype")}
    model = Qwen2ForCausalLM(Qwen2Config(**{**cfg, "tie_word_embeddings": False}))
    assert trl_patch.unsupported_reason(model) is None
    model.lm_head = torch.nn.Linear(128, 384, bias=True)
    assert trl_patch.unsupported_reason(model) == "lm_head has a bias"
    model.lm_head = torch.nn.Linear(128, 384, bias=False)
    model.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping" in trl_patch.unsupported_reason(model)
    forward = model.forward
    assert trl_patch._patch_forward(model) is False and model.forward == forward  # untouched
