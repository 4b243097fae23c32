"""A completion's scoring passes on its prefix while it generates (issue 36): the streamed request answers what
TRL's request answers (a real `ogrpo serve`), hands its prefixes over as they are sampled and refuses what the
server did not finish (a scripted SSE server); the pieces' log-probs are TRL's pass's; the completions' tokens
reach the trainer's thread (Prefixes)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import requests
import torch

from ogrpo import tiny
from ogrpo.overlap.prefixes import IncrementalPass, Prefixes
from ogrpo.serve import auth, prefix_stream
from server_mode_job import STREAM_REPORT


# ---- against the real server of the session's server-mode job ---------------------------------------------------
def test_a_streamed_request_answers_what_trls_request_answers(server_mode_job):
    """The same request (one seed) asked as TRL's client asks it and streamed: the same prompt ids, completion
    ids and log-probs; every prefix handed over is a prefix of the completion, growing, before its end."""
    assert server_mode_job.rc == 0, server_mode_job.console[-2000:]
    cases = json.loads((server_mode_job.job_dir / STREAM_REPORT).read_text())
    assert len(cases) == 3
    for case in cases:
        assert case["same"], case
        assert case["prefixes_of_it"], case
        assert case["prefixes"] == sorted(set(case["prefixes"])) and all(n < case["length"] for n in case["prefixes"])
    assert max(len(c["prefixes"]) for c in cases) >= 3, cases  # the 40-token request, every 4 tokens


# ---- a scripted SSE server -------------------------------------------------------------------------------------
def _chunk(choice: dict) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, **choice}]}).encode() + b"\n\n"


def _logprobs(ids):
    return {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": [-0.5] * len(ids),
            "top_logprobs": [{f"token_id:{t}": -0.5} for t in ids], "text_offset": [0] * len(ids)}


class Scripted(BaseHTTPRequestHandler):
    """Answers /v1/completions with `script`: a list of SSE chunks (bytes), or "wait" (until the client's
    on_tokens has run: the first chunk must reach it before the rest is sent), or an int (an HTTP error)."""
    script: list = []
    seen = threading.Event()
    payloads: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        type(self).payloads.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0))))
        if isinstance(self.script, int):
            self.send_response(self.script)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"boom")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for part in self.script:
            if part == "wait":
                type(self).seen.wait(20)
                continue
            self.wfile.write(part)
            self.wfile.flush()
        self.close_connection = True


@pytest.fixture
def sse():
    Scripted.seen = threading.Event()
    Scripted.payloads = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    session = auth._keyed_session_cls(requests)()  # the trainer's session: its hooks refuse unfinished answers
    client = SimpleNamespace(session=session, base_url=f"http://127.0.0.1:{httpd.server_address[1]}", model="m")
    yield client
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)
    assert not thread.is_alive()


KW = dict(prompts=[[1, 2, 3]], n=1, max_tokens=8, logprobs=0, generation_kwargs={"seed": 5})


def test_prefixes_reach_the_trainer_as_they_are_sampled_and_the_answer_is_trls_shape(sse):
    """The first chunk's tokens reach on_tokens while the server holds the rest back (the trainer's session
    does not read the whole stream first); the answer is what TRL's generate returns; the request is TRL's with
    `stream` and the interval."""
    Scripted.script = [_chunk({"prompt_token_ids": [1, 2, 3], "token_ids": [7, 8], "logprobs": _logprobs([7, 8]),
                               "finish_reason": None}), "wait",
                       _chunk({"token_ids": [9], "logprobs": _logprobs([9]), "finish_reason": "stop"}),
                       b"data: [DONE]\n\n"]
    got = []

    def on_tokens(ids):
        got.append(ids)
        Scripted.seen.set()

    out = prefix_stream.generate(sse, on_tokens, interval=3, **KW)
    assert got == [[7, 8]]
    assert out["prompt_ids"] == [[1, 2, 3]] and out["completion_ids"] == [[7, 8, 9]]
    assert out["logprob_token_ids"] == [[[7], [8], [9]]] and out["logprobs"] == [[[-0.5]] * 3]
    sent = Scripted.payloads[0]
    assert sent["stream"] is True and sent["stream_interval"] == 3 and sent["seed"] == 5 and sent["max_tokens"] == 8
    assert sent["return_token_ids"] and sent["return_tokens_as_token_ids"] and sent["prompt"] == [[1, 2, 3]]


@pytest.mark.parametrize("ending", ["abort", "error", None])
def test_a_stream_the_server_did_not_finish_is_refused(sse, ending):
    """Aborted (the server on its way down), failed, or cut before its finish: never a completion."""
    Scripted.script = [_chunk({"prompt_token_ids": [1, 2, 3], "token_ids": [7], "logprobs": _logprobs([7]),
                               "finish_reason": None})]
    if ending is not None:
        Scripted.script.append(_chunk({"token_ids": [], "logprobs": _logprobs([]), "finish_reason": ending}))
    with pytest.raises(auth.GenerationAborted, match=ending or "before its finish"):
        prefix_stream.generate(sse, lambda ids: None, **KW)


def test_an_http_error_fails_the_request_as_trls_client_does(sse):
    Scripted.script = 500
    with pytest.raises(Exception, match="Request failed: 500"):
        prefix_stream.generate(sse, lambda ids: None, **KW)


def test_only_one_completion_of_token_ids_streams():
    assert prefix_stream.streamable(dict(KW))
    assert not prefix_stream.streamable(dict(KW, n=2))
    assert not prefix_stream.streamable(dict(KW, prompts=[[1], [2]]))
    assert not prefix_stream.streamable(dict(KW, features=[{}]))


def test_trls_client_still_asks_what_the_stream_asks():
    assert prefix_stream.trl_generate_problems() == []


# ---- the pieces' log-probs -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fused_model():
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    model = AutoModelForCausalLM.from_pretrained(str(tiny.ensure_tiny_model()), dtype=torch.float32).eval()
    add_fused_lm_head(model, temperature=0.7)  # as TRL's trainer adds it: its temperature divides the logits
    return model


def _trainer():
    import contextlib

    return SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext))


def _trl_pass(model, prompt, completion, pad):
    """TRL's pass over the row as its batch lays it out: the prompt left-padded."""
    ids = torch.tensor([[0] * pad + prompt + completion])
    mask = torch.ones_like(ids)
    mask[:, :pad] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-len(completion)] = -100
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -len(completion):]


