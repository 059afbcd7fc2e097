"""Log-probabilities from the engine: one entry per generated token, the greedy token is
the top one, and a request's values do not depend on what shares its batch."""

import math

import pytest
import torch

from shared.messages import AddRequest
from shared.sampling_params import SamplingParams
from tests.engine_proc.engine_factory import make_engine
from tests.engine_proc.test_tensor_parallel import LogitRecorder
from tests.tolerance import decoder_terms, logprob_limit

pytestmark = pytest.mark.numeric

PROMPT = list(range(40, 70))


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return make_engine(tiny_model_path)


def run(engine, requests):
    outputs: dict[str, list] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def test_greedy_tokens_carry_their_logprob_and_top_alternatives(engine):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    recorder = engine.model_runner.sampler = LogitRecorder(engine.model_runner.sampler)
    try:
        outs = run(engine, [AddRequest("lp", PROMPT, params),
                            AddRequest("plain", PROMPT[:9], plain)])
    finally:
        engine.model_runner.sampler = recorder.sampler
    assert all(o.logprobs is None for o in outs["plain"])
    tokens = [o for o in outs["lp"] if o.new_token_ids]
    assert len(tokens) == 8
    for o in tokens:
        [(lp, ids, values)] = o.logprobs
        assert ids[0] == o.new_token_ids[0] and lp == values[0]  # one value, read twice
        assert len(ids) == len(values) == 3 and values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values) and sum(math.exp(v) for v in values) <= 1 + 1e-6
    # alone, the same request gets the same tokens, and log-probabilities within the rounding
    # of other batch shapes
    alone = run(engine, [AddRequest("again", PROMPT, params)])["again"]
    terms = decoder_terms(engine.model_runner.config.text, len(PROMPT) + 8)
    limit = logprob_limit(torch.cat(recorder.logits), terms)
    for a, b in zip(tokens, [o for o in alone if o.new_token_ids], strict=True):
        assert a.new_token_ids == b.new_token_ids
        assert a.logprobs[0][0] == pytest.approx(b.logprobs[0][0], abs=limit, rel=0)


def test_zero_top_logprobs_gives_the_token_s_own(engine):
    params = SamplingParams(max_tokens=3, temperature=0.8, seed=3, logprobs=0)
    outs = [o for o in run(engine, [AddRequest("z", PROMPT, params)])["z"] if o.new_token_ids]
    for o in outs:
        [(lp, ids, values)] = o.logprobs
        assert ids == [] and values == [] and lp <= 0
