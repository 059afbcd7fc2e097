"""A streamed step's text-only chunk comes from its choice's template: the same bytes as the
chunk built as a whole, for any text, id and model name, in chat and completions."""

from __future__ import annotations

import json

import pytest

from api_proc.responses import ResponseWriter
from api_proc.serving import Choice, Prepared

TEXTS = ["hello", "", " ", 'a "quoted" \\ word', "tab\tnew\nline\r", "\x00\x1f\x7f",
         "é日本語🙂", "line\u2028sep\u2029para\x85next", "</script>", "{\"content\": 1}"]


def prepared(kind: str, model: str = "flatserve-tiny", request_id: str = "chatcmpl-1a2b",
             **flags) -> Prepared:
    choices = [Choice(index=i, stream=None, detok=None) for i in range(2)]
    return Prepared(kind=kind, id=request_id, created=1764374400, model=model, stream=True,
                    include_usage=False, num_prompt_tokens=7, choices=choices, arrival=0.0,
                    **flags)


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("usage", [False, True], ids=["plain", "usage-in-every-chunk"])
@pytest.mark.parametrize("model, request_id", [
    ("flatserve-tiny", "chatcmpl-1a2b"),
    ("モデル\u2028x", "cmpl-\"odd\"\x85id"),  # served names and ids are written like texts
])
def test_a_text_chunk_is_the_bytes_of_the_whole_chunk(kind, usage, model, request_id):
    writer = ResponseWriter(metrics=None, logprobs=None)
    p = prepared(kind, model, request_id, continuous_usage=usage)
    for c in p.choices:
        for text in TEXTS:
            c.num_tokens += 3
            fast = writer._chunk(p, c, text, None)
            assert fast == writer._dict_chunk(p, c, text, None)
            assert c.chunk_template is not None
            event = json.loads(fast.removeprefix(b"data: ").removesuffix(b"\n\n"))
            choice = event["choices"][0]
            assert choice["index"] == c.index
            assert (choice["delta"]["content"] if kind == "chat" else choice["text"]) == text
            assert b"\n" not in fast[:-2] and "\u2028".encode() not in fast  # one SSE event
            if usage:
                assert event["usage"] == {"prompt_tokens": 7, "completion_tokens": c.num_tokens,
                                          "total_tokens": 7 + c.num_tokens}


def test_chunks_with_more_than_text_are_built_whole():
    writer = ResponseWriter(metrics=None, logprobs=None)
    p = prepared("chat", return_token_ids=True)
    c = p.choices[0]
    c.step_ids = [5, 6]
    assert b'"token_ids": [5, 6]' in writer._chunk(p, c, "hi", None)
    assert c.chunk_template is None and c.step_ids == []
    p = prepared("chat")
    c = p.choices[0]
    assert b'"finish_reason": "stop"' in writer._chunk(p, c, "hi", "stop")
    assert b'"role": "assistant"' in writer._chunk(p, c, None, None)  # the opening chunk
    assert b'"logprobs": {"content": [1]' in writer._chunk(p, c, "hi", None, lp=[1])
    assert c.chunk_template is None


def test_an_id_or_model_that_spells_the_mark_still_gets_its_bytes():
    from api_proc import responses

    writer = ResponseWriter(metrics=None, logprobs=None)
    for request_id, model in [("chatcmpl-" + responses._TEXT_MARK, responses._TEXT_MARK),
                              (responses._TEXT_MARK, "m")]:  # the last: no template
        p = prepared("chat", model=model, request_id=request_id)
        c = p.choices[0]
        for text in ("hi", responses._TEXT_MARK):
            assert writer._chunk(p, c, text, None) == writer._dict_chunk(p, c, text, None)
    assert c.chunk_template == ()  # no template: built whole, and not tried again
