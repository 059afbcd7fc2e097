"""Reasoning read out of a completion (deepseek_r1, qwen3) whole and as a stream split at
every character: the streamed deltas joined are the non-streamed message."""

from __future__ import annotations

import pytest

from api_proc.chat_output import ChatOutputParser, assemble
from api_proc.reasoning_parser import (
    CONTENT,
    OPENING,
    REASONING,
    ReasoningParser,
    start_mode,
)

CALL = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"


def whole(parser: str, mode: str, text: str) -> tuple[str | None, str | None]:
    reader = ReasoningParser.create(parser, mode)
    reasoning, content, _ = assemble([*reader.feed(text), *reader.finish()])
    return reasoning, content


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text, want", [
    # the template opened <think> in the prompt: the output has only </think>
    ("Let me see.</think>\n\nIt is 4.", ("Let me see.", "\n\nIt is 4.")),
    # the model opens it itself (older Qwen3 templates, R1 distills)
    ("<think>\nLet me see.\n</think>\n\nIt is 4.", ("\nLet me see.\n", "\n\nIt is 4.")),
    # cut before </think> (max_tokens): all reasoning, content None
    ("Let me see, 2 + 2 <", ("Let me see, 2 + 2 <", None)),
    ("</think>It is 4.", (None, "It is 4.")),
    ("Hmm.</think>", ("Hmm.", None)),
    ("", (None, "")),
    ("a < b, <thin>k</think> c </think> d", ("a < b, <thin>k", " c </think> d")),
])
def test_reasoning_then_content(parser, text, want):
    assert whole(parser, REASONING, text) == want


def test_a_qwen3_coder_call_inside_the_thinking_ends_it_for_qwen3_only():
    text = "I should call f.\n" + CALL
    assert whole("qwen3", REASONING, text) == ("I should call f.\n", CALL)
    assert whole("deepseek_r1", REASONING, text) == (text, None)
    # a <tool_call> that no <function= follows is only talked about
    mention = "the <tool_call> tag, then</think>ok"
    assert whole("qwen3", REASONING, mention) == ("the <tool_call> tag, then", "ok")
    far = "x<tool_call>" + " " * 17 + "<function=f>"
    assert whole("qwen3", REASONING, far) == (far, None)


def test_content_mode_and_the_opening_mode_of_a_constrained_output():
    assert whole("qwen3", CONTENT, "a</think>b") == (None, "a</think>b")
    assert whole("qwen3", OPENING, '{"a": 1}') == (None, '{"a": 1}')
    assert whole("qwen3", OPENING, "<think>hm</think>{}") == ("hm", "{}")
    assert whole("qwen3", OPENING, "<thi") == (None, "<thi")
    assert whole("qwen3", OPENING, " <think>x") == (None, " <think>x")


@pytest.mark.parametrize("parser, prompt, kwargs, constrained, want", [
    ("qwen3", "<|im_start|>assistant\n<think>\n", {}, False, REASONING),
    ("qwen3", "<|im_start|>assistant\n<think>\n", {"enable_thinking": False}, False, CONTENT),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", {}, False, CONTENT),
    ("deepseek_r1", "<|im_start|>assistant\n<think>\n\n</think>\n\n", {}, False, CONTENT),
    ("deepseek_r1", "<|im_start|>assistant\n", {"enable_thinking": False}, False, REASONING),
    ("qwen3", "<|im_start|>assistant\n", {}, True, OPENING),
    ("qwen3", "<|im_start|>assistant\n", {"enable_thinking": False}, True, CONTENT),
])
def test_where_the_output_starts(parser, prompt, kwargs, constrained, want):
    assert start_mode(parser, prompt, kwargs, constrained) == want


TEXTS = [
    "Let me see.</think>\n\nIt is 4.",
    "<think>\nLet me see.\n</think>\n\nIt is 4.",
    "Let me see, 2 + 2 <",
    "a < b, <thin>k</think> c </think> d",
    "I should call f.\n" + CALL + "\n" + CALL,
    "the <tool_call> tag, then</think>ok <tool_call>",
    "x<tool_call>\n\n<func<function=",
    "x<tool_call>" + " " * 17 + "<function=f>",
    "<think><think></think></think>",
    "日本語の思考</think>答え",
]


def streamed(make, text: str, cut: list[int]) -> list[dict]:
    reader = make()
    deltas, start = [], 0
    for end in [*cut, len(text)]:
        deltas += reader.feed(text[start:end])
        start = end
    return deltas + reader.finish()



@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("mode", [REASONING, OPENING, CONTENT])
def test_a_stream_split_anywhere_reads_as_the_whole_text(text, parser, mode):
    def make():
        return ReasoningParser.create(parser, mode)
    want = assemble(streamed(make, text, []))
    cuts = [[i] for i in range(len(text) + 1)] + [list(range(len(text) + 1))]
    for cut in cuts:
        deltas = streamed(make, text, cut)
        assert assemble(deltas) == want, cut
        assert all(len(d) == 1 and next(iter(d.values())) for d in deltas), deltas
        # reasoning never follows content: a client shows them in order
        kinds = [next(iter(d)) for d in deltas]
        assert "reasoning" not in kinds[kinds.index("content"):] if "content" in kinds else True


HERMES = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("call", [CALL, HERMES])
def test_reasoning_then_calls_out_of_the_content(parser, call):
    from api_proc.tool_parser import ToolCallParser, read_hermes_call
    from api_proc.xml_tool_call import XmlCallReader

    read_call = XmlCallReader({"f": {"a": "integer"}}) if call == CALL else read_hermes_call
    text = "I should call f.</think>\n\nSure.\n" + call + "\n" + call
    for cut in [[]] + [[i] for i in range(len(text) + 1)] + [list(range(len(text) + 1))]:
        reader = ChatOutputParser(ReasoningParser.create(parser, REASONING),
                                  ToolCallParser(True, read_call))
        reasoning, content, calls = assemble(streamed(lambda r=reader: r, text, cut))
        assert (reasoning, content) == ("I should call f.", "\n\nSure.\n"), cut
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("f", '{"a": 1}')] * 2
        assert reader.num_calls == 2


def test_qwen3_ends_the_reasoning_at_a_call_written_inside_it():
    from api_proc.tool_parser import ToolCallParser
    from api_proc.xml_tool_call import XmlCallReader

    reader = ChatOutputParser(ReasoningParser.create("qwen3", REASONING),
                              ToolCallParser(True, XmlCallReader({})))
    reasoning, content, calls = assemble([*reader.feed("hm\n" + CALL), *reader.finish()])
    assert (reasoning, content, len(calls)) == ("hm\n", None, 1)