@pytest.mark.parametrize("pieces", [[1, 5, 5, 5, 4], [20], [3] * 6 + [2], [19, 1]])
def test_a_prefix_scored_in_pieces_gives_the_log_probs_of_trls_pass(fused_model, pieces):
    g = torch.Generator().manual_seed(len(pieces))
    vocab = fused_model.config.vocab_size
    prompt = torch.randint(1, vocab, (9,), generator=g).tolist()
    completion = torch.randint(1, vocab, (20,), generator=g).tolist()
    expected = _trl_pass(fused_model, prompt, completion, pad=4)
    p = IncrementalPass(_trainer(), fused_model, prompt)
    k = 0
    for n in pieces[:-1]:
        k += n
        p.extend(completion[:k])
    got = p.finish(completion)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_completion_other_than_its_prefix_is_not_answered_from_it(fused_model):
    p = IncrementalPass(_trainer(), fused_model, [5, 6, 7])
    p.extend([8, 9, 10])
    assert p.finish([8, 11, 10, 12]) is None  # a token differs from the prefix scored: the pass runs whole
    assert IncrementalPass(_trainer(), fused_model, [5, 6]).finish([]) is None


# ---- the request threads' hand-over ----------------------------------------------------------------------------
def test_prefixes_wake_the_trainer_and_hand_over_the_completion_with_most_new_tokens():
    sink = Prefixes()
    assert not sink.wake.done()
    sink.put(0, 1, [1, 2, 3])
    sink.put(1, 0, [4, 5, 6, 7, 8])
    assert sink.wake.done()
    assert sink.take(lambda key: True, least=4) == ((1, 0), [4, 5, 6, 7, 8])
    assert sink.take(lambda key: True, least=4) is None  # (0, 1) has 3 new tokens only
    assert isinstance(sink.wake, Future) and not sink.wake.done()  # reset until the next put
    assert sink.take(lambda key: key != (0, 1)) is None
    assert sink.take(lambda key: True) == ((0, 1), [1, 2, 3])
    sink.end(0, 1)
    sink.put(0, 1, [1, 2, 3, 4])  # a chunk read after its request ended: dropped
    assert sink.take(lambda key: True) is None
    # a completion's first piece waits until it is `start` long; later pieces only need `least` new tokens
    sink.put(2, 0, [1] * 5)
    assert sink.take(lambda key: True, least=1, start=6) is None
    sink.put(2, 0, [1] * 6)
    assert sink.take(lambda key: True, least=1, start=6) == ((2, 0), [1] * 6)
    sink.put(1, 0, [4, 5, 6, 7, 8, 9])  # (1, 0) was taken at 5: one new token, past its start
    assert sink.take(lambda key: True, least=1, start=60) == ((1, 0), [4, 5, 6, 7, 8, 9])


