"""RpcClient: an asyncio DEALER client for unary and server-streaming calls.

One reader drains the socket and routes every reply by call id to the call's future or the
stream's queue (vLLM v1 engine-client style): no polling round trip per item. Liveness comes
from two signals: the socket monitor reports a dropped connection at once, and heartbeats
catch a server that is connected but silent. Either fails every pending call and stream with
ServerUnavailable; new calls then fail fast until the server answers again.

Thread-safety: a client belongs to the event loop of its first call; every method must run
on that loop's thread. Dropping an RpcStream from any thread is safe (its finalizer only
schedules the cancel on the loop).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from typing import Any

import zmq

from rpc import protocol as p
from rpc.codec import Codec
from rpc.errors import (
    ClientClosed,
    DeadlineExceeded,
    DecodeError,
    ProtocolError,
    RpcError,
    ServerUnavailable,
)
from rpc.outbox import Outbox
from rpc.sockets import DEFAULT_HWM, SocketReader, make_socket
from rpc.transport import check_address

log = logging.getLogger("rpc.client")

_CONNECTING = "connecting"  # never reached the server yet: calls wait up to connect_timeout
_AVAILABLE = "available"
_UNAVAILABLE = "unavailable"  # lost it: calls fail fast until it answers again
_CLOSED = "closed"

class _StreamState:
    """What the reader needs to route a stream's messages; the RpcStream the user iterates
    holds this, never the other way round, so dropping the RpcStream can cancel it."""

    __slots__ = ("call_id", "window", "items", "waiter", "done", "error", "consumed", "deadline")

    def __init__(self, call_id: int, window: int) -> None:
        self.call_id = call_id
        self.window = window
        self.items: deque[Any] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.done = False
        self.error: BaseException | None = None
        self.consumed = 0  # items taken since the last CREDIT
        self.deadline: asyncio.TimerHandle | None = None

    def finish(self, error: BaseException | None) -> None:
        if self.done:
            return
        self.done = True
        self.error = error
        if self.deadline is not None:
            self.deadline.cancel()
        self._wake()

    def push(self, item: Any) -> None:
        self.items.append(item)
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class RpcClient:
    """Client for one RpcServer address.

    heartbeat_interval: seconds between pings. heartbeat_timeout: silence after which the
    server counts as dead. connect_timeout: how long calls wait for a server that was never
    reached yet. stream_window: items a stream may have in flight (queued here or on the way)
    before the server's generator is suspended. max_queued_sends: callers wait when this many
    envelopes are queued because the socket is at its high-water mark.
    """

    def __init__(
        self,
        address: str,
        codec: Codec,
        *,
        heartbeat_interval: float = 0.2,
        heartbeat_timeout: float = 1.0,
        connect_timeout: float = 5.0,
        stream_window: int = 64,
        max_queued_sends: int = 10_000,
        hwm: int = DEFAULT_HWM,
        coalesce: bool = True,
        context: zmq.Context | None = None,
    ) -> None:
        check_address(address)
        if stream_window < 1:
            raise ValueError(f"stream_window must be >= 1, got {stream_window}")
        self.address = address
        self._codec = codec
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat_timeout = heartbeat_timeout
        self._connect_timeout = connect_timeout
        self.stream_window = stream_window
        self._max_queued_sends = max_queued_sends
        self._hwm = hwm
        self._coalesce = coalesce
        self._ctx = context or zmq.Context.instance()
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[int, _StreamState] = {}
        self._state = _CONNECTING
        self._lost_reason = ""
        self._ready_waiters: list[asyncio.Future[None]] = []
        self._unanswered_since: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._reader: SocketReader | None = None
        self._monitor_reader: SocketReader | None = None
        self._outbox: Outbox | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._ping = p.pack_envelope(codec, [p.PING, 0])

    # -- public API ---------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """True while the server answers."""
        return self._state == _AVAILABLE

    async def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Call a unary method and return its result. Raises RemoteError (the handler
        raised), DeadlineExceeded, ServerUnavailable, EncodeError or ClientClosed."""
        outbox = self._outbox
        if (
            self._state != _AVAILABLE
            or self._loop is not asyncio.get_running_loop()
            or outbox.num_queued >= self._max_queued_sends  # type: ignore[union-attr]
        ):
            outbox = await self._wait_sendable()
        assert outbox is not None and self._loop is not None
        call_id = next(self._ids)
        item = p.pack_envelope(self._codec, [p.CALL, call_id, method, list(args), timeout])
        del args  # R1: from here on only zmq holds the payload, until it is sent
        fut = self._loop.create_future()
        self._calls[call_id] = fut
        outbox.post(None, item)
        del item
        deadline = None
        if timeout is not None:
            deadline = self._loop.call_later(timeout, self._expire_call, call_id, method, timeout)
        try:
            return await fut
        except asyncio.CancelledError:
            if not fut.done() or fut.cancelled():
                self._post_cancel(call_id)
            raise
        finally:
            self._calls.pop(call_id, None)
            if deadline is not None:
                deadline.cancel()

    def stream(self, method: str, *args: Any, timeout: float | None = None) -> RpcStream:
        """Call a streaming method. The call starts at the first `__anext__`; iterate with
        `async for`, stop early with `await it.aclose()` (or break / cancel / drop it: the
        server's generator is closed in every case). `timeout` bounds the whole stream."""
        return RpcStream(self, method, args, timeout)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the server answers; ServerUnavailable after `timeout` seconds."""
        self._attach()
        if self._state == _AVAILABLE:
            return
        if self._state == _CLOSED:
            raise ClientClosed("client is closed")
        assert self._loop is not None
        fut = self._loop.create_future()
        self._ready_waiters.append(fut)
        self._send_ping()
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise ServerUnavailable(
                f"no answer from {self.address} within {timeout} s"
                + (f" ({self._lost_reason})" if self._lost_reason else "")
            ) from None
        finally:
            if fut in self._ready_waiters:
                self._ready_waiters.remove(fut)

    async def close(self) -> None:
        """Fail pending calls with ClientClosed, cancel their server-side work, close."""
        if self._state == _CLOSED:
            return
        self._state = _CLOSED
        if self._outbox is not None:
            for call_id in list(self._calls) + list(self._streams):
                self._post_cancel(call_id)
            self._outbox.flush()
        self._fail_all(ClientClosed, "client closed")
        self._wake_ready_waiters(ClientClosed("client closed"))
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        self._close_socket(linger_ms=100)

    async def __aenter__(self) -> RpcClient:
        self._attach()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- connection ---------------------------------------------------------------------------

    def _attach(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            if self._state == _CLOSED:
                raise ClientClosed("client is closed")
            self._loop = loop
            self._open_socket()
            self._heartbeat = loop.create_task(self._heartbeat_loop())
        elif loop is not self._loop:
            raise RuntimeError("an RpcClient is bound to the event loop of its first call")

    async def _ensure_ready(self) -> None:
        self._attach()
        if self._state == _UNAVAILABLE:
            raise ServerUnavailable(
                f"server at {self.address} unavailable ({self._lost_reason}); "
                "failing fast until it answers again"
            )
        if self._state == _CLOSED:
            raise ClientClosed("client is closed")
        if self._state == _CONNECTING:
            await self.wait_ready(self._connect_timeout)

    async def _wait_sendable(self) -> Outbox:
        """The outbox to post a new call to, once the server answers and the outbox has
        room. Re-checked after every wait: a lost server replaces the socket and outbox."""
        self._attach()
        while True:
            if self._state != _AVAILABLE:
                await self._ensure_ready()
            outbox = self._outbox
            assert outbox is not None
            if outbox.num_queued < self._max_queued_sends:
                return outbox
            await outbox.wait_for_room(self._max_queued_sends)

    def _open_socket(self) -> None:
        assert self._loop is not None
        sock = make_socket(self._ctx, zmq.DEALER, hwm=self._hwm)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(self.address)
        self._sock, self._monitor = sock, monitor
        self._reader = SocketReader(self._loop, sock, self._on_message)
        self._monitor_reader = SocketReader(self._loop, monitor, self._on_monitor_event)
        self._outbox = Outbox(self._loop, sock, self._reader, routed=False, coalesce=self._coalesce)
        self._reader.start()
        self._monitor_reader.start()

    def _close_socket(self, linger_ms: int) -> None:
        if self._sock is None:
            return
        assert self._reader and self._monitor_reader and self._outbox and self._monitor
        self._reader.stop()
        self._monitor_reader.stop()
        self._outbox.close()
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self._sock.close(linger=linger_ms)
        self._sock = self._monitor = None

    def _on_monitor_event(self, frames: list[zmq.Frame]) -> None:
        event = int.from_bytes(frames[0].bytes[:2], "little")
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._send_ping()
        elif event == zmq.EVENT_DISCONNECTED and self._state == _AVAILABLE:
            self._lose("connection to the server dropped")

    async def _heartbeat_loop(self) -> None:
        while self._state != _CLOSED:
            await asyncio.sleep(self._heartbeat_interval)
            if self._reader is not None and self._reader.input_pending():
                # Replies are waiting: this loop was busy, the server was not silent.
                self._reader.kick()
                continue
            self._send_ping()
            since = self._unanswered_since
            if self._state == _AVAILABLE and since is not None:
                silent = time.monotonic() - since
                if silent > self._heartbeat_timeout:
                    self._lose(f"no answer to heartbeats for {silent:.2f} s")

    def _send_ping(self) -> None:
        # Silence counts from the first ping sent after the last message received, not
        # from that message: a stall of this loop (no pings sent) says nothing about the server.
        if self._unanswered_since is None:
            self._unanswered_since = time.monotonic()
        if self._outbox is not None:
            self._outbox.send_now_or_drop(None, self._ping)

    def _lose(self, reason: str) -> None:
        """The server is gone: fail everything pending, start over on a fresh socket (new
        identity, empty pipes: nothing stale reaches the next server)."""
        log.warning("rpc client: server at %s unavailable: %s", self.address, reason)
        self._state = _UNAVAILABLE
        self._lost_reason = reason
        self._unanswered_since = None
        self._fail_all(ServerUnavailable, f"server at {self.address} unavailable: {reason}")
        self._close_socket(linger_ms=0)
        self._open_socket()

    def _fail_all(self, error: type[RpcError], message: str) -> None:
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(error(message))
        streams, self._streams = self._streams, {}
        for st in streams.values():
            st.finish(error(message))

    def _wake_ready_waiters(self, exc: BaseException | None = None) -> None:
        waiters, self._ready_waiters = self._ready_waiters, []
        for fut in waiters:
            if not fut.done():
                if exc is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(exc)

    # -- receiving ----------------------------------------------------------------------------

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        self._unanswered_since = None
        if self._state == _CONNECTING or self._state == _UNAVAILABLE:
            self._state = _AVAILABLE
            self._lost_reason = ""
            self._wake_ready_waiters()
        try:
            envelopes = p.split_batch(frames)
        except DecodeError as e:
            log.warning("rpc client: dropped a malformed message: %s", e)
            return
        del frames
        for doc, buffers in envelopes:
            try:
                envelope = p.unpack_envelope(self._codec, doc, buffers)
            except DecodeError as e:
                head = p.peek_call(doc)
                log.warning("rpc client: malformed reply %s: %s", head, e)
                if head is not None:
                    self._fail_one(head[1], e)
                continue
            self._route(envelope)

    def _route(self, env: list[Any]) -> None:
        kind, call_id = env[0], env[1]
        if kind == p.RESULT or kind == p.ERROR:
            fut = self._calls.get(call_id)
            if fut is not None:
                if not fut.done():
                    if kind == p.RESULT and len(env) == 3:
                        fut.set_result(env[2])
                    else:
                        fut.set_exception(p.exception_from_error(env))
                return
            st = self._streams.pop(call_id, None)
            if st is not None and kind == p.ERROR:
                st.finish(p.exception_from_error(env))
        elif kind == p.ITEM:
            st = self._streams.get(call_id)
            if st is None or len(env) != 3:
                return  # a late item of a stream we cancelled
            if len(st.items) >= st.window:
                self._fail_one(call_id, ProtocolError(
                    f"server sent more than the stream window of {st.window} items"))
                self._post_cancel(call_id)
                return
            st.push(env[2])
        elif kind == p.END:
            st = self._streams.pop(call_id, None)
            if st is not None:
                st.finish(None)
        elif kind != p.PONG:
            log.warning("rpc client: unexpected envelope kind %r", kind)

    def _fail_one(self, call_id: int, exc: BaseException) -> None:
        fut = self._calls.get(call_id)
        if fut is not None and not fut.done():
            fut.set_exception(exc)
        st = self._streams.pop(call_id, None)
        if st is not None:
            st.finish(exc)

    # -- sending ------------------------------------------------------------------------------

    def _post_cancel(self, call_id: int) -> None:
        if self._outbox is not None and self._state != _UNAVAILABLE:
            self._outbox.post(None, p.pack_envelope(self._codec, [p.CANCEL, call_id]))

    def _expire_call(self, call_id: int, method: str, timeout: float) -> None:
        fut = self._calls.get(call_id)
        if fut is not None and not fut.done():
            fut.set_exception(DeadlineExceeded(f"{method!r} did not finish within {timeout} s"))
            self._post_cancel(call_id)

    def _expire_stream(self, st: _StreamState, method: str, timeout: float) -> None:
        if self._streams.pop(st.call_id, None) is st:
            st.finish(DeadlineExceeded(f"stream {method!r} did not finish within {timeout} s"))
            self._post_cancel(st.call_id)

    async def _start_stream(self, method: str, args: tuple[Any, ...], timeout: float | None) -> _StreamState:
        outbox = await self._wait_sendable()
        assert self._loop is not None
        call_id = next(self._ids)
        window = self.stream_window
        item = p.pack_envelope(self._codec, [p.STREAM, call_id, method, list(args), timeout, window])
        del args
        st = _StreamState(call_id, window)
        self._streams[call_id] = st
        outbox.post(None, item)
        if timeout is not None:
            st.deadline = self._loop.call_later(timeout, self._expire_stream, st, method, timeout)
        return st

    def _stream_consumed(self, st: _StreamState) -> None:
        st.consumed += 1
        if st.consumed >= (st.window + 1) // 2 and not st.done and self._outbox is not None:
            self._outbox.post(None, p.pack_envelope(self._codec, [p.CREDIT, st.call_id, st.consumed]))
            st.consumed = 0

    def _cancel_stream(self, st: _StreamState) -> None:
        if self._streams.pop(st.call_id, None) is st:
            st.finish(None)
            self._post_cancel(st.call_id)


class RpcStream:
    """Async iterator over a server-streaming call (see RpcClient.stream)."""

    def __init__(self, client: RpcClient, method: str, args: tuple[Any, ...], timeout: float | None) -> None:
        self._client = client
        self._method = method
        self._args: tuple[Any, ...] | None = args
        self._timeout = timeout
        self._state: _StreamState | None = None
        self._started = False

    def __aiter__(self) -> RpcStream:
        return self

    async def __anext__(self) -> Any:
        st = self._state
        if st is None:
            if self._started:  # closed before it started, or starting it failed
                raise StopAsyncIteration
            self._started = True
            args, self._args = self._args, None  # R1: the envelope holds the payload now
            assert args is not None
            st = self._state = await self._client._start_stream(self._method, args, self._timeout)
            del args
        while True:
            if st.items:
                item = st.items.popleft()
                self._client._stream_consumed(st)
                return item
            if st.done:
                error, st.error = st.error, None  # raise it once, then plain StopAsyncIteration
                if error is not None:
                    raise error
                raise StopAsyncIteration
            waiter = st.waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            except asyncio.CancelledError:
                self._cancel()
                raise
            finally:
                st.waiter = None

    async def aclose(self) -> None:
        """Stop the stream; the server closes its generator."""
        self._cancel()

    async def __aenter__(self) -> RpcStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._cancel()

    def _cancel(self) -> None:
        self._started = True
        self._args = None
        st = self._state
        if st is not None and not st.done:
            self._client._cancel_stream(st)
        if st is not None:
            st.items.clear()

    def __del__(self) -> None:
        st = self._state
        if st is None or st.done:
            return
        loop = self._client._loop
        try:
            # Finalizers run in whatever thread dropped the last reference.
            loop.call_soon_threadsafe(self._client._cancel_stream, st)  # type: ignore[union-attr]
        except RuntimeError:  # loop closed: the process is shutting down
            pass
