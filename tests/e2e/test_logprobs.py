"""Log-probabilities through the official openai client against a real server: chat and
completions, streamed and not, in OpenAI's shapes."""

from __future__ import annotations

import openai
import pytest

MODEL = "flatserve-tiny-qwen2.5-vl"
MESSAGES = [{"role": "user", "content": "Name three colours of the sea."}]


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_logprobs_streamed_and_not(oai):
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True,
                top_logprobs=3, extra_body={"ignore_eos": True})
    reply = oai.chat.completions.create(**args)
    choice = reply.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == reply.usage.completion_tokens == 10
    for e in entries:
        assert len(e.top_logprobs) == 3
        # greedy: the token is the most likely one, with the engine's own top log-prob
        assert e.token == e.top_logprobs[0].token and e.logprob == e.top_logprobs[0].logprob
        assert e.logprob <= 0 and e.bytes == list(e.token.encode()) or "\ufffd" in e.token
    raw = b"".join(bytes(e.bytes) for e in entries)
    assert raw.decode(errors="replace") == choice.message.content  # random weights: bad UTF-8

    chunks = list(oai.chat.completions.create(**args, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    # the same tokens and log-probs (the second request reuses the first's cached prefix,
    # a different sum order: equal to float32 rounding)
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-4)

    plain = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_zero_top_logprobs_and_sampling(oai):
    reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                        temperature=1.0, seed=1, logprobs=True)
    for e in reply.choices[0].logprobs.content:
        assert e.top_logprobs == [] and e.logprob <= 0


def test_completion_logprobs(oai):
    args = dict(model=MODEL, prompt="The sea is", max_tokens=6, temperature=0, logprobs=2,
                extra_body={"ignore_eos": True})
    reply = oai.completions.create(**args)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 2 and max(top.values()) == value and top.get(token) == value
    chunks = list(oai.completions.create(**args, stream=True))
    assert [t for c in chunks if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.tokens] == lp.tokens


@pytest.mark.parametrize("extra, name", [
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_logprob_settings_are_refused_by_name(oai, extra, name):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **extra)
    assert name in str(err.value)
