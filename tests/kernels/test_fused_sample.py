"""fused_sample against transformers' logits-processor chain: exact greedy, equal distributions (chi-square over
seeded draws), the top-k/top-p boundaries, reproducibility, opcheck, the first-use check's fallback, and the
`generate` hook on the tiny model."""

from __future__ import annotations

import math
import warnings

import pytest

# torch is part of the test environment (.venv, the train extra): its absence is a failure, not a skip.
import torch  # noqa: E402

from ogrpo.errors import OgrpoError  # noqa: E402
from ogrpo.kernels.fused_sample import fused_sample, fused_sample_reference, implementation, op  # noqa: E402
from ogrpo.kernels.fused_sample.reference import (  # noqa: E402
    fused_sample_from_uniforms,
    processed_scores,
)

# (temperature, top_k, top_p, repetition_penalty): each step alone, all together, and the boundaries.
SETTINGS = [
    (1.0, 0, 1.0, 1.0),
    (0.7, 0, 1.0, 1.3),
    (1.5, 7, 1.0, 1.0),
    (1.0, 0, 0.8, 1.0),
    (0.8, 20, 0.9, 1.2),
    (1.2, 3, 0.5, 0.8),  # penalty < 1 rewards repeats
]


@pytest.fixture(scope="module")
def compiled():
    """The verified CPU extension (building it once, ~1 min on 2 cores, cached afterwards)."""
    op.reset()
    ext = op.extension("cpu")
    assert ext is not None, op.STATUS["cpu"]
    return ext


