"""Qwen3.5's serving flags through the official openai client against a real server on the
tiny random model (`--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser
qwen3_coder`, as vLLM's recipe serves Qwen3.5) with a template that, like Qwen3.5's, opens a
think block in the generation prompt unless chat_template_kwargs turn thinking off. The
random weights write what a grammar makes them write: forced reasoning splits, forced
Qwen3-Coder calls parse with typed arguments, streamed = non-streamed."""

from __future__ import annotations

import json

import openai
import pytest

from tests.e2e.server_process import REPO, ServerProcess

pytest.importorskip("xgrammar")

MODEL = "flatserve-tiny-qwen2.5-vl"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "metric": {"type": "boolean"}},
    "required": ["city", "days", "metric"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]
THINKING_PROMPT = """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}"""


@pytest.fixture(scope="module")
def oai(tmp_path_factory, tiny_model_path):
    folder = tmp_path_factory.mktemp("server")
    tool_template = (REPO / "shared" / "data" / "qwen_tool_chat_template.jinja").read_text()
    start = tool_template.index("{%- if add_generation_prompt %}")
    (folder / "thinking.jinja").write_text(tool_template[:start] + THINKING_PROMPT)
    proc = ServerProcess("--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
                         "--tool-call-parser", "qwen3_coder", "--chat-template",
                         str(folder / "thinking.jinja"), log_path=folder / "server.log")
    try:
        proc.wait_ready()
        yield openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
    finally:
        proc.stop()


def streamed(oai, **kwargs) -> tuple[str | None, str, list[tuple[str, str]], str]:
    """(reasoning, content, calls as (name, arguments), finish reason) joined from a stream."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            calls.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments
        finish = choice.finish_reason or finish
    return reasoning or None, content, [tuple(c) for c in calls.values()], finish


def test_forced_thinking_splits_into_reasoning_and_content(oai):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=60, seed=3, temperature=1.0,
                  extra_body={"guided_regex": "<think>[a-z ]{1,12}</think>\n\nIt is [0-9]"})
    reply = oai.chat.completions.create(**kwargs).choices[0]
    reasoning = reply.message.model_extra["reasoning"]
    assert reply.message.model_extra["reasoning_content"] == reasoning
    assert 1 <= len(reasoning) <= 12 and set(reasoning) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert reply.message.content.startswith("\n\nIt is ") and len(reply.message.content) == 9
    assert streamed(oai, **kwargs) == (reasoning, reply.message.content, [], "stop")


def test_enable_thinking_reaches_the_template_and_the_parser(oai):
    ask = dict(model=MODEL, messages=MESSAGES, max_tokens=6, seed=1,
               extra_body={"min_tokens": 6})
    off = oai.chat.completions.create(**ask | {"extra_body": {
        "min_tokens": 6, "chat_template_kwargs": {"enable_thinking": False}}})
    on = oai.chat.completions.create(**ask)
    # the empty think block the template renders when thinking is off: "\n</think>\n\n" more
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert off.usage.completion_tokens == on.usage.completion_tokens == 6
    # off: the prompt closed the thinking, the output is content; on: it is thought
    assert off.choices[0].message.model_extra["reasoning"] is None
    assert isinstance(off.choices[0].message.content, str)
    assert on.choices[0].message.content is None
    assert on.choices[0].message.model_extra["reasoning"]
    assert streamed(oai, **ask)[:2] == (on.choices[0].message.model_extra["reasoning"], "")


def test_chat_template_kwargs_reach_the_checkpoints_own_template(server):
    # the tiny checkpoint's template (Qwen2-VL's) reads add_vision_id: "Picture 1: " per image
    image = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4"
             "nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC")
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "hi"}]}]
    plain = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    counts = [plain.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1,
        extra_body={"chat_template_kwargs": {"add_vision_id": flag}}).usage.prompt_tokens
        for flag in (False, True)]
    assert counts[1] > counts[0]


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_qwen3_coder_calls_have_typed_arguments_every_time(oai, choice):
    tool_choice = ({"type": "function", "function": {"name": "get_weather"}}
                   if choice == "named" else "required")
    for seed in range(6):
        kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                      parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=seed)
        reply = oai.chat.completions.create(**kwargs).choices[0]
        assert reply.finish_reason == "tool_calls" and reply.message.content == ""
        assert reply.message.model_extra["reasoning"] is None  # the grammar left no thinking
        [call] = reply.message.tool_calls
        arguments = json.loads(call.function.arguments)
        if call.function.name == "ping":
            assert choice == "required" and arguments == {}
        else:
            assert set(arguments) == {"city", "days", "metric"}
            assert type(arguments["days"]) is int and 1 <= arguments["days"] <= 7
            assert type(arguments["metric"]) is bool and isinstance(arguments["city"], str)
        if seed < 2:
            assert streamed(oai, **kwargs) == (
                None, "", [(call.function.name, call.function.arguments)], "tool_calls")


def test_bad_chat_template_kwargs_are_400_naming_them(oai):
    for kwargs, says in [({"messages": []}, "messages cannot be set"),
                         ({"x": "y" * 70000}, "longer than 65536 characters")]:
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                        extra_body={"chat_template_kwargs": kwargs})
        assert "chat_template_kwargs: " + says in err.value.message
