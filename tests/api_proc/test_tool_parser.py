"""Qwen's (hermes) tool-call output read whole and as a stream split at every character."""

from __future__ import annotations

import json

import pytest

from api_proc.protocol import ChatCompletionChunk
from api_proc.tool_parser import (
    ToolCallParser,
    assemble,
    read_cut_hermes_call,
    read_hermes_call,
)


def call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def parse_tool_calls(text: str, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """The whole text at once, as a non-streaming response reads it."""
    parser = ToolCallParser(parallel)
    return assemble([*parser.feed(text), *parser.finish()])


WEATHER = call("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = call("get_time", {"zone": "Europe/Paris"})


def calls_of(text: str, parallel: bool = True) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(text, parallel)
    for c in calls:
        assert c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in calls]


def test_plain_text_is_content_as_it_is():
    assert calls_of("Hello there.\n") == ("Hello there.\n", [])
    assert calls_of("  \n") == ("  \n", [])
    assert calls_of("") == ("", [])
    assert calls_of("a < b and <tool") == ("a < b and <tool", [])


def test_one_call():
    assert calls_of(WEATHER) == (None, [("get_weather", {"city": "Paris", "unit": "celsius"})])


def test_two_calls_and_the_newline_between_them():
    content, calls = calls_of(WEATHER + "\n" + TIME)
    assert content is None
    assert [name for name, _ in calls] == ["get_weather", "get_time"]


def test_parallel_false_keeps_the_first_call():
    assert calls_of(WEATHER + "\n" + TIME, parallel=False)[1] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_text_before_and_after_a_call_is_content():
    content, calls = calls_of("Let me look.\n" + WEATHER + "\nDone.")
    assert content == "Let me look.\n\nDone."
    assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_malformed_json_falls_back_to_content():
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'
    assert calls_of(bad) == (bad, [])
    not_a_call = '<tool_call>\n["get_weather"]\n</tool_call>'
    assert calls_of(not_a_call) == (not_a_call, [])
    # a good call before it stays a call
    content, calls = calls_of(WEATHER + "\n" + bad)
    assert content == "\n" + bad and [n for n, _ in calls] == ["get_weather"]


def test_an_unclosed_call_counts_when_its_json_is_whole():
    """A stop string or max_tokens can cut the closing tag (hermes accepts it too); a call
    cut inside its JSON stays text."""
    assert calls_of(WEATHER.removesuffix("\n</tool_call>"))[1] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    cut = WEATHER[:30]
    assert calls_of(cut) == (cut, [])


def test_arguments_keep_unicode_and_default_to_an_empty_object():
    content, calls = parse_tool_calls('<tool_call>{"name": "say", "arguments": {"t": "日本"}}'
                                      '</tool_call><tool_call>{"name": "ping"}</tool_call>')
    assert content is None
    assert [c["function"]["arguments"] for c in calls] == ['{"t": "日本"}', "{}"]


TEXTS = [
    "Hello there.\n",
    WEATHER,
    WEATHER + "\n" + TIME,
    "Let me look.\n" + WEATHER + "\nDone.",
    "  \n" + WEATHER + "\n\n",
    '<tool_call>\n{"name": "x", "arguments": {"a": 1}\n</tool_call> tail',
    WEATHER + "\n<tool_call>\n{oops}\n</tool_call>\n" + TIME,
    "<tool_cal>not a tag</tool_call><<tool_call>" + TIME[len("<tool_call>"):],
    WEATHER.removesuffix("</tool_call>"),
]


def _ids_dropped(calls: list[dict]) -> list[dict]:
    return [{**c, "id": None} for c in calls]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("parallel", [True, False])
def test_a_stream_split_anywhere_reads_as_the_whole_text(text, parallel):
    want_content, want_calls = parse_tool_calls(text, parallel)
    cuts = [[i] for i in range(len(text) + 1)] + [list(range(0, len(text) + 1, 1))]
    for cut in cuts:
        parser = ToolCallParser(parallel)
        deltas, start = [], 0
        for end in [*cut, len(text)]:
            deltas += parser.feed(text[start:end])
            start = end
        deltas += parser.finish()
        content, calls = assemble(deltas)
        assert (content or None, _ids_dropped(calls)) == (want_content or None,
                                                         _ids_dropped(want_calls)), cut


def test_deltas_are_openai_chunk_deltas():
    parser = ToolCallParser()
    deltas = [*parser.feed("Sure. " + WEATHER), *parser.finish()]
    first, second = deltas[1]["tool_calls"][0], deltas[2]["tool_calls"][0]
    assert set(first) == {"index", "id", "type", "function"}
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert set(second) == {"index", "function"} and set(second["function"]) == {"arguments"}
    for delta in deltas:
        ChatCompletionChunk.model_validate({"id": "x", "created": 0, "model": "m", "choices": [
            {"index": 0, "delta": delta, "finish_reason": None}]})


def cut_calls(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The text read as tool_choice required or named reads it (a grammar writes calls from
    the first token): a call cut short is still a call, with its arguments so far."""
    parser = ToolCallParser(True, read_hermes_call, read_cut_hermes_call)
    content, calls = assemble([*parser.feed(text), *parser.finish()])
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("text, want", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
     [("get_weather", '{"city": "Pa')]),
    ('<tool_call>\n{"name": "get_wea', [("get_wea", "")]),
    ("<tool_call>\n", [("", "")]),
    ("<tool_", [("", "")]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_', [("f", '{"a": 1}')]),
    (WEATHER + '\n<tool_call>\n{"name": "g", "arguments": {',
     [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("g", "{")]),
])
def test_a_call_cut_short_under_a_grammar_stays_a_call(text, want):
    assert cut_calls(text) == (None, want)
    assert calls_of(text)[1] == [] or text.startswith(WEATHER)  # free text: it stays text
