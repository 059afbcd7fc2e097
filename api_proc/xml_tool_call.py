"""Qwen3-Coder's tool calls (vLLM's `qwen3_coder` parser; Qwen3.5 writes them too): the body
between `<tool_call>` and `</tool_call>` (tool_parser.py finds those) is

    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>

A value is text (one newline after its opening tag and one before its closing tag are
layout); it becomes the JSON value its parameter's type in the tool's schema says: a string
stays text, integer/number/boolean/object/array are parsed and stay text when they do not
parse (vLLM's rules, less its Python-literal fallback), `null` is null for a non-string, an
enum's (or const's) value is the one the text names, whitespace around it dropped (the
grammar's qwen_xml form allows it). A parameter the schema does not name stays text. A body
of any other shape is not a call (its text stays content, as a hermes call whose JSON is
malformed).
"""

from __future__ import annotations

import json
import math

FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"

# the type names of JSON schema, and the loose ones vLLM accepts for them
_TYPE_PREFIXES = (("int", "integer"), ("uint", "integer"), ("long", "integer"),
                  ("num", "number"), ("float", "number"), ("double", "number"),
                  ("bool", "boolean"), ("object", "object"), ("dict", "object"),
                  ("array", "array"), ("list", "array"))


def _type_name(schema: object) -> str | tuple:
    """A parameter schema's type name, or the tuple of its enum values (const: one)."""
    if isinstance(schema, dict) and "type" not in schema:
        if isinstance(schema.get("enum"), list):
            return tuple(schema["enum"])
        if "const" in schema:
            return (schema["const"],)
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]: the type it has when it is not null
        kind = next((k for k in kind if k != "null"), None)
    if not isinstance(kind, str):
        return "string"
    kind = kind.strip().lower()
    return next((name for prefix, name in _TYPE_PREFIXES if kind.startswith(prefix)), "string")


def parameter_types(tools: list[dict]) -> dict[str, dict[str, str | tuple]]:
    """Function name -> parameter name -> type name, of OpenAI tool definitions (dicts)."""
    types = {}
    for tool in tools:
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties")
        if isinstance(properties, dict):
            types[function["name"]] = {k: _type_name(v) for k, v in properties.items()}
    return types


def convert(value: str, kind: str | tuple) -> object:
    """A parameter's text as the JSON value of type `kind` (a tuple: one of those values),
    or the text when it is not one."""
    if kind == "string":
        return value
    text = value.strip()  # around a value that is not a string, whitespace is layout
    if isinstance(kind, tuple):
        return next((v for v in kind if v == text or (not isinstance(v, str) and
                                                      json.dumps(v) == text)), value)
    if text.lower() == "null":
        return None
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), value)
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            try:
                return int(text)
            except ValueError:
                number = float(text)
                return number if math.isfinite(number) else value
        if kind in ("object", "array"):
            parsed = json.loads(text)
            return parsed if isinstance(parsed, dict if kind == "object" else list) else value
    except ValueError:
        pass
    return value


class XmlCallReader:
    """A call's body to (name, arguments JSON), or None when it is not a call; `types`:
    parameter_types of the request's tools."""

    __slots__ = ("_types",)

    def __init__(self, types: dict[str, dict[str, str | tuple]]) -> None:
        self._types = types

    def __call__(self, body: str) -> tuple[str, str] | None:
        text = body.strip()
        if not text.startswith(FUNCTION_START) or not text.endswith(FUNCTION_END):
            return None
        close = text.find(">", len(FUNCTION_START))
        name = text[len(FUNCTION_START):close].strip() if close > 0 else ""
        if not name or "<" in name or "\n" in name:
            return None
        arguments = _parameters(text[close + 1:len(text) - len(FUNCTION_END)],
                                self._types.get(name, {}))
        if arguments is None:
            return None
        return name, json.dumps(arguments, ensure_ascii=False)

    def cut(self, body: str) -> tuple[str, str]:
        """(name, arguments JSON) of a call cut before its end: the name once its tag is
        closed, the parameters whose closing tag was written."""
        text = body.strip()
        close = text.find(">", len(FUNCTION_START))
        if not text.startswith(FUNCTION_START) or close < 0:
            return "", "{}"
        name = text[len(FUNCTION_START):close].strip()
        arguments: dict = {}
        _parameters(text[close + 1:], self._types.get(name, {}), arguments)
        return name, json.dumps(arguments, ensure_ascii=False)


def _parameters(text: str, types: dict[str, str | tuple],
                arguments: dict | None = None) -> dict | None:
    """The `<parameter=...>` elements of a function's body; None when there is other text
    (`arguments` then holds those before it)."""
    arguments = {} if arguments is None else arguments
    at = 0
    while True:
        at = len(text) - len(text[at:].lstrip())
        if at == len(text):
            return arguments
        if not text.startswith(PARAMETER_START, at):
            return None
        close = text.find(">", at + len(PARAMETER_START))
        end = text.find(PARAMETER_END, close + 1) if close > 0 else -1
        key = text[at + len(PARAMETER_START):close]
        if end < 0 or not key or "<" in key or "\n" in key:
            return None
        value = text[close + 1:end].removeprefix("\n").removesuffix("\n")
        arguments[key] = convert(value, types.get(key, "string"))
        at = end + len(PARAMETER_END)