def _logits(rows: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _previous(rows: int, vocab: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper chi-square quantile by Wilson-Hilferty; z=3.719 is the normal's 1e-4 upper tail, so a correct
    sampler fails one setting in 10,000 runs."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def _assert_distribution(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    """`tokens` (draws from one row) follow `probs` (the reference's [V] probabilities): tokens of zero
    probability never occur, and the chi-square statistic over bins (expected >= 5, the rest pooled) passes."""
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    probs = probs.double()
    assert counts[probs == 0].sum() == 0, "sampled a filtered token"
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    df = obs.numel() - 1
    if df == 0:
        assert obs.sum() == n
        return
    stat = float(((obs - exp) ** 2 / exp).sum())
    assert stat < _chi2_critical(df), (stat, df, _chi2_critical(df))


# --- the reference is transformers' chain --------------------------------------------------------------------


@pytest.mark.parametrize("setting", SETTINGS)
def test_reference_scores_equal_transformers_processors(setting):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    temperature, top_k, top_p, penalty = setting
    chain = LogitsProcessorList()
    if penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(penalty))
    if temperature != 1.0:
        chain.append(TemperatureLogitsWarper(temperature))
    if top_k:
        chain.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        chain.append(TopPLogitsWarper(top_p))
    logits, previous = _logits(5, 301, 1), _previous(5, 301, 40, 2)
    want = chain(previous, logits.clone())
    got = processed_scores(logits, temperature, top_k, top_p, penalty, previous)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)], rtol=0, atol=0)


# --- greedy --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (1, 151_936), (13, 257), (64, 1000)])
def test_greedy_is_argmax(compiled, dtype, shape):
    rows, vocab = shape
    logits = _logits(rows, vocab, 3).to(dtype)
    got = fused_sample(logits, 0.0, 0, 1.0, 1.0, None, None, impl="compiled")
    assert torch.equal(got, torch.argmax(logits.float(), dim=-1))


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_greedy_with_penalty_is_argmax_of_penalized(compiled, penalty):
    logits, previous = _logits(33, 509, 4), _previous(33, 509, 60, 5)
    previous[:, 0] = logits.argmax(-1)  # the penalty must be able to move the argmax
    got = fused_sample(logits, 0.0, 0, 1.0, penalty, previous, None, impl="compiled")
    want = fused_sample_reference(logits, 0.0, 0, 1.0, penalty, previous, None)
    assert torch.equal(got, want)
    if penalty > 1:
        assert not torch.equal(got, logits.argmax(-1))


def test_penalty_ignores_padding_and_out_of_vocab_ids(compiled):
    logits = _logits(4, 50, 6)
    previous = torch.tensor([[-1, -1, 3], [50, 51, 4], [1000, -7, 5], [-1, 60, 99]])
    want = fused_sample_reference(logits, 0.0, 0, 1.0, 5.0, previous, None)
    assert torch.equal(fused_sample(logits, 0.0, 0, 1.0, 5.0, previous, None, impl="compiled"), want)


# --- sampled tokens ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("shape", [(1, 3), (17, 1000), (3, 151_936)])
def test_same_uniforms_same_tokens_as_reference(compiled, dtype, setting, shape):
    """With the same uniforms the kernel and the reference's inverse CDF pick the same tokens (or, when rounding
    puts u on a CDF step, a neighbour whose slice of the CDF contains u within 1e-5)."""
    rows, vocab = shape
    logits, previous = _logits(rows, vocab, 7).to(dtype), _previous(rows, vocab, 25, 8)
    uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    got = compiled.fused_sample(logits, previous, uniforms, *setting)
    want = fused_sample_from_uniforms(logits, previous, uniforms, *setting)
    if not torch.equal(got, want):
        probs = processed_scores(logits, *setting, previous).softmax(-1).double()
        cdf = probs.cumsum(-1) / probs.sum(-1, keepdim=True)
        hi = cdf.gather(1, got[:, None]).squeeze(1)
        lo = hi - probs.gather(1, got[:, None]).squeeze(1)
        assert ((uniforms >= lo - 1e-5) & (uniforms <= hi + 1e-5)).all(), (got, want)


@pytest.mark.parametrize("top_p", [0.999999, 0.3])
def test_top_p_with_widely_spread_logits(compiled, top_p):
    """Logits spread over ~130 nats: most of the vocabulary shares the CPU histogram's overflow bucket (past
    max - 24), the boundary sits among a few dozen tokens near the max. (A boundary inside the overflow bucket
    would need 1 - top_p below V * exp(-24) = 6e-6, under fp32's resolution of the cumulative mass.)"""
    rows, vocab = 4, 151_936
    logits = _logits(rows, vocab, 30, scale=15.0)
    uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(31), dtype=torch.float64)
    got = compiled.fused_sample(logits, None, uniforms, 1.0, 0, top_p, 1.0)
    assert torch.equal(got, fused_sample_from_uniforms(logits, None, uniforms, 1.0, 0, top_p, 1.0))


@pytest.mark.parametrize("setting", SETTINGS)
def test_sampled_distribution_matches_reference(compiled, setting):
    """20,000 draws of one row (V=50) from the kernel follow the reference's probabilities; the reference's own
    torch.multinomial draws pass the same test (so the test itself is sound)."""
    draws, vocab = 20_000, 50
    logits = _logits(1, vocab, 10).expand(draws, vocab).contiguous()
    previous = _previous(1, vocab, 8, 11).expand(draws, 8)
    probs = processed_scores(logits[:1], *setting, previous[:1]).softmax(-1)[0]
    gen = torch.Generator().manual_seed(12)
    _assert_distribution(fused_sample(logits, *setting, previous, gen, impl="compiled"), probs)
    _assert_distribution(fused_sample_reference(logits, *setting, previous, gen), probs)


@pytest.mark.parametrize("setting", [(1.0, 0, 1e-6, 1.0), (0.5, 1, 1.0, 1.0), (2.0, 0, 0.0, 1.3)])
def test_top_p_tiny_and_top_k_one_are_argmax(compiled, setting):
    logits, previous = _logits(300, 77, 13), _previous(300, 77, 10, 14)
    got = fused_sample(logits, *setting, previous, torch.Generator().manual_seed(1), impl="compiled")
    assert torch.equal(got, fused_sample_reference(logits, 0.0, 0, 1.0, setting[3], previous, None))


def test_all_equal_logits(compiled):
    draws, vocab = 20_000, 50
    logits = torch.zeros(draws, vocab)
    gen = torch.Generator().manual_seed(15)
    # top-k keeps every token tied with the k-th: all 50, uniformly
    _assert_distribution(fused_sample(logits, 1.0, 10, 1.0, 1.0, None, gen, impl="compiled"),
                         torch.full((vocab,), 1 / vocab))
    # top-p 0.5 keeps 25 of 50 tied tokens (which ones transformers keeps depends on torch.sort's order for ties;
    # ours: the lowest ids, as argmax prefers), uniformly
    tokens = fused_sample(logits, 1.0, 0, 0.5, 1.0, None, gen, impl="compiled")
    kept_by_reference = int(torch.isfinite(processed_scores(logits[:1], 1.0, 0, 0.5, 1.0, None)).sum())
    assert kept_by_reference == 25
    assert tokens.unique().tolist() == list(range(25))
    _assert_distribution(tokens, torch.cat([torch.full((25,), 1 / 25), torch.zeros(25)]))


@pytest.mark.parametrize("top_k", [0, 40])
def test_minus_inf_logits_are_never_sampled(compiled, top_k):
    draws, vocab = 20_000, 50
    logits = _logits(1, vocab, 16).expand(draws, vocab).contiguous()
    logits[:, ::3] = -float("inf")
    probs = processed_scores(logits[:1], 1.0, top_k, 1.0, 1.0, None).softmax(-1)[0]
    tokens = fused_sample(logits, 1.0, top_k, 1.0, 1.0, None, torch.Generator().manual_seed(17), impl="compiled")
    assert (tokens % 3 != 0).all()
    _assert_distribution(tokens, probs)


def test_same_seed_same_tokens(compiled):
    logits, previous = _logits(64, 2003, 18), _previous(64, 2003, 30, 19)

    def draw(seed):
        return fused_sample(logits, 0.9, 0, 0.95, 1.1, previous, torch.Generator().manual_seed(seed))

    assert torch.equal(draw(5), draw(5))
    assert not torch.equal(draw(5), draw(6))
    torch.manual_seed(3)
    first = fused_sample(logits, 0.9, 50, 1.0, 1.0, previous, None)
    torch.manual_seed(3)
    assert torch.equal(first, fused_sample(logits, 0.9, 50, 1.0, 1.0, previous, None))


# --- custom op, first-use check, errors ----------------------------------------------------------------------


@pytest.mark.parametrize("setting", [(0.0, 0, 1.0, 1.2), (0.8, 20, 0.9, 1.2), (1.0, 0, 0.7, 1.0)])
@pytest.mark.parametrize("with_previous", [True, False])
def test_opcheck(compiled, setting, with_previous):
    logits = _logits(5, 131, 20)
    previous = _previous(5, 131, 9, 21) if with_previous else None
    uniforms = torch.rand(5, dtype=torch.float64, generator=torch.Generator().manual_seed(22))
    temperature, top_k, top_p, penalty = setting
    torch.library.opcheck(torch.ops.ogrpo.fused_sample.default,
                          (logits, previous, uniforms, temperature, top_k, top_p, penalty))


def test_implementation_reports_compiled(compiled):
    status = implementation("cpu")
    assert status == {"impl": "compiled", "reason": "built and matched the reference on first use"}


def test_mismatching_kernel_falls_back_with_one_warning(compiled, monkeypatch):
    class Wrong:  # the real kernel, off by one token
        @staticmethod
        def fused_sample(logits, *args):
            return (compiled.fused_sample(logits, *args) + 1) % logits.shape[1]

    monkeypatch.setattr(op, "_load", lambda device: Wrong)
    op.reset()
    logits = _logits(8, 300, 23)
    try:
        with pytest.warns(UserWarning, match="disagrees with the reference"):
            got = fused_sample(logits, 0.0, 0, 1.0, 1.0, None, None)
        assert op.STATUS["cpu"]["impl"] == "reference"
        assert "disagrees" in implementation("cpu")["reason"]
        assert torch.equal(got, logits.argmax(-1))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process, not per call
            fused_sample(logits, 1.0, 0, 1.0, 1.0, None, None)
        with pytest.raises(OgrpoError, match="not available on cpu"):
            fused_sample(logits, 1.0, 0, 1.0, 1.0, None, None, impl="compiled")
    finally:
        op.reset()


def test_unbuildable_extension_falls_back(monkeypatch):
    def no_compiler(device):
        raise RuntimeError("Error building extension\nc++: not found")

    monkeypatch.setattr(op, "_load", no_compiler)
    op.reset()
    try:
        with pytest.warns(UserWarning, match="could not be built"):
            status = implementation("cpu")
        assert status == {"impl": "reference", "reason": "extension could not be built: c++: not found"}
        logits = _logits(6, 90, 24)
        uniforms_gen, op_gen = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
        uniforms = torch.rand(6, generator=uniforms_gen, dtype=torch.float64)
        assert torch.equal(fused_sample(logits, 0.9, 5, 0.9, 1.0, None, op_gen),
                           fused_sample_from_uniforms(logits, None, uniforms, 0.9, 5, 0.9, 1.0))
    finally:
        op.reset()


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1.0}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"top_p": 1.5}, "top_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"impl": "fast"}, "impl"),
    ({"previous_tokens": torch.zeros(3, 4)}, "previous_tokens"), ({"logits": torch.zeros(2, 3, 4)}, "logits"),
])
def test_bad_arguments_raise_ogrpo_error(kwargs, message):
    args = {"logits": torch.zeros(2, 10), "temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0,
            "previous_tokens": None, "generator": None, **kwargs}
    impl = args.pop("impl", "auto")
    with pytest.raises(OgrpoError, match=message):
        fused_sample(**args, impl=impl)


