"""Completions' echo and vLLM's skip_special_tokens / include_stop_str_in_output through the
official openai client against a real server."""

from __future__ import annotations

import openai
import pytest

from api_proc.prompt_builder import PromptBuilder

MODEL = "flatserve-tiny-qwen2.5-vl"


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_echo_puts_the_prompt_before_the_completion(oai):
    args = dict(model=MODEL, prompt=["The sea", "A tree"], max_tokens=4, temperature=0, n=2)
    plain = oai.completions.create(**args)
    echoed = oai.completions.create(**args, echo=True)
    for p, e in zip(sorted(plain.choices, key=lambda c: c.index),
                    sorted(echoed.choices, key=lambda c: c.index), strict=True):
        prompt = args["prompt"][p.index // 2]
        assert e.text == prompt + p.text
    chunks = list(oai.completions.create(**args, echo=True, stream=True))
    texts = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in echoed.choices}
    with pytest.raises(openai.BadRequestError, match="echo with logprobs"):
        oai.completions.create(**args, echo=True, logprobs=1, stream=True)


def test_special_tokens_are_written_only_when_asked(oai, tiny_model_path):
    im_end = PromptBuilder.from_pretrained(tiny_model_path).tokenizer.token_to_id("<|im_end|>")
    args = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                temperature=0, logit_bias={str(im_end): 100})
    extra = {"ignore_eos": True, "stop_token_ids": []}
    assert oai.chat.completions.create(**args, extra_body=extra).choices[0].message.content == ""
    shown = oai.chat.completions.create(**args, extra_body={**extra,
                                                             "skip_special_tokens": False})
    assert shown.choices[0].message.content == "<|im_end|>" * 3


def test_include_stop_str_in_output(oai):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=20,
                temperature=0, stop=["cd"])
    cut = oai.chat.completions.create(**args, extra_body={"guided_regex": "abcdef"})
    assert cut.choices[0].message.content == "ab" and cut.choices[0].finish_reason == "stop"
    kept = oai.chat.completions.create(**args, extra_body={"guided_regex": "abcdef",
                                                            "include_stop_str_in_output": True})
    assert kept.choices[0].message.content == "abcd"
