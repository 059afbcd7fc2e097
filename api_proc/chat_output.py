"""One chat choice's text read out as vLLM reads it: reasoning first (reasoning_parser.py),
then tool calls out of the content part only (tool_parser.py). Either may be absent; a
choice with neither is not read at all (responses.py writes its text as it comes).

Deltas are OpenAI's, in order: `{"reasoning": ...}`, `{"content": ...}` and
`{"tool_calls": [...]}`; a streamed response writes one chunk per delta, a non-streamed one
joins them (assemble) into its message.
"""

from __future__ import annotations

from api_proc.reasoning_parser import ReasoningParser
from api_proc.tool_parser import ToolCallParser
from api_proc.tool_parser import assemble as assemble_tool_calls


class ChatOutputParser:
    __slots__ = ("_reasoning", "_tools")

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    @property
    def num_calls(self) -> int:
        return 0 if self._tools is None else self._tools.num_calls

    @property
    def calls_only(self) -> bool:
        """tool_choice required or named: the message's content is "" beside its calls."""
        return self._tools is not None and self._tools.calls_only

    def feed(self, text: str) -> list[dict]:
        if self._reasoning is None:
            return self._tools.feed(text)
        return self._calls(self._reasoning.feed(text))

    def finish(self) -> list[dict]:
        """What is still held, at the end of the completion."""
        deltas = [] if self._reasoning is None else self._calls(self._reasoning.finish())
        if self._tools is not None:
            deltas += self._tools.finish()
        return deltas

    def _calls(self, deltas: list[dict]) -> list[dict]:
        if self._tools is None:
            return deltas
        out: list[dict] = []
        for delta in deltas:
            if "content" in delta:
                out += self._tools.feed(delta["content"])
            else:
                out.append(delta)
        return out


def assemble(deltas: list[dict]) -> tuple[str | None, str | None, list[dict]]:
    """Deltas joined as a client joins a stream: (reasoning, content, tool calls). Reasoning
    is None when there is none; content is None when there are calls or reasoning and no
    text (vLLM's non-streamed message)."""
    reasoning = "".join(d["reasoning"] for d in deltas if "reasoning" in d)
    content, calls = assemble_tool_calls([d for d in deltas if "reasoning" not in d])
    if reasoning and not content:
        content = None
    return reasoning or None, content, calls
