"""--reasoning-parser, --tool-call-parser qwen3_coder and chat_template_kwargs through HTTP
with the official openai client, against the engine test double. Its output is the prompt's
text echoed one token per step, and the chat template here renders the last message as it
is: so each test writes the model's output itself, and a stream arrives token by token."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from api_proc.protocol import ChatCompletionChunk, ChatCompletionResponse

# the last message as the whole prompt; an empty think block closing it when thinking is off
# (as Qwen3.5's template does); "tools" named so that requests with tools use it too
TEMPLATE = ("{{ messages[-1].content }}{% if tools %}{% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% endif %}")
THOUGHT = "Let me think: 2 + 2 < 5.</think>\n\nIt is 4."
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nLe Mans\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "echo.jinja"
    path.write_text(TEMPLATE)
    return str(path)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(server, content: str, **kwargs):
    kwargs.setdefault("max_tokens", 200)
    return client(server).chat.completions.create(
        model=None, messages=[{"role": "user", "content": content}], **kwargs)


def streamed(server, content: str, **kwargs) -> tuple[list[tuple[str, str]], list, object]:
    """The stream's deltas in order as (field, text), its tool call deltas, its usage."""
    parts, calls, usage = [], [], None
    for chunk in ask(server, content, stream=True, stream_options={"include_usage": True},
                     **kwargs):
        ChatCompletionChunk.model_validate(chunk.model_dump(exclude_unset=True))
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if "reasoning" in extra:
            assert extra["reasoning_content"] == extra["reasoning"]
            assert delta.content is None and not delta.tool_calls
            parts.append(("reasoning", extra["reasoning"]))
        if delta.content:
            parts.append(("content", delta.content))
        calls += delta.tool_calls or []
    return parts, calls, usage


def joined(parts: list[tuple[str, str]], field: str) -> str | None:
    return "".join(text for f, text in parts if f == field) or None


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_reasoning_and_content_streamed_and_not(start_app, engine_double, template, parser):
    server = start_app(engine_double, chat_template=template, reasoning_parser=parser)
    reply = ask(server, THOUGHT)
    message = reply.choices[0].message
    assert message.model_extra == {"reasoning": "Let me think: 2 + 2 < 5.",
                                   "reasoning_content": "Let me think: 2 + 2 < 5."}
    assert message.content == "\n\nIt is 4." and reply.choices[0].finish_reason == "stop"
    parts, _, usage = streamed(server, THOUGHT)
    kinds = [f for f, _ in parts]
    assert kinds == sorted(kinds, reverse=True)  # every reasoning delta before any content
    assert kinds.count("reasoning") > 3  # token by token
    assert (joined(parts, "reasoning"), joined(parts, "content")) == (
        message.model_extra["reasoning"], message.content)
    plain = start_app(engine_double, chat_template=template)
    assert usage == reply.usage == ask(plain, THOUGHT).usage  # counts are the tokens'
    # cut by max_tokens inside the thinking: all reasoning, content None
    cut = ask(server, THOUGHT, max_tokens=3).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None
    assert cut.message.model_extra["reasoning"]


def test_without_a_parser_nothing_changes(start_app, engine_double, template):
    server = start_app(engine_double, chat_template=template)
    body = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": THOUGHT}]}).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": THOUGHT,
                                             "tool_calls": []}
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": THOUGHT}], "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in lines]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(set(d) == {"content"} for d in deltas[1:])
    assert "".join(d["content"] for d in deltas) == THOUGHT


def test_enable_thinking_false_reaches_the_template(start_app, engine_double, template):
    server = start_app(engine_double, chat_template=template, reasoning_parser="qwen3")
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    message = ask(server, "Hi.", extra_body=off).choices[0].message
    # the template closed the think block in the prompt: all the output is content
    assert message.content == "Hi.<think>\n\n</think>\n\n"
    assert message.model_extra == {"reasoning": None, "reasoning_content": None}
    parts, _, _ = streamed(server, "Hi.", extra_body=off)
    assert joined(parts, "content") == message.content and joined(parts, "reasoning") is None
    # thinking on (the default): the output is thought until </think>, here all of it
    message = ask(server, "Hi.").choices[0].message
    assert (message.content, message.model_extra["reasoning"]) == (None, "Hi.")
    # a server default, which a request overrides
    off_by_default = start_app(engine_double, chat_template=template, reasoning_parser="qwen3",
                               default_chat_template_kwargs='{"enable_thinking": false}')
    assert ask(off_by_default, "Hi.").choices[0].message.content == "Hi.<think>\n\n</think>\n\n"
    on = {"chat_template_kwargs": {"enable_thinking": True}}
    assert ask(off_by_default, "Hi.", extra_body=on).choices[0].message.content is None


@pytest.mark.parametrize("kwargs, says", [
    ({"messages": []}, "chat_template_kwargs: messages cannot be set"),
    ({"add_generation_prompt": False, "tools": None}, "add_generation_prompt, tools cannot"),
    ([True], "chat_template_kwargs: Input should be an object"),
])
def test_bad_chat_template_kwargs_are_400_naming_the_field(server_plain, kwargs, says):
    with pytest.raises(openai.BadRequestError) as err:
        ask(server_plain, "x", extra_body={"chat_template_kwargs": kwargs})
    assert says in err.value.message and err.value.body["param"] == "chat_template_kwargs"


@pytest.fixture
def server_plain(start_app, engine_double, template):
    return start_app(engine_double, chat_template=template)


@pytest.mark.parametrize("interval", [1, 5], ids=["token-by-token", "stream-interval-5"])
@pytest.mark.parametrize("reasoning", [None, "qwen3"])
def test_qwen3_coder_calls_after_the_reasoning(start_app, engine_double, template, reasoning,
                                               interval):
    """Streamed token by token or five tokens a chunk (the parsers read the chunk's text as
    one piece), the same reasoning, content and call as the whole answer."""
    server = start_app(engine_double, chat_template=template, reasoning_parser=reasoning,
                       tool_call_parser="qwen3_coder", enable_auto_tool_choice=True,
                       stream_interval=interval)
    thought = "I need the weather.</think>\n\n" if reasoning else ""
    text = thought + "Sure.\n" + CALL
    reply = ask(server, text, tools=TOOLS).choices[0]
    content = "\n\nSure.\n" if reasoning else "Sure.\n"  # what follows </think>, as in vLLM
    assert reply.finish_reason == "tool_calls" and reply.message.content == content
    [call] = reply.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Le Mans", "days": 3}
    if reasoning:
        assert reply.message.model_extra["reasoning"] == "I need the weather."
    else:
        assert not reply.message.model_extra  # no reasoning fields without the parser
    parts, calls, _ = streamed(server, text, tools=TOOLS)
    assert joined(parts, "reasoning") == (reasoning and "I need the weather.")
    assert joined(parts, "content") == content
    assert [c.function.name for c in calls] == ["get_weather", None]
    assert calls[1].function.arguments == call.function.arguments
    # hermes' JSON is not a qwen3_coder call: it stays text
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    reply = ask(server, thought + hermes, tools=TOOLS).choices[0]
    assert reply.finish_reason == "stop"
    assert reply.message.content == content.removesuffix("Sure.\n") + hermes


def test_responses_validate_against_the_protocol_models(start_app, engine_double, template):
    server = start_app(engine_double, chat_template=template, reasoning_parser="qwen3")
    body = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": THOUGHT}]}).json()
    message = ChatCompletionResponse.model_validate(body).choices[0].message
    assert message.reasoning == message.reasoning_content == "Let me think: 2 + 2 < 5."
