"""Reasoning read out of a chat completion's text, as vLLM's --reasoning-parser does: what
the model thinks between `<think>` and `</think>` goes to message.reasoning (and to
reasoning_content, vLLM's older name for it), what follows to content.

    deepseek_r1  the output is reasoning until `</think>`; a `<think>` the model writes
                 itself is dropped
    qwen3        the same, and: chat_template_kwargs enable_thinking false makes the whole
                 output content; a Qwen3-Coder tool call (`<tool_call>` then `<function=`)
                 written before `</think>` ends the reasoning (Qwen3.5 calls tools so)

Where the output starts (start_mode): templates that open `<think>` in the prompt (Qwen3.5,
DeepSeek-R1) leave only `</think>` to the output, so it starts as reasoning, and one that
never writes `</think>` (cut by max_tokens) is all reasoning, as in vLLM. A prompt that ends
with `</think>` (enable_thinking false renders an empty think block) leaves none: all
content. With a grammar (structured outputs, a forced tool call) the engine constrains the
output from its first token, so the model cannot think first (vLLM lets it, then applies
the grammar): such an output is content unless it opens with `<think>` itself.

Split anywhere, a stream reads as the whole text (tests hold this at every character). The
state is the mode and the few characters that may begin a tag (R2).
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
FUNCTION_START = "<function="
MAX_CALL_GAP = 16  # whitespace between <tool_call> and <function= still read as one call

REASONING = "reasoning"  # until </think>
CONTENT = "content"  # to the end
OPENING = "opening"  # reasoning only if the output opens with <think>, content otherwise


def start_mode(parser: str, prompt: str, template_kwargs: dict, constrained: bool) -> str:
    """How a completion of `prompt` (the rendered chat) starts; `constrained`: a grammar
    governs the output from its first token."""
    if parser == "qwen3" and not template_kwargs.get("enable_thinking", True):
        return CONTENT
    if prompt[-64:].rstrip().endswith(THINK_END):
        return CONTENT
    return OPENING if constrained else REASONING


def _emit(out: list[dict], key: str, text: str) -> None:
    if not text:
        return
    if out and key in out[-1]:
        out[-1][key] += text
    else:
        out.append({key: text})


def _partial_tag(text: str, tags: tuple[str, ...], longest: int) -> int:
    """Length of the longest end of `text` that may begin one of `tags`."""
    i = text.find("<", max(0, len(text) - longest + 1))
    while i >= 0:
        tail = text[i:]
        if any(t.startswith(tail) for t in tags):
            return len(text) - i
        i = text.find("<", i + 1)
    return 0


def _function_follows(after: str) -> bool | None:
    """Whether the text after a `<tool_call>` makes it a Qwen3-Coder call; None: not yet
    known."""
    rest = after.lstrip()
    if len(after) - len(rest) > MAX_CALL_GAP:
        return False
    if rest.startswith(FUNCTION_START):
        return True
    return None if FUNCTION_START.startswith(rest) else False


class ReasoningParser:
    """Fed text deltas, returns deltas `{"reasoning": ...}` and `{"content": ...}` in order.
    `implicit_end`: a Qwen3-Coder tool call ends the reasoning too (qwen3)."""

    __slots__ = ("_mode", "_buf", "_tags", "_longest", "_pending")

    def __init__(self, mode: str = REASONING, implicit_end: bool = False) -> None:
        self._mode = mode
        self._buf = ""  # what may still begin a tag (or, pending, a <tool_call> so far)
        self._tags = (THINK_END, THINK_START, *((TOOL_CALL_START,) if implicit_end else ()))
        self._longest = max(len(t) for t in self._tags)
        self._pending = False  # _buf starts with a <tool_call> not yet known to be a call

    @classmethod
    def create(cls, parser: str, mode: str) -> ReasoningParser:
        return cls(mode, implicit_end=parser == "qwen3")

    def feed(self, text: str) -> list[dict]:
        if self._mode == REASONING and not self._buf and "<" not in text:  # most tokens
            return [{"reasoning": text}] if text else []
        if self._mode == CONTENT:
            return [{"content": text}] if text else []
        self._buf += text
        out: list[dict] = []
        self._scan(out)
        return out

    def finish(self) -> list[dict]:
        """What is still held, at the end of the completion."""
        out: list[dict] = []
        _emit(out, REASONING if self._mode == REASONING else CONTENT, self._buf)
        self._buf, self._pending = "", False
        return out

    def _scan(self, out: list[dict]) -> None:
        while True:
            buf = self._buf
            if self._mode == CONTENT:
                _emit(out, CONTENT, buf)
                self._buf = ""
                return
            if self._mode == OPENING:
                if buf.startswith(THINK_START):
                    self._buf, self._mode = buf[len(THINK_START):], REASONING
                elif THINK_START.startswith(buf):
                    return
                else:
                    self._mode = CONTENT
                continue
            if self._pending:
                follows = _function_follows(buf[len(TOOL_CALL_START):])
                if follows is None:
                    return
                self._pending = False
                if follows:
                    self._mode = CONTENT
                else:
                    _emit(out, REASONING, TOOL_CALL_START)
                    self._buf = buf[len(TOOL_CALL_START):]
                continue
            at, tag = min(((i, t) for t in self._tags if (i := buf.find(t)) >= 0),
                          default=(-1, None))
            if tag is None:
                keep = _partial_tag(buf, self._tags, self._longest)
                _emit(out, REASONING, buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return
            _emit(out, REASONING, buf[:at])
            if tag == TOOL_CALL_START:
                self._buf, self._pending = buf[at:], True
                continue
            self._buf = buf[at + len(tag):]
            if tag == THINK_END:
                self._mode = CONTENT
