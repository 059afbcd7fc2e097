"""Conversations with tools through the chat template: the shipped tool template when the
model's own does not render tools, as transformers renders it, tool results included."""

from __future__ import annotations

import json
import logging

import pytest

from api_proc.prompt_builder import (
    TOOL_TEMPLATE,
    PromptBuilder,
    compile_chat_template,
    template_messages,
)
from api_proc.protocol import ChatCompletionRequest

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
ROUND_TRIP = [
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,x"}},
                                 {"type": "text", "text": "Weather where this was taken?"}]},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
]


@pytest.fixture(scope="module")
def builder(tiny_model_path) -> PromptBuilder:
    return PromptBuilder.from_pretrained(tiny_model_path)


def _templated(messages: list[dict]) -> list[dict]:
    return template_messages(ChatCompletionRequest(messages=messages).messages)


def test_the_round_trip_renders_the_call_and_the_tool_result(builder):
    prompt = builder.render_chat(_templated(ROUND_TRIP), tools=TOOLS)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in prompt
    assert ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Weather where this "
            "was taken?<|im_end|>") in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in prompt
    assert prompt.endswith("<|im_start|>user\n<tool_response>\n{\"celsius\": 21}\n"
                           "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_the_tool_template_renders_as_transformers_does(tiny_model_path, builder):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_model_path))
    messages = [{"role": "system", "content": "Be terse."}, *_templated(ROUND_TRIP),
                {"role": "tool", "content": "second result"},
                {"role": "assistant", "content": "It is 21 degrees."},
                {"role": "user", "content": "Thanks"}]
    for tools in (TOOLS, None):
        want = hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                      add_generation_prompt=True,
                                      chat_template=TOOL_TEMPLATE.read_text())
        assert builder.render_chat(messages, tools=tools) == want


def test_conversations_without_tools_keep_the_models_template(tiny_model_path, builder):
    own = compile_chat_template((tiny_model_path / "chat_template.jinja").read_text())
    messages = _templated([{"role": "user", "content": "hi"}])
    assert builder.render_chat(messages) == own.render(messages=messages,
                                                       add_generation_prompt=True)


def test_the_tool_template_is_named_in_the_log_once(tiny_model_path, caplog):
    fresh = PromptBuilder.from_pretrained(tiny_model_path)
    with caplog.at_level(logging.INFO, logger="api_proc.prompt_builder"):
        fresh.render_chat(_templated(ROUND_TRIP), tools=TOOLS)
        fresh.render_chat(_templated(ROUND_TRIP))
    assert [r.getMessage().count(str(TOOL_TEMPLATE)) for r in caplog.records] == [1]


def test_a_chat_template_flag_that_renders_tools_is_used_for_them(tiny_model_path, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}"
                        "{% if tools %}{{ tools | length }} tools{% endif %}")
    b = PromptBuilder.from_pretrained(tiny_model_path, chat_template=template)
    assert b.render_chat(_templated(ROUND_TRIP), tools=TOOLS) == "[user][assistant][tool]1 tools"
    assert b.render_chat(_templated([{"role": "user", "content": "x"}])) == "[user]"
