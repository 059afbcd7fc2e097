"""Tool calling through the official openai client against a real server (with vLLM's
--enable-auto-tool-choice --tool-call-parser hermes) on the tiny random model: forced calls
match their function's schema every time, streamed calls assemble to the non-streamed ones,
and a tool result goes back through the chat template."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from api_proc.protocol import ChatCompletionChunk
from tests.e2e.server_process import served_openai

pytest.importorskip("xgrammar")

MODEL = "flatserve-tiny-qwen2.5-vl"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# a pattern, not maxLength: xgrammar 0.2.8 lets a string take bytes that are not UTF-8
# (decoded as U+FFFD, so maxLength counts differ); seen here, not a tool-calling matter
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "Europe/Paris"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
# a call the model is made to write by a regex, whatever its random weights
FORCED_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


@pytest.fixture(scope="module")
def oai(tmp_path_factory, tiny_model_path):
    with served_openai(tmp_path_factory.mktemp("server"),
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as client:
        yield client


def valid(name: str, arguments: dict) -> bool:
    if name == "get_time":
        return arguments in ({"zone": "UTC"}, {"zone": "Europe/Paris"})
    return (name == "get_weather" and set(arguments) == {"city", "unit", "days"}
            and re.fullmatch("[A-Za-z ]{1,12}", arguments["city"])
            and arguments["unit"] in ("celsius", "fahrenheit")
            and type(arguments["days"]) is int and 1 <= arguments["days"] <= 7)


def calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def streamed(oai, **kwargs) -> tuple[str, list[tuple[str, dict]], str]:
    """(content, calls, finish reason) assembled from a stream's deltas."""
    content, by_index, finish = "", {}, None
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            if d.index not in by_index:  # a call's first delta names it
                assert d.id.startswith("chatcmpl-tool-") and d.type == "function"
                by_index[d.index] = [d.function.name, ""]
            else:
                assert d.id is None and d.function.name is None
            by_index[d.index][1] += d.function.arguments
        finish = choice.finish_reason or finish
    return content, [(n, json.loads(a)) for n, a in by_index.values()], finish


def test_a_named_function_is_called_with_valid_arguments_every_time(oai):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(10):
        kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                      max_tokens=200, temperature=1.0, seed=seed)
        reply = oai.chat.completions.create(**kwargs).choices[0]
        assert reply.finish_reason == "tool_calls" and reply.message.content == ""
        [(name, arguments)] = calls(reply.message)
        assert name == "get_weather" and valid(name, arguments)
        if seed < 2:
            assert streamed(oai, **kwargs) == ("", calls(reply.message), "tool_calls")


@pytest.mark.parametrize("parallel, seeds", [(False, 10), (True, 4)])  # 4: calls add up
def test_required_calls_some_function_with_valid_arguments_every_time(oai, parallel, seeds):
    for seed in range(seeds):
        kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                      parallel_tool_calls=parallel, max_tokens=600, temperature=1.0, seed=seed)
        reply = oai.chat.completions.create(**kwargs).choices[0]
        assert reply.finish_reason == "tool_calls" and reply.message.content == ""
        made = calls(reply.message)
        assert made and all(valid(name, arguments) for name, arguments in made)
        assert parallel or len(made) == 1
        if seed < 2:
            assert streamed(oai, **kwargs) == ("", made, "tool_calls")


def test_auto_reads_calls_out_and_none_leaves_them_as_text(oai):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=0,
                  extra_body={"guided_regex": "Sure\\. " + FORCED_CALL.replace("{", "\\{")
                              .replace("}", "\\}")})
    reply = oai.chat.completions.create(**kwargs).choices[0]  # tool_choice auto by default
    assert reply.finish_reason == "tool_calls" and reply.message.content == "Sure. "
    assert calls(reply.message) == [("get_time", {"zone": "UTC"})]
    assert streamed(oai, **kwargs) == ("Sure. ", [("get_time", {"zone": "UTC"})], "tool_calls")
    for stream in (False, True):
        kwargs["tool_choice"] = "none"
        if stream:
            assert streamed(oai, **kwargs) == ("Sure. " + FORCED_CALL, [], "stop")
            continue
        reply = oai.chat.completions.create(**kwargs).choices[0]
        assert reply.finish_reason == "stop" and reply.message.tool_calls == []
        assert reply.message.content == "Sure. " + FORCED_CALL


def test_streamed_tool_calls_are_openai_chunks(oai):
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "stream": True,
            "parallel_tool_calls": False, "max_tokens": 600, "seed": 0, "logprobs": True}
    with httpx.stream("POST", f"{oai.base_url}chat/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    chunks = [ChatCompletionChunk.model_validate(e) for e in events]
    deltas = [c.choices[0].delta for c in chunks]
    assert any(d.tool_calls for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # every token's log-probability arrives, on the chunks of its step
    num_logprobs = sum(len(c.choices[0].logprobs.content) for c in chunks
                       if c.choices[0].logprobs is not None)
    assert num_logprobs == len(httpx.post(f"{oai.base_url}chat/completions", json={
        **body, "stream": False}, timeout=60).json()["choices"][0]["logprobs"]["content"])


def test_a_tool_result_goes_back_and_gets_an_answer(oai):
    first = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0].message
    call = first.tool_calls[0]
    conversation = [*MESSAGES, first.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    answer = oai.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS,
                                         tool_choice="none", max_tokens=8, seed=1)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert isinstance(answer.choices[0].message.content, str)
    without = oai.chat.completions.create(model=MODEL, messages=conversation[:1], tools=TOOLS,
                                          tool_choice="none", max_tokens=1)
    assert answer.usage.prompt_tokens > without.usage.prompt_tokens + 20  # the call, the result


@pytest.mark.parametrize("extra, field", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    # response_format goes with forced calls (the calls' grammar governs, as in vLLM); the
    # other constraints do not
    ({"tools": TOOLS, "tool_choice": "required", "extra_body": {"guided_regex": "a+"}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "f", "arguments": "not json"}}]}]}, "arguments"),
])
def test_bad_tool_requests_answer_400_naming_the_field(oai, extra, field):
    body = {"messages": MESSAGES, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, max_tokens=5, **body)
    assert field in str(err.value)
