"""Usage and token ids as vLLM reports them, through the official openai client (issue 31,
theme 5): stream_options.continuous_usage_stats, return_token_ids (streamed and not, chat
and completions), and a server with --enable-force-include-usage --skip-tokenizer-init
(token in, token out)."""

from __future__ import annotations

import openai
import pytest

from api_proc.prompt_builder import PromptBuilder
from tests.e2e.server_process import served_openai
from tests.e2e.vllm_dropin.conftest import MODEL

CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def builder(tiny_model_path):
    return PromptBuilder.from_pretrained(tiny_model_path)


def test_continuous_usage_stats_put_usage_in_every_chunk(oai):
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == [0, 1, 2, 3, 4, 5]  # the role chunk, then one per token
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in chunks)
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices
    plain = list(oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                             stream=True,
                                             stream_options={"include_usage": True}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_tokens_without_text_stream_as_empty_chunks(oai, builder):
    """vLLM's: every step with tokens is a chunk, its text "" while they have none (a
    special token here; also part of a character, or text held back for a stop string), so
    that a client sees each token when it comes."""
    start = builder.tokenizer.token_to_id("<|vision_start|>")
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, stream=True, logit_bias={str(start): 100},
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"return_token_ids": True}))
    steps = [c for c in chunks if c.choices][1:]  # after the role chunk
    assert [c.usage.completion_tokens for c in steps] == [1, 2, 3]
    assert [c.choices[0].delta.content for c in steps] == ["", "", ""]
    assert [c.choices[0].model_extra["token_ids"] for c in steps] == [[start]] * 3
    assert steps[-1].choices[0].finish_reason == "length"
    texts = [c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=3, stream=True,
        logit_bias={str(start): 100}) if c.choices]
    assert texts == ["", "", ""]


def test_return_token_ids_in_chat(oai, builder):
    reply = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                        temperature=0, extra_body={"return_token_ids": True})
    prompt = reply.model_extra["prompt_token_ids"]
    assert "Hello there" in builder.decoder_with_specials.decode(prompt)
    assert len(prompt) == reply.usage.prompt_tokens
    ids = reply.choices[0].model_extra["token_ids"]
    assert len(ids) == reply.usage.completion_tokens
    assert builder.decoder.decode(ids) == reply.choices[0].message.content
    streamed, firsts = [], []
    for chunk in oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                             temperature=0, stream=True,
                                             extra_body={"return_token_ids": True}):
        firsts.append("prompt_token_ids" in chunk.model_extra)
        streamed += chunk.choices[0].model_extra.get("token_ids", [])  # not the role chunk's
    assert firsts[0] and not any(firsts[1:]) and streamed == ids


def test_token_ids_agree_with_the_text_around_an_emoji(oai, builder):
    """vLLM's emoji case: the ids decode to the text, streamed (a character split across
    tokens held back, its ids not) or not, and the prompt's ids to the rendered prompt."""
    chat = [{"role": "user", "content": "Repeat after me: I love cats 🐱"}]
    args = dict(model=MODEL, messages=chat, max_tokens=24, temperature=0,
                extra_body={"return_token_ids": True})
    reply = oai.chat.completions.create(**args)
    prompt = builder.decoder_with_specials.decode(reply.model_extra["prompt_token_ids"])
    assert prompt.endswith("I love cats 🐱<|im_end|>\n<|im_start|>assistant\n")
    ids = reply.choices[0].model_extra["token_ids"]
    assert builder.decoder.decode(ids) == reply.choices[0].message.content
    chunks = list(oai.chat.completions.create(stream=True, **args))
    assert chunks[0].model_extra["prompt_token_ids"] == reply.model_extra["prompt_token_ids"]
    streamed = [t for c in chunks for t in c.choices[0].model_extra.get("token_ids", [])]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == ids and text == reply.choices[0].message.content


def test_token_id_keys_are_null_when_not_asked(oai):
    """vLLM 0.32's shape without return_token_ids: the keys are there, null (a client that
    reads `reply.prompt_token_ids` gets None, not an AttributeError), where vLLM writes them."""
    chat = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert chat.model_extra["prompt_token_ids"] is None
    assert chat.choices[0].model_extra["token_ids"] is None
    [choice] = oai.completions.create(model=MODEL, prompt="Hello there", max_tokens=2).choices
    assert (choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]) == (None, None)
    role, *steps, usage = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, stream=True,
        stream_options={"include_usage": True})
    assert role.model_extra["prompt_token_ids"] is None  # the role chunk only, at the top
    assert "token_ids" not in role.choices[0].model_extra
    assert steps and all("prompt_token_ids" not in c.model_extra
                         and c.choices[0].model_extra["token_ids"] is None for c in steps)
    assert not usage.choices and "prompt_token_ids" not in usage.model_extra
    chunks = list(oai.completions.create(model=MODEL, prompt="Hello there", max_tokens=2,
                                         stream=True))
    assert chunks and all(c.choices[0].model_extra["prompt_token_ids"] is None
                          and c.choices[0].model_extra["token_ids"] is None for c in chunks)


def test_return_token_ids_in_completions(oai, builder):
    args = dict(model=MODEL, prompt=["One", "Two words"], max_tokens=3, temperature=0,
                extra_body={"return_token_ids": True})
    reply = oai.completions.create(**args)
    for choice, text in zip(reply.choices, ["One", "Two words"], strict=True):
        assert choice.model_extra["prompt_token_ids"] == builder.encode(text)
        assert builder.decoder.decode(choice.model_extra["token_ids"]) == choice.text
    by_index = {}
    for chunk in oai.completions.create(stream=True, **args):
        choice = chunk.choices[0]
        entry = by_index.setdefault(choice.index, [choice.model_extra.get("prompt_token_ids"),
                                                   []])
        entry[1] += choice.model_extra["token_ids"]
    assert {i: tuple(map(tuple, v)) for i, v in by_index.items()} == {
        c.index: (tuple(c.model_extra["prompt_token_ids"]), tuple(c.model_extra["token_ids"]))
        for c in reply.choices}


@pytest.fixture(scope="module")
def token_out(tmp_path_factory, tiny_model_path):
    with served_openai(tmp_path_factory.mktemp("token-out"),
                       "--enable-force-include-usage", "--skip-tokenizer-init") as client:
        yield client


def test_token_in_token_out_with_usage_forced(token_out, oai, builder):
    prompt = builder.encode("Hello, world! How are you today?")
    args = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    reply = token_out.completions.create(**args, echo=True,
                                         extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    assert choice.text == "" and choice.model_extra["prompt_token_ids"] == prompt
    expected = oai.completions.create(**args, extra_body={"return_token_ids": True})
    assert choice.model_extra["token_ids"] == expected.choices[0].model_extra["token_ids"]
    lp = token_out.completions.create(**args, logprobs=1).choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in choice.model_extra["token_ids"]]
    # --enable-force-include-usage: usage in every chunk without stream_options
    chunks = list(token_out.completions.create(**args, stream=True))
    assert all(c.usage is not None for c in chunks) and chunks[-1].usage.completion_tokens == 6
    for refused, field in [(dict(prompt="text"), "prompt"), (dict(stop=["x"]), "stop")]:
        with pytest.raises(openai.BadRequestError, match="--skip-tokenizer-init") as e:
            token_out.completions.create(**{**args, **refused})
        assert e.value.body["param"] == field
    with pytest.raises(openai.BadRequestError, match="--skip-tokenizer-init"):
        token_out.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
