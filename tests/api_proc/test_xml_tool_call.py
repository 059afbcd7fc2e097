"""Qwen3-Coder's XML tool calls (--tool-call-parser qwen3_coder) read whole and as a stream
split at every character, values typed by the tool's schema."""

from __future__ import annotations

import json

import pytest

from api_proc.protocol import ChatCompletionChunk
from api_proc.tool_parser import ToolCallParser, assemble
from api_proc.xml_tool_call import XmlCallReader, convert, parameter_types

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
        "metric": {"type": "boolean"}, "where": {"type": "object"},
        "hours": {"type": "array", "items": {"type": "integer"}},
        "zone": {"enum": ["UTC", "CET", 1]}, "maybe": {"type": ["integer", "null"]}}}}},
    {"type": "function", "function": {"name": "ping"}}]
READER = XmlCallReader(parameter_types(TOOLS))


def call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def parse(text: str, parallel: bool = True) -> tuple[str | None, list[tuple[str, dict]]]:
    parser = ToolCallParser(parallel, READER)
    content, calls = assemble([*parser.feed(text), *parser.finish()])
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in calls]


WEATHER = call("get_weather", city="Paris", days="3")


def test_a_call_with_typed_values():
    text = call("get_weather", city="New York", days="3", ratio="0.5", metric="true",
                where='{"lat": 1.5, "tags": ["a"]}', hours="[1, 2]", zone="CET", maybe="null")
    assert parse(text) == (None, [("get_weather", {
        "city": "New York", "days": 3, "ratio": 0.5, "metric": True,
        "where": {"lat": 1.5, "tags": ["a"]}, "hours": [1, 2], "zone": "CET", "maybe": None})])


@pytest.mark.parametrize("value, kind, want", [
    ("3", "string", "3"), ("null", "string", "null"), (" x \n", "string", " x \n"),
    ("three", "integer", "three"), ("2.0", "integer", "2.0"), (" 7 ", "integer", 7),
    ("2.5", "number", 2.5), ("2", "number", 2), ("1e400", "number", "1e400"),
    ("nan", "number", "nan"), ("False", "boolean", False), ("yes", "boolean", "yes"),
    ("{oops", "object", "{oops"), ("[1]", "object", "[1]"), ("{}", "array", "{}"),
    ("NULL", "integer", None), (" UTC ", ("UTC", 1), "UTC"), ("1", ("UTC", 1), 1),
    ("PST", ("UTC",), "PST"),
])
def test_values_that_do_not_parse_stay_text(value, kind, want):
    assert convert(value, kind) == want


def test_unknown_functions_and_parameters_keep_text():
    assert parse(call("other", n="5"))[1] == [("other", {"n": "5"})]
    assert parse(call("get_weather", extra="5"))[1] == [("get_weather", {"extra": "5"})]
    assert parse(call("ping"))[1] == [("ping", {})]
    # one newline on each side is layout; the rest of a string is kept
    assert parse("<tool_call><function=ping><parameter=a>\n\n x\n\n</parameter></function>"
                 "</tool_call>")[1] == [("ping", {"a": "\n x\n"})]


def test_text_around_calls_and_two_calls():
    content, calls = parse("Let me look.\n" + WEATHER + "\n" + call("ping") + "\nDone.")
    assert content == "Let me look.\n\nDone."
    assert [name for name, _ in calls] == ["get_weather", "ping"]
    assert len(parse(WEATHER + "\n" + call("ping"), parallel=False)[1]) == 1


@pytest.mark.parametrize("bad", [
    "<tool_call>\n{\"name\": \"ping\", \"arguments\": {}}\n</tool_call>",  # hermes' JSON
    "<tool_call>\n<function=>\n</function>\n</tool_call>",
    "<tool_call>\n<function=ping>\n<parameter=a>1</function>\n</tool_call>",
    "<tool_call>\n<function=ping>\nstray text\n</function>\n</tool_call>",
    "<tool_call>\n<function=ping>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
    "<tool_call>\n<function=ping>\n<parameter=>\n1\n</parameter>\n</function>\n</tool_call>",
])
def test_malformed_calls_stay_content(bad):
    assert parse(bad) == (bad, [])
    content, calls = parse(WEATHER + bad)  # the call before it stays a call
    assert content == bad and len(calls) == 1


def test_an_unclosed_call_counts_when_its_function_is_whole():
    assert parse(WEATHER.removesuffix("\n</tool_call>"))[1] == [
        ("get_weather", {"city": "Paris", "days": 3})]
    cut = WEATHER[:-len("</function>\n</tool_call>")]
    assert parse(cut) == (cut, [])


TEXTS = [
    WEATHER,
    "Sure. " + WEATHER + "\n" + call("ping") + " tail",
    call("get_weather", where='{"a": "</parameter"}', city="<tool_call>"),
    "<tool_call>\n<function=ping>\nstray\n</function>\n</tool_call>\n" + WEATHER,
    WEATHER.removesuffix("</tool_call>"),
    "<tool_cal>x</tool_call><<tool_call><function=ping></function></tool_call>",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("parallel", [True, False])
def test_a_stream_split_anywhere_reads_as_the_whole_text(text, parallel):
    want = parse(text, parallel)
    for cut in [[i] for i in range(len(text) + 1)] + [list(range(len(text) + 1))]:
        parser = ToolCallParser(parallel, READER)
        deltas, start = [], 0
        for end in [*cut, len(text)]:
            deltas += parser.feed(text[start:end])
            start = end
        content, calls = assemble(deltas + parser.finish())
        got = (content or None, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                 for c in calls])
        assert got == (want[0] or None, want[1]), cut


def test_deltas_are_openai_chunk_deltas():
    parser = ToolCallParser(True, READER)
    deltas = [*parser.feed("Sure. " + WEATHER), *parser.finish()]
    first, second = deltas[1]["tool_calls"][0], deltas[2]["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert json.loads(second["function"]["arguments"]) == {"city": "Paris", "days": 3}
    for delta in deltas:
        ChatCompletionChunk.model_validate({"id": "x", "created": 0, "model": "m", "choices": [
            {"index": 0, "delta": delta, "finish_reason": None}]})


@pytest.mark.parametrize("text, want", [
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n3", ("get_weather", {"city": "Paris"})),
    ("<tool_call>\n<function=get_wea", ("", {})),
    ("<tool_call>\n<function=ping>\n</function>\n</tool", ("ping", {})),
])
def test_a_call_cut_short_under_a_grammar_stays_a_call(text, want):
    parser = ToolCallParser(True, READER, READER.cut)
    content, calls = assemble([*parser.feed(text), *parser.finish()])
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [want]
