"""The batch file format of `flatserve run-batch`, without engines: lines split from chunks
within a bound, each line parsed or refused, result lines, their order, the in-process call."""

from __future__ import annotations

import asyncio
import io
import json

from api_proc.local_call import LocalResponse, post
from api_proc.request_body import RequestBody
from flatserve.batch_file import (
    BatchRefusal,
    BatchRequest,
    LineTooLong,
    OrderedWriter,
    parse_line,
    read_lines,
    refusal_line,
    response_line,
)


def lines_of(chunks: list[bytes], limit: int = 100) -> list:
    async def source():
        for chunk in chunks:
            yield chunk

    async def collect():
        return [(n, "too long" if isinstance(x, LineTooLong) else x)
                async for n, x in read_lines(source(), limit)]

    return asyncio.run(collect())


def test_lines_are_split_across_chunks_and_numbered_as_in_the_file():
    assert lines_of([b"ab", b"c\nd", b"e\n\n", b"f"]) == [(1, b"abc"), (2, b"de"), (3, b""),
                                                          (4, b"f")]
    assert lines_of([b"one\r\n", b"two\n"]) == [(1, b"one\r"), (2, b"two")]


def test_a_line_over_the_limit_is_reported_once_and_not_held():
    long_line = b"x" * 25
    # ends in the chunk it started in / spans chunks whose sum passes the limit
    assert lines_of([b"a\n" + long_line + b"\nb\n"], limit=10) == \
        [(1, b"a"), (2, "too long"), (3, b"b")]
    assert lines_of([b"a\n", long_line[:8], long_line[8:16], long_line[16:] + b"\nb"],
                    limit=10) == [(1, b"a"), (2, "too long"), (3, b"b")]
    assert lines_of([long_line], limit=10) == [(1, "too long")]


def line(**item) -> bytes:
    return json.dumps(item).encode()


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_a_line_runs_or_is_refused_with_its_reason():
    ok = parse_line(line(custom_id="a", method="POST", url="/v1/chat/completions", body=CHAT), 1)
    assert isinstance(ok, BatchRequest) and ok.custom_id == "a"
    assert json.loads(ok.body.take()) == CHAT
    cases = {
        b'{"custom_id": "a", "method": ': ("not JSON", None, "invalid_batch_line"),
        b"[1, 2]": ("not a JSON object", None, "invalid_batch_line"),
        line(custom_id=7, method="POST", url="/v1/completions", body={}):
            ("custom_id must be a string", None, "invalid_batch_line"),
        line(custom_id="b", method="GET", url="/v1/completions", body={}):
            ("method must be POST", "b", "unsupported_method"),
        line(custom_id="c", method="POST", url="/v1/embeddings", body={}):
            ("url '/v1/embeddings' is not supported", "c", "unsupported_url"),
        line(custom_id="d", method="POST", url="/v1/completions", body=[]):
            ("body must be a JSON object", "d", "invalid_batch_line"),
        line(custom_id="e", method="POST", url="/v1/chat/completions",
             body={**CHAT, "stream": "True"}): ("stream is not supported", "e",
                                                "stream_not_supported"),
    }
    for text, (words, custom_id, code) in cases.items():
        refused = parse_line(text, 3)
        assert isinstance(refused, BatchRefusal), text
        assert words in refused.message and refused.message.startswith("line 3")
        assert (refused.custom_id, refused.code) == (custom_id, code)
    # the reason never carries the line's text
    assert "secret" not in parse_line(b'{"custom_id": "secret" oops', 1).message


def test_result_lines_are_json_with_the_body_kept_as_sent():
    body = b'{"id":"chatcmpl-1","choices":[{"text":"\\u00e9\\n"}]}'
    ok = json.loads(response_line("a", LocalResponse(200, body)))
    assert ok["custom_id"] == "a" and ok["error"] is None
    assert ok["response"]["status_code"] == 200
    assert ok["response"]["body"] == json.loads(body)
    assert ok["id"].startswith("batch_req_") and ok["response"]["request_id"]
    error = {"message": "model 'x' does not exist", "type": "not_found_error", "param": None,
             "code": None}
    failed = json.loads(response_line("b", LocalResponse(404, json.dumps({"error": error})
                                                         .encode())))
    assert failed["response"] == {**failed["response"], "status_code": 404, "body": None}
    assert failed["error"] == error
    crashed = json.loads(response_line("c", LocalResponse(500, b"Internal Server Error")))
    assert crashed["error"]["message"] == "Internal Server Error"
    refused = json.loads(refusal_line(BatchRefusal(None, "line 2 is not JSON", "invalid")))
    assert refused["custom_id"] is None and refused["response"]["status_code"] == 400
    assert refused["error"]["message"] == "line 2 is not JSON"


def test_results_are_written_in_input_order_as_soon_as_their_turn_comes():
    out = io.BytesIO()
    written = []
    writer = OrderedWriter(out, lambda: written.append(1))
    writer.put(1, b"second")
    writer.put(2, b"third")
    assert out.getvalue() == b"" and not written  # they wait for the first
    writer.put(0, b"first")
    assert out.getvalue() == b"first\nsecond\nthird\n" and len(written) == 3
    writer.put(3, b"fourth")
    assert out.getvalue().endswith(b"third\nfourth\n") and writer.num_written == 4


def test_the_in_process_call_hands_the_body_over_and_keeps_nothing_of_it():
    seen = {}

    async def app(scope, receive, send):
        message = await receive()
        seen["body"], seen["path"] = message["body"], scope["path"]
        seen["type"] = dict(scope["headers"])[b"content-type"]
        seen["held"] = body.data  # the caller's holder, once the app has the bytes
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b'{"ok":', "more_body": True})
        await send({"type": "http.response.body", "body": b"true}"})
        assert (await receive())["type"] == "http.disconnect"  # once the answer is complete

    body = RequestBody(b'{"x": 1}')
    response = asyncio.run(post(app, "/v1/completions", body))
    assert (response.status, response.body) == (201, b'{"ok":true}')
    assert seen == {"body": b'{"x": 1}', "path": "/v1/completions",
                    "type": b"application/json", "held": None}

    async def broken(scope, receive, send):
        raise RuntimeError("a bug")

    response = asyncio.run(post(broken, "/v1/completions", RequestBody(b"{}")))
    assert response.status == 500 and b"internal" in response.body