# --- the generate hook ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ogrpo.tiny import ensure_tiny_model, prompt_for

    path = ensure_tiny_model()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    batch = tok([prompt_for("c"), prompt_for("f") + " and more", prompt_for("a")], return_tensors="pt",
                padding=True)
    return model, batch, tok


def _generate(model, batch, tok, **kwargs):
    with torch.no_grad():
        return model.generate(**batch, max_new_tokens=24, pad_token_id=tok.pad_token_id, **kwargs)


@pytest.mark.parametrize("kwargs", [{"do_sample": False}, {"do_sample": False, "repetition_penalty": 1.5}])
def test_patched_greedy_generate_is_unchanged(compiled, tiny, kwargs):
    from ogrpo.patches import transformers_fused_sample as generate_patch

    model, batch, tok = tiny
    want = _generate(model, batch, tok, **kwargs)
    generate_patch.install(model)
    try:
        calls = []
        original = generate_patch.FusedSampler.__call__
        spy = lambda self, ids, scores: calls.append(1) or original(self, ids, scores)  # noqa: E731
        generate_patch.FusedSampler.__call__ = spy
        try:
            got = _generate(model, batch, tok, **kwargs)
        finally:
            generate_patch.FusedSampler.__call__ = original
    finally:
        generate_patch.uninstall(model)
    assert torch.equal(got, want)
    assert bool(calls) == ("repetition_penalty" in kwargs)  # plain greedy is left to transformers' argmax