@pytest.mark.parametrize("pieces", [[7, 6, 7], [20], [1] * 19 + [1]])
def test_a_loss_forward_in_pieces_gives_trls_log_probs_entropies_and_gradients(pieces):
    """The loss forward on a prefix (`grad=True`): its graph kept through the cache, the log-probs and entropies
    and the gradients they give are those of TRL's forward over the left-padded row."""
    import contextlib

    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    model = AutoModelForCausalLM.from_pretrained(str(tiny.ensure_tiny_model()), dtype=torch.float32).train()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))  # the policy's head, as TRL adds it
    trainer = SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext),
                              compute_loss_context_manager=contextlib.nullcontext, logprobs_scorer=None,
                              temperature=0.7)
    g = torch.Generator().manual_seed(len(pieces))
    vocab = model.config.vocab_size
    prompt = torch.randint(1, vocab, (9,), generator=g).tolist()
    completion = torch.randint(1, vocab, (20,), generator=g).tolist()
    weights = torch.randn(1, 20, generator=g)

    def grads(logps, entropies):  # a loss of both, as TRL's with an entropy term would be
        model.zero_grad()
        ((logps * weights).sum() + 0.1 * entropies.sum()).backward()
        return {k: v.grad.clone() for k, v in model.named_parameters() if v.grad is not None}

    pad = 4
    ids = torch.tensor([[0] * pad + prompt + completion])
    mask = torch.ones_like(ids)
    mask[:, :pad] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-len(completion)] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    logps, entropies = out.log_probs[:, -20:], out.entropy[:, -20:]
    expected = grads(logps, entropies)

    p = IncrementalPass(trainer, model, prompt, grad=True)
    k = 0
    for n in pieces[:-1]:
        k += n
        p.extend(completion[:k])
    got = p.finish(completion)
    assert got.requires_grad and got.shape == logps.shape
    torch.testing.assert_close(got, logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p.entropies, entropies, rtol=1e-5, atol=1e-5)
    found = grads(got, p.entropies)
    assert found.keys() == expected.keys() and len(found) > 5
    for name, grad in expected.items():  # summed in another order (the cache's attention): fp32 noise, ~1e-5
        apart = float((found[name] - grad).norm() / grad.norm().clamp(min=1e-12))
        assert apart < 1e-4, (name, apart)


def test_rope_that_rotates_by_the_length_seen_keeps_prefixes_off():
    from ogrpo.overlap.prefixes import rope_why_not

    assert rope_why_not(SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4})) is None
    assert rope_why_not(SimpleNamespace()) is None
    assert "dynamic" in rope_why_not(SimpleNamespace(rope_parameters={"rope_type": "dynamic", "factor": 2.0}))
    assert "longrope" in rope_why_not(SimpleNamespace(rope_scaling={"type": "longrope"}))
    per_layer = {"full_attention": {"rope_type": "dynamic"}, "sliding_attention": {"rope_type": "default"}}
    assert "dynamic" in rope_why_not(SimpleNamespace(rope_parameters=per_layer))
    from transformers import AutoConfig

    assert rope_why_not(AutoConfig.from_pretrained(str(tiny.ensure_tiny_model()))) is None  # the tests' model


def test_a_prefix_whose_tokens_change_or_whose_cache_is_dropped_is_refused(fused_model):
    """Tokens that no longer start with the prefix scored, or a model that ignores the cache it is given (as
    gradient checkpointing does in training): the piece raises, and its completion's passes run whole."""
    p = IncrementalPass(_trainer(), fused_model, [5, 6, 7])
    p.extend([8, 9, 10])
    with pytest.raises(ValueError, match="changed"):
        p.extend([8, 11, 10, 12])

    class Dropping:
        config = fused_model.config

        def __call__(self, **kwargs):
            return fused_model(**{**kwargs, "past_key_values": None})

    with pytest.raises(RuntimeError, match="key/value cache"):
        IncrementalPass(_trainer(), Dropping(), [5, 6, 7]).extend([8, 9, 10])
