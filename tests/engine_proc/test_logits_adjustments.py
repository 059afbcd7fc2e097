"""Penalties, logit_bias and min_tokens: the math on hand-made logits, and their effect on
the engine's greedy output on the tiny model."""

import numpy as np
import pytest
import torch

from engine_proc.logits_adjustments import build_adjustments
from engine_proc.sequence import Sequence
from shared.messages import AddRequest
from shared.sampling_params import SamplingParams
from tests.engine_proc.engine_factory import make_engine

VOCAB = 8


def seq(prompt, completion, **sampling) -> Sequence:
    s = Sequence("r", prompt, SamplingParams(max_tokens=16, **sampling))
    for t in completion:
        s.append_token(t)
    return s


def adjusted(seqs, logits, eos=(7,)):
    adjust = build_adjustments(seqs, VOCAB, eos, torch.from_numpy)
    return logits if adjust is None else adjust.apply(logits.clone())


def test_requests_without_adjustments_build_nothing():
    assert build_adjustments([seq([1], [2]), seq([3], [])], VOCAB, (7,), torch.from_numpy) is None


def test_presence_and_frequency_follow_openai():
    logits = torch.zeros(2, VOCAB)
    s = seq([5], [1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25)
    out = adjusted([seq([5], [1]), s], logits)
    assert torch.equal(out[0], logits[0])  # a row without penalties is untouched
    expect = torch.zeros(VOCAB)
    expect[1] = -0.5 - 2 * 0.25
    expect[2] = -0.5 - 1 * 0.25
    # penalties and counts are small binary fractions: the arithmetic is exact
    assert torch.equal(out[1], expect)  # the prompt's token 5 is not penalised


def test_repetition_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 2.0, 1.0, 1.0, 1.0]])
    out = adjusted([seq([0, 1], [2], repetition_penalty=2.0)], logits)
    assert out[0].tolist() == [1.0, -4.0, 1.0, -2.0, 2.0, 1.0, 1.0, 1.0]


def test_logit_bias_adds_and_min_tokens_bans_stop_tokens_until_reached():
    logits = torch.zeros(3, VOCAB)
    rows = [seq([0], [], logit_bias=((3, 5.0), (4, -1.5))),
            seq([0], [1], min_tokens=2, stop_token_ids=(6,)),
            seq([0], [1, 2], min_tokens=2, stop_token_ids=(6,))]
    out = adjusted(rows, logits)
    assert out[0, 3] == 5.0 and out[0, 4] == -1.5 and out[0].abs().sum() == 6.5
    assert out[1, 6] == -np.inf and out[1, 7] == -np.inf  # stop id and EOS, 1 of 2 tokens
    assert torch.isfinite(out[2]).all()  # min_tokens reached


# ---- the engine -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return make_engine(tiny_model_path)


def generate(engine, prompt, **sampling) -> list[int]:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **sampling)
    return engine.generate([AddRequest("r", prompt, params)])["r"]


PROMPT = list(range(40, 60))


def test_frequency_and_presence_penalties_make_greedy_output_repeat_less(engine):
    plain = generate(engine, PROMPT)
    assert len(set(plain)) < len(plain), "the tiny model should repeat itself unpenalised"
    for kind in ("frequency_penalty", "presence_penalty"):
        penalised = generate(engine, PROMPT, **{kind: 2.0})
        assert len(set(penalised)) > len(set(plain)), kind
    # negative values go the other way: more repetition
    assert len(set(generate(engine, PROMPT, frequency_penalty=-2.0))) <= len(set(plain))


def test_repetition_penalty_avoids_prompt_and_output_tokens(engine):
    plain = generate(engine, PROMPT)
    penalised = generate(engine, PROMPT, repetition_penalty=2.0)
    assert penalised != plain
    assert sum(t in PROMPT for t in penalised) <= sum(t in PROMPT for t in plain)
    assert len(set(penalised)) >= len(set(plain))


def test_logit_bias_forces_a_token_and_min_tokens_holds_off_a_stop(engine):
    assert set(generate(engine, PROMPT, logit_bias=((123, 100.0),))) == {123}
    first = generate(engine, PROMPT)[0]
    # the first greedy token as a stop token ends the completion at once...
    assert generate(engine, PROMPT, stop_token_ids=(first,)) == [first]
    # ...unless min_tokens says the completion is too short to stop
    held = generate(engine, PROMPT, stop_token_ids=(first,), min_tokens=5)
    assert len(held) >= 5 and first not in held[:4]


def test_a_batch_mixing_adjusted_and_plain_requests_keeps_each_own_output(engine):
    plain = generate(engine, PROMPT)
    penalised = generate(engine, PROMPT, frequency_penalty=2.0)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    both = engine.generate([
        AddRequest("a", PROMPT, params),
        AddRequest("b", PROMPT, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                               frequency_penalty=2.0)),
    ])
    assert both["a"] == plain and both["b"] == penalised


def test_out_of_vocabulary_bias_is_rejected(engine):
    from engine_proc.llm_engine import RequestRejected

    vocab = engine.config.text.vocab_size
    with pytest.raises(RequestRejected, match="logit_bias"):
        engine.add_request(AddRequest("x", PROMPT, SamplingParams(logit_bias=((vocab, 1.0),))))
