"""The output constraint that makes a model call tools: an xgrammar structural tag, so each
call is written the way Qwen's chat template writes calls (and tool_parser.py reads them)
while its arguments follow the function's JSON schema: hermes' JSON, or with
--tool-call-parser qwen3_coder Qwen3-Coder's XML (xgrammar's qwen_xml style: a string
parameter is raw text, the others JSON).

    named     one call to that function, nothing else
    required  calls to any of the functions, one per line, at least one (only one when
              parallel_tool_calls is false), nothing else
    auto      only when some function is `strict` (OpenAI's promise that calls match the
              schema): free text, but once `<tool_call>` is written the call names one of
              the functions and its arguments follow that function's schema (every
              function's, strict or not: one grammar serves them all)

Built here as JSON, compiled in the engine (engine_proc/grammar_worker.py): the API
process never imports xgrammar (it pulls in torch).
"""

from __future__ import annotations

import json

from api_proc.protocol import FunctionDefinition, Tool
from api_proc.tool_parser import TOOL_CALL_END, TOOL_CALL_START
from api_proc.xml_tool_call import FUNCTION_END, FUNCTION_START
from shared.sampling_params import MAX_JSON_WHITESPACE


def _call_tag(function: FunctionDefinition, parser: str) -> dict:
    # the name needs no escaping: FunctionDefinition allows [a-zA-Z0-9_-] only
    if parser == "qwen3_coder":
        return {"type": "tag", "begin": f"{TOOL_CALL_START}\n{FUNCTION_START}{function.name}>\n",
                "content": {"type": "json_schema", "json_schema": function.parameters_schema,
                            "style": "qwen_xml", "max_whitespace_cnt": MAX_JSON_WHITESPACE},
                "end": f"\n{FUNCTION_END}\n{TOOL_CALL_END}"}
    return {"type": "tag",
            "begin": f'{TOOL_CALL_START}\n{{"name": "{function.name}", "arguments": ',
            "content": {"type": "json_schema", "json_schema": function.parameters_schema,
                        "max_whitespace_cnt": MAX_JSON_WHITESPACE},
            "end": f"}}\n{TOOL_CALL_END}"}


def tool_call_constraint(tools: list[Tool], mode: str, named: str | None, parallel: bool,
                         parser: str = "hermes") -> tuple[str, str] | None:
    """SamplingParams.structured for a tool choice (`mode`: none, auto, required, named),
    or None when the output is free; `parser`: the format calls are written in."""
    functions = [t.function for t in tools]
    if mode == "named":
        fmt = _call_tag(next(f for f in functions if f.name == named), parser)
    elif mode == "required":
        fmt = {"type": "tags_with_separator", "tags": [_call_tag(f, parser) for f in functions],
               "separator": "\n", "at_least_one": True, "stop_after_first": not parallel}
    elif mode == "auto" and any(f.strict for f in functions):
        fmt = {"type": "triggered_tags", "triggers": [TOOL_CALL_START],
               "tags": [_call_tag(f, parser) for f in functions], "stop_after_first": not parallel}
    else:
        return None
    return ("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))
