"""--stream-interval N (vLLM's): a streamed choice's first token is written at once, then a
chunk once N tokens have come, and its end; the text, finish, counts, stop strings and
errors are those of N = 1. Against the engine test double (one token per step)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.api_proc.test_app import sse_events

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron"
USAGE = {"include_usage": True, "continuous_usage_stats": True}


def stream(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, timeout=30,
                      json={**body, "stream": True, "stream_options": USAGE}) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    return events[:-1]


def chat_body(content: str, **body) -> dict:
    return {"messages": [{"role": "user", "content": content}], **body}


def content_chunks(events: list[dict], index: int = 0) -> list[dict]:
    """A choice's chunks after its role chunk, with the tokens each carries (from the
    cumulative usage in every chunk)."""
    chunks, seen = [], 0
    for e in events:
        if not e["choices"] or e["choices"][0]["index"] != index:
            continue
        delta = e["choices"][0].get("delta", {})
        if "role" in delta:
            continue
        e["tokens"], seen = e["usage"]["completion_tokens"] - seen, e["usage"]["completion_tokens"]
        chunks.append(e)
    return chunks


def text_of(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)


@pytest.fixture
def servers(start_app, engine_double):
    """Every token in its chunk (the default) and four at a time."""
    return start_app(engine_double), start_app(engine_double, stream_interval=4)


def test_chunks_carry_up_to_n_tokens_the_first_at_once(servers):
    each, four = (stream(s, "/v1/chat/completions", chat_body(WORDS, max_tokens=10))
                  for s in servers)
    assert [c["tokens"] for c in content_chunks(each)] == [1] * 10
    chunks = content_chunks(four)
    assert [c["tokens"] for c in chunks] == [1, 4, 4, 1]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert text_of(chunks) == text_of(content_chunks(each)) != ""
    assert four[-1]["usage"] == each[-1]["usage"]  # the closing usage chunk
    assert four[0]["choices"][0]["delta"]["role"] == "assistant"


def test_streamed_text_is_the_whole_answer(servers):
    """Chat and completions, n = 2: each choice's chunks join to its non-streamed text."""
    _, four = servers
    body = chat_body(WORDS, max_tokens=11, n=2)
    whole = httpx.post(four.url + "/v1/chat/completions", json=body, timeout=30).json()
    events = stream(four, "/v1/chat/completions", body)
    for i in range(2):
        chunks = content_chunks(events, i)
        assert [c["tokens"] for c in chunks] == [1, 4, 4, 2]  # the end writes what waits
        assert text_of(chunks) == whole["choices"][i]["message"]["content"]
    body = {"prompt": WORDS, "max_tokens": 9}
    whole = httpx.post(four.url + "/v1/completions", json=body, timeout=30).json()
    events = stream(four, "/v1/completions", body)
    assert len(events) == 4  # 1 + 4 + 4 tokens, then the usage chunk
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == \
        whole["choices"][0]["text"]


def test_a_stop_string_ends_at_the_same_token(servers, engine_double):
    """The stop string is found at the step that completes it, not at the next chunk: the
    same text and count as one token per chunk, and the engine request is aborted."""
    results = []
    for server in servers:
        events = stream(server, "/v1/chat/completions",
                        chat_body(WORDS, max_tokens=40, stop=["epsilon"]))
        chunks = content_chunks(events)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        results.append((text_of(chunks), events[-1]["usage"]))
    assert results[0] == results[1]
    assert "epsilon" not in results[0][0] and "delta" in results[0][0]


def test_tokens_held_when_the_engine_fails_come_before_the_error(servers):
    _, four = servers
    events = stream(four, "/v1/chat/completions",
                    chat_body("[[late-error]] " + WORDS, max_tokens=20))
    error = events[-1]
    assert "engine double failed" in json.dumps(error), error
    chunks = content_chunks(events[:-1])
    assert [c["tokens"] for c in chunks] == [1, 2]  # the first at once, two held, then the error
    assert text_of(chunks)


def test_an_interval_below_one_is_refused(make_config):
    with pytest.raises(ValueError, match="stream_interval must be positive"):
        make_config(stream_interval=0)