def test_patched_sampling_generate_uses_fused_sample(compiled, tiny):
    from ogrpo.patches import transformers_fused_sample as generate_patch

    model, batch, tok = tiny
    settings = {"do_sample": True, "temperature": 0.9, "top_k": 30, "top_p": 0.95, "repetition_penalty": 1.1}
    generate_patch.install(model)
    try:
        calls = []
        original = generate_patch.FusedSampler.__call__
        generate_patch.FusedSampler.__call__ = lambda self, ids, s: calls.append(vars(self)) or original(self, ids, s)
        try:
            torch.manual_seed(0)
            first = _generate(model, batch, tok, **settings)
            torch.manual_seed(0)
            again = _generate(model, batch, tok, **settings)
        finally:
            generate_patch.FusedSampler.__call__ = original
    finally:
        generate_patch.uninstall(model)
    assert calls and calls[0] == {"temperature": 0.9, "top_k": 30, "top_p": 0.95, "repetition_penalty": 1.1}
    assert torch.equal(first, again)
    new = first[:, batch["input_ids"].shape[1]:]
    assert new.shape[0] == 3 and 0 < new.shape[1] <= 24
    assert ((new >= 0) & (new < model.config.vocab_size)).all()


@pytest.mark.slow
def test_grpo_trainer_rollout_goes_through_fused_sample(compiled, tmp_path):
    """install(trainer) on TRL's GRPOTrainer (use_vllm false): one training step samples every completion token
    with fused_sample (~20 s on 2 cores)."""
    from trl import GRPOConfig, GRPOTrainer

    from ogrpo.patches import transformers_fused_sample as generate_patch
    from ogrpo.tiny import ensure_tiny_model, letter_reward, toy_dataset

    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, use_cpu=True, report_to=[], save_strategy="no", seed=0,
                      temperature=0.9, top_p=0.95, repetition_penalty=1.1)
    trainer = GRPOTrainer(model=str(ensure_tiny_model()), reward_funcs=letter_reward, args=args,
                          train_dataset=toy_dataset(16))
    model = generate_patch.install(trainer)
    calls = []
    original = generate_patch.FusedSampler.__call__
    generate_patch.FusedSampler.__call__ = lambda self, ids, s: calls.append(ids.shape[0]) or original(self, ids, s)
    try:
        trainer.train()
    finally:
        generate_patch.FusedSampler.__call__ = original
        generate_patch.uninstall(model)
    assert model is trainer.model
    assert calls and set(calls) == {4} and len(calls) <= 6  # one call per generated position, the 4 completions
    assert trainer.state.global_step == 1


