"""Structured outputs through the official openai client against a real server on the tiny
random model: schema-valid JSON every time, and vLLM's guided_* / structured_outputs."""

from __future__ import annotations

import json
import re

import openai
import pytest

pytest.importorskip("xgrammar")

MODEL = "flatserve-tiny-qwen2.5-vl"
MESSAGES = [{"role": "user", "content": "Describe a fruit as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "fruit": {"enum": ["apple", "pear", "plum"]},
        "weight": {"type": "integer", "minimum": 1, "maximum": 500},
        "ripe": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["fruit", "weight", "ripe", "note"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def valid(value) -> bool:
    return (set(value) == set(SCHEMA["required"]) and value["fruit"] in ("apple", "pear", "plum")
            and type(value["weight"]) is int and 1 <= value["weight"] <= 500
            and type(value["ripe"]) is bool and isinstance(value["note"], str)
            and len(value["note"]) <= 8)


def test_json_schema_is_valid_twenty_times_out_of_twenty(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "fruit", "schema": SCHEMA}}
    for seed in range(20):
        reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=150,
                                            temperature=1.0, seed=seed, response_format=fmt)
        assert reply.choices[0].finish_reason == "stop"
        assert valid(json.loads(reply.choices[0].message.content))
    chunks = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=150,
                                         temperature=1.0, seed=99, response_format=fmt,
                                         stream=True)
    assert valid(json.loads("".join(c.choices[0].delta.content or "" for c in chunks
                                    if c.choices)))


def test_vllm_guided_fields(oai):
    def ask(**extra) -> str:
        return oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30,
                                           temperature=1.0, seed=3,
                                           extra_body=extra).choices[0].message.content

    assert ask(guided_choice=["left", "right"]) in ("left", "right")
    assert re.fullmatch(r"[A-Z]{2}[0-9]{3}", ask(guided_regex=r"[A-Z]{2}[0-9]{3}"))
    assert ask(structured_outputs={"choice": ["up", "down"]}) in ("up", "down")
    assert re.fullmatch(r"ab+", ask(guided_grammar='root ::= "a" "b"{1,5}'))
    text = oai.completions.create(model=MODEL, prompt="Pick:", max_tokens=10, temperature=1.0,
                                  extra_body={"guided_choice": ["x", "y"]}).choices[0].text
    assert text in ("x", "y")


def test_bad_constraints_answer_400(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                    extra_body={"guided_regex": "(unclosed"})
    assert "regex" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                    response_format={"type": "json_object"},
                                    extra_body={"guided_choice": ["a"]})
    assert "at most one output constraint" in str(err.value)
