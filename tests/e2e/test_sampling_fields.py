"""Penalties, logit_bias and min_tokens through the official openai client against a real
server: the served tokens are the offline engine's for the same settings, streamed or not,
and the settings really change the output."""

from __future__ import annotations

import openai
import pytest

from api_proc.detokenizer import TokenDecoder
from api_proc.prompt_builder import PromptBuilder
from engine_proc.llm_engine import LLMEngine
from shared.messages import AddRequest
from shared.sampling_params import SamplingParams

MODEL = "flatserve-tiny-qwen2.5-vl"
MESSAGES = [{"role": "user", "content": "Tell me about the sea and the sky and the sea."}]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model_path):
    builder = PromptBuilder.from_pretrained(tiny_model_path)
    engine = LLMEngine(str(tiny_model_path), max_num_seqs=4, kv_cache_memory_bytes=32 << 20)
    decoder = TokenDecoder(builder.tokenizer)
    ids = builder.build_chat(MESSAGES, [])

    def run(**settings) -> tuple[str, list[int]]:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **settings)
        tokens = engine.generate([AddRequest("offline", ids, params)])["offline"]
        return decoder.decode(tokens), tokens

    return run


def served(oai, stream: bool = False, **extra) -> tuple[str, int]:
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    penalties = {k: extra.pop(k) for k in ("presence_penalty", "frequency_penalty",
                                           "logit_bias") if k in extra}
    if not stream:
        reply = oai.chat.completions.create(**args, **penalties, extra_body=extra)
        return reply.choices[0].message.content, reply.usage.completion_tokens
    chunks = list(oai.chat.completions.create(**args, **penalties, extra_body=extra, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage.completion_tokens


@pytest.mark.parametrize("settings", [
    {"frequency_penalty": 2.0}, {"presence_penalty": 1.5}, {"repetition_penalty": 1.8},
    {"frequency_penalty": -1.0, "presence_penalty": 0.5},
], ids=["frequency", "presence", "repetition", "mixed"])
def test_penalties_give_the_offline_engine_s_tokens(oai, offline, settings):
    plain, plain_tokens = offline()
    want, tokens = offline(**settings)
    assert want != plain, "the setting should change this greedy completion"
    for stream in (False, True):
        assert served(oai, stream, **settings) == (want, len(tokens))
    if all(v > 0 for k, v in settings.items() if k != "repetition_penalty") and \
            settings.get("repetition_penalty", 2.0) > 1:
        # the documented direction: penalised, the completion repeats itself less
        assert len(set(tokens)) / len(tokens) > len(set(plain_tokens)) / len(plain_tokens)


def test_logit_bias_and_min_tokens(oai, offline):
    text, tokens = offline(logit_bias=((300, 100.0),))
    assert set(tokens) == {300}
    assert served(oai, logit_bias={"300": 100}) == (text, MAX_TOKENS)
    first = offline()[1][0]
    assert offline(stop_token_ids=(first,))[1] == [first]
    want, tokens = offline(stop_token_ids=(first,), min_tokens=6)
    assert len(tokens) >= 6
    assert served(oai, True, stop_token_ids=[first], min_tokens=6) == (want, len(tokens))


def test_bad_values_are_refused_by_name(oai):
    for extra, name in [({"min_tokens": MAX_TOKENS + 1}, "min_tokens"),
                        ({"repetition_penalty": 0}, "repetition_penalty"),
                        ({"logit_bias": {"999999": 1}}, "logit_bias")]:
        with pytest.raises(openai.BadRequestError) as err:
            served(oai, **extra)
        assert name in str(err.value)