def test_unsupported_chain_is_left_to_transformers():
    from transformers import GenerationConfig
    from transformers.generation import logits_process as lp

    from ogrpo.patches.transformers_fused_sample import fused_plan

    sampling = GenerationConfig(do_sample=True)
    chain = [lp.RepetitionPenaltyLogitsProcessor(1.1), lp.TemperatureLogitsWarper(0.7), lp.TopPLogitsWarper(0.9)]
    assert fused_plan(chain, sampling) == {"temperature": 0.7, "top_k": 0, "top_p": 0.9, "repetition_penalty": 1.1}
    assert fused_plan([*chain, lp.MinPLogitsWarper(0.1)], sampling) is None
    assert fused_plan(chain[::-1], sampling) is None
    # top-k's floor is folded into its top_k (all transformers 5.5 keeps of it); top-p applies its own per call
    assert fused_plan([lp.TopKLogitsWarper(1, min_tokens_to_keep=3)], sampling)["top_k"] == 3
    assert fused_plan([lp.TopPLogitsWarper(0.9, min_tokens_to_keep=2)], sampling) is None
    assert fused_plan([lp.TopKLogitsWarper(5, filter_value=-1e4)], sampling) is None
    assert fused_plan(chain, GenerationConfig(do_sample=True, return_dict_in_generate=True, output_scores=True)) \
        is None
    assert fused_plan([], GenerationConfig(do_sample=False)) is None


def test_install_refuses_a_model_that_overrides_sample(tiny):
    from ogrpo.patches import transformers_fused_sample as generate_patch

    class OwnLoop(type(tiny[0])):
        def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
            return input_ids

    with pytest.raises(OgrpoError, match="OwnLoop overrides generate's `_sample`"):
        generate_patch.install(OwnLoop(tiny[0].config))


def test_install_fails_loudly_when_transformers_moved(monkeypatch):
    from transformers.generation.utils import GenerationMixin

    from ogrpo.patches import transformers_fused_sample as generate_patch

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        return torch.multinomial(logits_processor(input_ids, input_ids), 1)

    monkeypatch.setattr(GenerationMixin, "_sample", _sample)
    with pytest.raises(OgrpoError, match="cannot hook transformers .*next_token_scores = logits_processor"):
        generate_patch.install(torch.nn.Linear(2, 2))


# --- CUDA -----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("setting", [(0.0, 0, 1.0, 1.3), *SETTINGS])
@pytest.mark.parametrize("shape", [(1, 3), (17, 1000), (64, 151_936)])
def test_cuda_matches_cpu_kernel_draw_for_draw(compiled, dtype, setting, shape):
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 needs sm_80+")
    op.reset()
    assert implementation("cuda")["impl"] == "compiled", op.STATUS["cuda"]
    rows, vocab = shape
    logits, previous = _logits(rows, vocab, 25).to(dtype), _previous(rows, vocab, 40, 26)
    uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(27), dtype=torch.float64)
    got = op.fused_sample_op(logits.cuda(), previous.cuda(), uniforms.cuda(), *setting).cpu()
    want = compiled.fused_sample(logits, previous, uniforms, *setting)
    if setting[0] == 0:
        assert torch.equal(got, want)
        return
    # exp and sums in another order can move a draw whose u lies within rounding of a CDF step: such a row's
    # token must still own u's place in the reference CDF
    differ = got != want
    if differ.any():
        probs = processed_scores(logits, *setting, previous).softmax(-1).double()
        cdf = probs.cumsum(-1) / probs.sum(-1, keepdim=True)
        hi = cdf.gather(1, got[:, None]).squeeze(1)
        lo = hi - probs.gather(1, got[:, None]).squeeze(1)
        assert ((uniforms >= lo - 1e-4) & (uniforms <= hi + 1e-4))[differ].all(), (got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("setting", SETTINGS)
def test_cuda_sampled_distribution_matches_reference(setting):
    draws, vocab = 20_000, 50
    logits = _logits(1, vocab, 10).expand(draws, vocab).contiguous().cuda()
    previous = _previous(1, vocab, 8, 11).expand(draws, 8).cuda()
    probs = processed_scores(logits[:1], *setting, previous[:1]).softmax(-1)[0].cpu()
    tokens = fused_sample(logits, *setting, previous, torch.Generator(device="cuda").manual_seed(3), impl="compiled")
    _assert_distribution(tokens.cpu(), probs)
