"""vLLM's log-probability options on a server with the default --max-logprobs (issue 31,
theme 1): logprobs=0 on completions gives the sampled token's own entry, the
`prompt_logprobs: null` key is there when they are not asked for, and -1 (the whole
vocabulary) is refused by name beyond --max-logprobs (test_server_options.py serves it)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.vllm_dropin.conftest import MODEL

CHAT = [{"role": "user", "content": "Hello there"}]


def test_logprobs_zero_gives_the_sampled_tokens_own_entry(oai):
    reply = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=4, logprobs=0)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == 4
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs,
                                                       strict=True)]
    chat = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                       logprobs=True, top_logprobs=0)
    assert all(e.top_logprobs == [] for e in chat.choices[0].logprobs.content)


def test_prompt_logprobs_key_is_null_when_not_asked(dropin_server):
    chat = httpx.post(dropin_server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": CHAT, "max_tokens": 1}).json()
    assert "prompt_logprobs" in chat and chat["prompt_logprobs"] is None
    text = httpx.post(dropin_server.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 1}).json()
    assert "prompt_logprobs" in text["choices"][0]
    assert text["choices"][0]["prompt_logprobs"] is None


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_the_whole_vocabulary_beyond_max_logprobs_is_refused_by_name(oai, kind):
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "chat":
            oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                        logprobs=True, top_logprobs=-1)
        else:
            oai.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logprobs=-1)
    field = "top_logprobs" if kind == "chat" else "logprobs"
    assert e.value.body["param"] == field and "max_logprobs=20" in e.value.body["message"]
