"""The HTTP connection in front of the app: uvicorn's httptools protocol with a bound on a
request's head (its request line and headers), in bytes (431) and in time (408).

httptools grows a header or URL that arrives in pieces by concatenation, so an unfinished
128 MiB header cost tens of seconds of event-loop CPU; and a connection that sends its head
a byte at a time (or nothing) held a socket and a parser forever. The head is fed to the
parser in slices that never pass `max_header_bytes`, and must be complete within
`header_read_timeout_s` of its first byte (of the connection, for the first request).
A pipelined head that begins inside the slice that ended the request before it is counted
from the next slice on: at most twice the cap.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from api_proc.config import ApiConfig


def error_bytes(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response carrying an OpenAI-shaped error; it closes the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": code}}).encode()
    return b"".join([STATUS_LINE[status], b"content-type: application/json\r\n",
                     b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body])


class GuardedHttpProtocol(HttpToolsProtocol):
    max_header_bytes = 64 << 10
    header_read_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_bytes = 0
        self._in_head = True
        self._head_timer: asyncio.TimerHandle | None = None
        self._refusal: bytes | None = None
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.parser is None:  # refused, or lost
            return
        if self._in_head and self._head_timer is None:
            self._arm_head_timer()
        while self._in_head and data:
            room = self.max_header_bytes - self._head_bytes
            if room <= 0:
                self._refuse(431, f"request line and headers are larger than "
                                  f"max_header_bytes={self.max_header_bytes}",
                             "headers_too_large")
                return
            piece, data = data[:room], data[room:]
            self._head_bytes += len(piece)
            super().data_received(piece)
            if self.parser is None or self.transport.is_closing():
                return
        if data:
            super().data_received(data)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True  # what follows on this connection is the next request's head
        self._head_bytes = 0

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.header_read_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        self._refuse(408, f"request line and headers did not arrive within "
                          f"header_read_timeout_s={self.header_read_timeout_s:g}",
                     "header_timeout")

    def on_response_complete(self) -> None:
        if self._refusal is not None:
            self.transport.write(self._refusal)
            self.transport.close()
            return
        super().on_response_complete()

    def _refuse(self, status: int, message: str, code: str) -> None:
        self._cancel_head_timer()
        if self.transport.is_closing():
            return
        self.parser = None  # nothing more is read from this connection
        self.flow.pause_reading()
        response = error_bytes(status, message, code)
        if self.cycle is not None and not self.cycle.response_complete:
            self._refusal = response  # after the response under way (pipelining)
            return
        self.transport.write(response)
        self.transport.close()


def http_protocol(config: ApiConfig) -> type[GuardedHttpProtocol]:
    """The protocol class uvicorn serves `config` with (`uvicorn.run(..., http=...)`)."""
    return type("HttpProtocol", (GuardedHttpProtocol,), {
        "max_header_bytes": config.max_header_bytes,
        "header_read_timeout_s": config.header_read_timeout_s,
    })
