"""The tool choices' constraints, checked against the texts they must accept and refuse,
through the same EBNF path the engine compiles (engine_proc/grammar_worker.py)."""

from __future__ import annotations

import json

import pytest

from api_proc.protocol import Tool
from api_proc.tool_grammar import tool_call_constraint

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

from engine_proc.grammar_worker import _json_strings_without_controls  # noqa: E402

TOOLS = [Tool.model_validate(t) for t in (
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: {}
)]


def call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


TIME, PING = call("get_time", {"zone": "UTC"}), call("ping", {})


def accepts(constraint: tuple[str, str], text: str) -> bool:
    kind, spec = constraint
    assert kind == "structural_tag"
    ebnf = _json_strings_without_controls(str(xgr.Grammar.from_structural_tag(spec)))
    return _is_grammar_accept_string(ebnf, text)


def test_named_is_one_call_to_that_function():
    named = tool_call_constraint(TOOLS, "named", "get_time", parallel=True)
    assert accepts(named, TIME)
    assert not accepts(named, PING)
    assert not accepts(named, call("get_time", {"zone": "PST"}))
    assert not accepts(named, TIME + "\n" + TIME)
    assert not accepts(named, "Sure. " + TIME)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_one_or_more_calls_and_nothing_else(parallel):
    required = tool_call_constraint(TOOLS, "required", None, parallel)
    assert accepts(required, TIME) and accepts(required, PING)
    assert accepts(required, TIME + "\n" + PING) == parallel
    assert not accepts(required, "")
    assert not accepts(required, "Sure. " + TIME)
    assert not accepts(required, call("ping", {"x": 1}))


def test_auto_is_free_unless_a_function_is_strict():
    assert tool_call_constraint(TOOLS, "auto", None, parallel=True) is None
    assert tool_call_constraint(TOOLS, "none", None, parallel=True) is None
    strict = [TOOLS[0].model_copy(update={"function": TOOLS[0].function.model_copy(
        update={"strict": True})}), TOOLS[1]]
    auto = tool_call_constraint(strict, "auto", None, parallel=True)
    assert accepts(auto, "Hello.") and accepts(auto, "Sure. " + TIME + " done")
    assert not accepts(auto, "Sure. " + call("get_time", {"zone": "PST"}))


def xml_call(name: str, body: str) -> str:
    return f"<tool_call>\n<function={name}>\n{body}\n</function>\n</tool_call>"


WEATHER = Tool.model_validate({"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}})
XML_WEATHER = xml_call("weather", "<parameter=city>\nLe Mans\n</parameter>\n"
                                  "<parameter=days>\n3\n</parameter>")


def test_qwen3_coder_calls_are_qwen3_coder_xml_that_its_parser_reads():
    from api_proc.tool_parser import ToolCallParser, assemble
    from api_proc.xml_tool_call import XmlCallReader, parameter_types

    tools = [*TOOLS, WEATHER]
    named = tool_call_constraint(tools, "named", "weather", True, "qwen3_coder")
    assert accepts(named, XML_WEATHER)
    assert not accepts(named, xml_call("weather", "<parameter=city>\nX\n</parameter>\n"
                                                  "<parameter=days>\nthree\n</parameter>"))
    assert not accepts(named, xml_call("weather", "<parameter=city>\nX\n</parameter>"))
    assert not accepts(named, call("weather", {"city": "X", "days": 1}))  # hermes JSON
    required = tool_call_constraint(tools, "required", None, False, "qwen3_coder")
    time = xml_call("get_time", "<parameter=zone>UTC</parameter>")
    assert accepts(required, time) and accepts(required, xml_call("ping", ""))
    assert not accepts(required, xml_call("get_time", "<parameter=zone>PST</parameter>"))
    assert not accepts(required, time + "\n" + time)  # parallel false: one call
    parser = ToolCallParser(True, XmlCallReader(parameter_types(
        [t.model_dump(exclude_none=True) for t in tools])))
    strict = [WEATHER.model_copy(update={"function": WEATHER.function.model_copy(
        update={"strict": True})})]
    auto = tool_call_constraint(strict, "auto", None, True, "qwen3_coder")
    assert accepts(auto, "Hello.") and accepts(auto, "Sure. " + XML_WEATHER + " done")
    assert not accepts(auto, "Sure. " + xml_call("weather", "<parameter=days>\n3\n</parameter>"))
    content, calls = assemble([*parser.feed(XML_WEATHER + "\n" + time), *parser.finish()])
    assert content is None
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Le Mans", "days": 3}, {"zone": "UTC"}]
