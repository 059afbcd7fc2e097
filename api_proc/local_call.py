"""One POST to the API app from inside its own process, without a socket: the request goes
through the same routes, body reader, validation, admission, engines and error handlers as
one that came over HTTP, so its answer is the one the server would give (`flatserve
run-batch`). Its body is handed over with take() semantics, as an HTTP body is (R1)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from api_proc.request_body import RequestBody

logger = logging.getLogger(__name__)


@dataclass
class LocalResponse:
    status: int
    body: bytes  # empty for a streamed (SSE) response: its events are not kept
    streamed: bool = False


async def post(app: Callable, path: str, body: RequestBody) -> LocalResponse:
    """The app's answer to `POST path` with a JSON `body` (taken once, as an HTTP body is:
    R1). A 500 when the app fails with an exception (logged here, as uvicorn logs one)."""
    nbytes = len(body.data or b"")
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(nbytes).encode())],
        "client": None, "server": None, "state": {},
    }
    ended = asyncio.Event()
    response = LocalResponse(500, b"")
    chunks: list[bytes] = []

    async def receive() -> dict:
        if body.data is not None:
            return {"type": "http.request", "body": body.take(), "more_body": False}
        await ended.wait()  # the client stays until the response is complete
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            response.status = message["status"]
            headers = dict(message.get("headers") or ())
            response.streamed = headers.get(b"content-type", b"").startswith(
                b"text/event-stream")
        elif message["type"] == "http.response.body":
            if not response.streamed:
                chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                ended.set()

    try:
        await app(scope, receive, send)
    except Exception as e:  # noqa: BLE001 - the server's answer to a bug: a 500
        # the app's error handler has sent its 500 and raised again, for the server to log
        logger.error("exception while serving POST %s: %s", path, e, exc_info=True)
        if response.status != 500 or not chunks:  # it failed before answering
            return LocalResponse(500, b'{"error": {"message": "internal server error", '
                                      b'"type": "internal_error", "param": null, '
                                      b'"code": null}}')
    finally:
        ended.set()
        body.data = None  # a request the app refused before reading its body
    response.body = b"".join(chunks)
    return response
