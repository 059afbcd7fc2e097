"""Tool calls in Qwen's (hermes) format, out of the completion's text (Qwen3-Coder's XML
inside the same tags: xml_tool_call.py):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

vLLM's `hermes` parser is the reference, with two changes that make a stream split anywhere
give the same result as the whole text (tests hold this at every character boundary):

- A call is announced when its closing tag arrives (or at the end of the completion, where
  an unclosed call is accepted if its JSON is whole, as hermes does), never while its JSON
  is still partial. A client cannot run half a call anyway, and holding it lets a call whose
  JSON turns out malformed fall back to plain content, which it does by itself: the calls
  before it stay calls (hermes turns the whole text into content).
- Text outside calls stays content (hermes drops what follows the first call), except
  whitespace-only runs next to a call: the newline between two calls is layout, not content.

With tool_choice required or named a grammar writes calls from the first token; a completion
cut inside a call (max_tokens) reports it as a call with the name and arguments written so
far, as vLLM does, never as the raw text in content.

The state is the text of the call in progress and a few characters that may begin a tag
(R2: nothing grows with the completion beyond one call).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def read_hermes_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call's body, or None when it is not a call."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


_CUT_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"?(?:\s*,\s*"arguments"\s*:\s*(.*))?',
                       re.S)


def read_cut_hermes_call(body: str) -> tuple[str, str]:
    """(name, arguments text so far) of a call cut before its end: the name as far as it was
    written, the arguments' JSON text as it stands."""
    found = _CUT_CALL.match(body)
    if found is None:
        return "", ""
    name = found.group(1)
    try:
        name = json.loads(f'"{name}"')
    except ValueError:  # cut inside an escape: the text as written
        pass
    return name, found.group(2) or ""


def _without_partial_end(body: str) -> str:
    """`body` less an end that may begin TOOL_CALL_END."""
    for k in range(min(len(body), len(TOOL_CALL_END) - 1), 0, -1):
        if TOOL_CALL_END.startswith(body[-k:]):
            return body[:-k]
    return body


def _partial_tag(text: str) -> int:
    """Length of the longest end of `text` that may begin TOOL_CALL_START."""
    for k in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-k:]):
            return k
    return 0


class ToolCallParser:
    """Fed text deltas, returns OpenAI delta dicts: `{"content": ...}` or
    `{"tool_calls": [...]}` (a call's first delta: index, id, type, function.name with
    arguments ""; its second: index and the arguments). `parallel`: false keeps only the
    first call, as OpenAI's parallel_tool_calls: false asks. `read_call`: a call's body
    (between the tags) to (name, arguments JSON), None when it is not a call: hermes' JSON
    by default, Qwen3-Coder's XML with xml_tool_call.XmlCallReader. `read_cut_call`: given
    when a grammar writes calls from the first token (required, named): a body cut short to
    (name, arguments so far), reported as a call at the end of the completion."""

    __slots__ = ("_parallel", "_read_call", "_read_cut_call", "_buf", "_in_call", "_held",
                 "_said", "num_calls")

    def __init__(self, parallel: bool = True,
                 read_call: Callable[[str], tuple[str, str] | None] = read_hermes_call,
                 read_cut_call: Callable[[str], tuple[str, str]] | None = None) -> None:
        self._parallel = parallel
        self._read_call = read_call
        self._read_cut_call = read_cut_call
        self._buf = ""  # outside a call: may begin a tag; inside: the call's text so far
        self._in_call = False
        self._held = ""  # whitespace that opens a run of content, kept until it is decided
        self._said = False  # the current run of content has shown text
        self.num_calls = 0

    def feed(self, text: str) -> list[dict]:
        # inside a call only the new text (and the end of the old) can hold the closing tag
        seen = max(0, len(self._buf) - len(TOOL_CALL_END) + 1) if self._in_call else 0
        self._buf += text
        out: list[dict] = []
        while True:
            if self._in_call:
                end = self._buf.find(TOOL_CALL_END, seen)
                seen = 0
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(TOOL_CALL_END):]
                self._in_call = False
                self._close_call(body, TOOL_CALL_END, out)
                continue
            start = self._buf.find(TOOL_CALL_START)
            if start < 0:
                keep = _partial_tag(self._buf)
                self._content(self._buf[:len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            self._content(self._buf[:start], out)
            self._buf = self._buf[start + len(TOOL_CALL_START):]
            self._in_call = True

    @property
    def calls_only(self) -> bool:
        """A grammar writes calls from the first token (tool_choice required or named)."""
        return self._read_cut_call is not None

    def finish(self) -> list[dict]:
        """What is still held, at the end of the completion."""
        out: list[dict] = []
        if self._in_call:
            self._in_call = False
            body = self._buf if self._read_cut_call is None else _without_partial_end(self._buf)
            if self._read_cut_call is not None and self._read_call(body) is None:
                self._add_call(*self._read_cut_call(body), out)
            else:
                self._close_call(body, "", out)
        elif self._read_cut_call is not None and self._buf.strip():
            self._add_call(*self._read_cut_call(""), out)  # cut inside the opening tag
        else:
            self._content(self._buf, out)
        self._buf = ""
        if self._held and not self.num_calls:  # a text without calls is kept as it is
            out.append({"content": self._held})
        self._held = ""
        return out

    def _content(self, text: str, out: list[dict]) -> None:
        if not text:
            return
        if not self._said:
            text, self._held = self._held + text, ""
            if text.isspace():
                self._held = text
                return
            self._said = True
        out.append({"content": text})

    def _close_call(self, body: str, end_tag: str, out: list[dict]) -> None:
        call = self._read_call(body)
        if call is None:  # not a call: its text is content, tags included
            self._content(TOOL_CALL_START + body + end_tag, out)
            return
        self._add_call(*call, out)

    def _add_call(self, name: str, arguments: str, out: list[dict]) -> None:
        self._held, self._said = "", False
        if self.num_calls and not self._parallel:
            return
        index = self.num_calls
        self.num_calls += 1
        out.append({"tool_calls": [{"index": index, "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
                                    "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})
        out.append({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})


def assemble(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """Deltas joined as a client joins a stream: (content, tool calls); content is None
    when there are calls and no text (a non-streaming response is built this way)."""
    content: list[str] = []
    calls: list[dict] = []
    for delta in deltas:
        if "content" in delta:
            content.append(delta["content"])
            continue
        for d in delta["tool_calls"]:
            if d["index"] == len(calls):
                calls.append({"id": d["id"], "type": d["type"],
                              "function": {"name": d["function"]["name"], "arguments": ""}})
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    text = "".join(content)
    return (text or None) if calls else text, calls
