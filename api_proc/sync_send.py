"""An ASGI `send` callable from synchronous code, so the engine reader's callback can write
every streaming response of an engine step without waking one task per response.

    out = SyncSend(send)           # send: the ASGI send of a response that has started
    out(b"data: ...\\n\\n")         # in any callback of the event loop; never blocks
    await out.flush()              # in the response's task: all written (or raises)

Writing a body does not suspend in uvicorn (or the middlewares that wrap its send) unless
the client reads slower than the server writes and the transport paused. So each write runs
the send awaitable inline; only when it does suspend is the rest of it handed to a task,
and the bodies written meanwhile wait behind it, joined. `backlog_bytes` says how much
waits: the writer stops producing past its limit (responses.py pauses the streams) and
`on_drained` tells it when all is out.

Inline writes run in the callback's context, not in the response's task: a middleware whose
send needs the current task or its own contextvars (anyio cancel scopes, asyncio.timeout,
BaseHTTPMiddleware) must not wrap the streaming routes. The app's middlewares (Starlette's
error and exception handlers, CORS) pass bodies straight through.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any

Send = Callable[[dict[str, Any]], Awaitable[None]]


class SyncSend:
    __slots__ = ("_send", "_backlog", "backlog_bytes", "_task", "error", "on_drained",
                 "written_at")

    def __init__(self, send: Send) -> None:
        self._send = send
        self._backlog: list[bytes] = []  # written while a send was suspended
        self.backlog_bytes = 0
        self._task: asyncio.Task | None = None
        self.error: BaseException | None = None  # the send failed: the client is gone
        self.on_drained: Callable[[], None] | None = None  # once a suspended send is done
        self.written_at = time.monotonic()  # when the last body was written (or this began)

    def __call__(self, body: bytes) -> None:
        if self.error is not None:
            return
        self.written_at = time.monotonic()
        if self._task is not None:
            self._backlog.append(body)
            self.backlog_bytes += len(body)
            return
        try:
            step = self._send({"type": "http.response.body", "body": body,
                               "more_body": True}).__await__()
            waiting_on = step.send(None)
        except StopIteration:
            return
        except BaseException as e:  # noqa: BLE001 (kept for flush(), which raises it)
            self.error = e.with_traceback(None)  # its frames would hold this body
            return
        self._task = asyncio.ensure_future(self._finish(step, waiting_on))

    async def flush(self) -> None:
        """Wait until every body written so far is sent; raise the send's error if one
        failed."""
        while self._task is not None:
            await asyncio.shield(self._task)
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        """Drop what is not sent yet (the response ends without it)."""
        self._backlog = []
        self.backlog_bytes = 0
        self.on_drained = None
        if self._task is not None:
            self._task.cancel()

    async def _finish(self, step: Generator, waiting_on: Any) -> None:
        try:
            await _Resumed(step, waiting_on)
            while self._backlog:
                body, self._backlog = b"".join(self._backlog), []
                self.backlog_bytes = 0
                await self._send({"type": "http.response.body", "body": body,
                                  "more_body": True})
                body = None
        except BaseException as e:  # noqa: BLE001 (cancelled, or the client is gone)
            self.error = e.with_traceback(None)  # its frames would hold this object
        finally:
            self._task = None
        if self.error is None and self.on_drained is not None:
            self.on_drained()


class _Resumed:
    """Awaiting it continues `step` (an awaitable's iterator), which already ran up to
    yielding `waiting_on` (a future, to the task that now awaits this): what a task would
    have done had it awaited the awaitable from the start."""

    __slots__ = ("_step", "_waiting_on")

    def __init__(self, step: Generator, waiting_on: Any) -> None:
        self._step = step
        self._waiting_on = waiting_on

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value = self._step, self._waiting_on
        self._step = self._waiting_on = None
        while True:
            try:
                sent = yield value
            except BaseException as e:  # noqa: BLE001 (the task's cancellation goes in)
                step = coro.throw
                arg: Any = e
            else:
                step = coro.send
                arg = sent
            try:
                value = step(arg)
            except StopIteration as stop:
                return stop.value
