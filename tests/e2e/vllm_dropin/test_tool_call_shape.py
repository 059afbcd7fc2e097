"""The shape of tool-call responses as vLLM writes them, through the official openai client
(issue 31, theme 4): `tool_calls: []` in a message without calls, `content: ""` beside forced
calls, and a forced call cut by max_completion_tokens still a call with finish_reason
length, never the call's raw text in content."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.vllm_dropin.conftest import MODEL

pytest.importorskip("xgrammar")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_message_without_calls_has_an_empty_list(dropin_server):
    body = httpx.post(dropin_server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 2}).json()
    assert body["choices"][0]["message"]["tool_calls"] == []


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_forced_calls_come_with_empty_content(oai, tool_choice):
    reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, seed=1,
                                        tool_choice=tool_choice, max_completion_tokens=300,
                                        parallel_tool_calls=False).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content == ""
    assert len(reply.message.tool_calls) == 1


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_a_forced_call_cut_by_the_token_limit_is_still_a_call(oai, tool_choice):
    args = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                max_completion_tokens=3, temperature=0)
    reply = oai.chat.completions.create(**args).choices[0]
    assert reply.finish_reason == "length"
    assert reply.message.content == "" and "<tool_call>" not in reply.message.content
    [call] = reply.message.tool_calls
    if tool_choice is NAMED:
        assert call.function.name == "get_weather"
    streamed_calls, content, finish = {}, "", None
    for chunk in oai.chat.completions.create(stream=True, **args):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            entry = streamed_calls.setdefault(d.index, ["", ""])
            entry[0] += d.function.name or ""
            entry[1] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "length" and "<tool_call>" not in content
    assert list(streamed_calls.values()) == [[call.function.name, call.function.arguments]]


def test_a_named_call_cut_inside_its_arguments_keeps_them_as_written(oai):
    reply = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, temperature=0,
        max_completion_tokens=40).choices[0]
    [call] = reply.message.tool_calls
    if reply.finish_reason == "length":
        assert call.function.arguments.startswith("{")
    else:
        assert json.loads(call.function.arguments)["city"]
