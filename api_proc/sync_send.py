"""An ASGI `send` callable from synchronous code, so the engine reader's callback can write
every streaming response of an engine step without waking one task per response.

    out = SyncSend(send)           # send: the ASGI send of a response that has started
    out(b"data: ...\\n\\n")         # in any callback of the event loop; never blocks
    await out.flush()              # in the response's task: all written (or raises)

Writing a body does not suspend in uvicorn (or the middlewares that wrap its send) unless
the client reads slower than the server writes and the transport paused. So each write runs
the send coroutine inline; only when it does suspend is the rest of it handed to a task,
and the bodies written meanwhile wait behind it as one joined body (at most the response's
own output).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any

Send = Callable[[dict[str, Any]], Awaitable[None]]


class SyncSend:
    __slots__ = ("_send", "_backlog", "_task", "error")

    def __init__(self, send: Send) -> None:
        self._send = send
        self._backlog: list[bytes] = []  # written while a send was suspended
        self._task: asyncio.Task | None = None
        self.error: BaseException | None = None  # the send failed: the client is gone

    def __call__(self, body: bytes) -> None:
        if self.error is not None:
            return
        if self._task is not None:
            self._backlog.append(body)
            return
        coro = self._send({"type": "http.response.body", "body": body, "more_body": True})
        try:
            waiting_on = coro.send(None)
        except StopIteration:
            return
        except BaseException as e:  # noqa: BLE001 (kept for flush(), which raises it)
            self.error = e
            return
        self._task = asyncio.ensure_future(self._finish(coro, waiting_on))

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
        if self._task is not None:
            self._task.cancel()

    async def _finish(self, coro: Coroutine, waiting_on: Any) -> None:
        try:
            await _Resumed(coro, waiting_on)
            while self._backlog:
                body, self._backlog = b"".join(self._backlog), []
                await self._send({"type": "http.response.body", "body": body,
                                  "more_body": True})
        except BaseException as e:  # noqa: BLE001 (cancelled, or the client is gone)
            self.error = e
        finally:
            self._task = None


class _Resumed:
    """Awaiting it continues `coro`, which already ran up to yielding `waiting_on` (a
    future, to the task that now awaits this): what a task would have done had it run the
    coroutine from the start."""

    __slots__ = ("_coro", "_waiting_on")

    def __init__(self, coro: Coroutine, waiting_on: Any) -> None:
        self._coro = coro
        self._waiting_on = waiting_on

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value = self._coro, self._waiting_on
        self._coro = self._waiting_on = None
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
