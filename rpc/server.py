"""RpcServer: a ROUTER socket serving unary and server-streaming handlers on one asyncio loop.

One reader drains the socket and routes each envelope; every call runs as its own task. A
stream handler is an async generator function: the server pulls the next item only while the
client has credit for it (flow control), so a slow client suspends the generator instead of
growing any queue. The generator is closed (its `finally` runs) when the client cancels,
goes away, or the deadline passes.

Thread-safety: every method runs on the loop that called `start()`, except
`call_soon_threadsafe`. A process whose main thread is a synchronous busy loop (the engine)
runs the server in a `LoopThread` and hands data to handlers with
`server.call_soon_threadsafe(queue.put_nowait, item)` or `LoopThread.run(...)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from rpc import protocol as p
from rpc.codec import Codec
from rpc.errors import DecodeError, EncodeError
from rpc.outbox import Outbox
from rpc.sockets import DEFAULT_HWM, SocketReader, make_socket
from rpc.transport import check_address

log = logging.getLogger("rpc.server")

UnaryHandler = Callable[..., Awaitable[Any]]
StreamHandler = Callable[..., AsyncIterator[Any]]


@dataclass(eq=False)
class _Call:
    peer: bytes
    call_id: int
    task: asyncio.Task[None] | None = None
    credits: int = 0
    credit_waiter: asyncio.Future[None] | None = None
    deadline: asyncio.TimerHandle | None = None
    expired: bool = False


@dataclass(eq=False)
class _Peer:
    last_seen: float
    calls: dict[int, _Call] = field(default_factory=dict)


class RpcServer:
    """Serves registered handlers on `address` (`ipc://...` or `tcp://host:port`; a port of
    `*` picks a free one, see `.address` after start)."""

    def __init__(
        self,
        address: str,
        codec: Codec,
        *,
        peer_timeout: float = 3.0,
        max_calls_per_peer: int = 65_536,
        max_window: int = 4096,
        hwm: int = DEFAULT_HWM,
        coalesce: bool = True,
        context: zmq.Context | None = None,
    ) -> None:
        check_address(address)
        self._requested_address = address
        self._codec = codec
        self._peer_timeout = peer_timeout
        self._max_calls_per_peer = max_calls_per_peer
        self._max_window = max_window
        self._hwm = hwm
        self._coalesce = coalesce
        self._ctx = context or zmq.Context.instance()
        self._unary: dict[str, UnaryHandler] = {}
        self._streams: dict[str, StreamHandler] = {}
        self._peers: dict[bytes, _Peer] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: zmq.Socket | None = None
        self._reader: SocketReader | None = None
        self._outbox: Outbox | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._address: str | None = None

    # -- registration (before or after start, loop thread) ----------------------------------

    def register_unary(self, name: str, fn: UnaryHandler) -> None:
        """`fn(*args)` is awaited; its return value is the call's result."""
        self._check_new_name(name)
        if not callable(fn):
            raise TypeError(f"handler for {name!r} is not callable")
        self._unary[name] = fn

    def register_stream(self, name: str, fn: StreamHandler) -> None:
        """`fn(*args)` returns an async iterator (usually an async generator function)."""
        self._check_new_name(name)
        if not callable(fn):
            raise TypeError(f"handler for {name!r} is not callable")
        self._streams[name] = fn

    def _check_new_name(self, name: str) -> None:
        if name in self._unary or name in self._streams:
            raise ValueError(f"method {name!r} already registered")

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The bound endpoint (with the real port when bound to `tcp://host:*`)."""
        return self._address or self._requested_address

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("server not started")
        return self._loop

    async def start(self) -> None:
        if self._sock is not None:
            raise RuntimeError("server already started")
        self._loop = asyncio.get_running_loop()
        sock = make_socket(self._ctx, zmq.ROUTER, hwm=self._hwm)
        try:
            sock.bind(self._requested_address)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self._reader = SocketReader(self._loop, sock, self._on_message)
        self._outbox = Outbox(
            self._loop, sock, self._reader, routed=True,
            on_unreachable=self._on_peer_gone, coalesce=self._coalesce,
        )
        self._reader.start()
        self._reaper = self._loop.create_task(self._reap_silent_peers())

    async def close(self, grace: float = 0.1) -> None:
        """Stop serving: tell every caller the server is going away, cancel all calls (stream
        generators are closed), close the socket."""
        if self._sock is None:
            return
        assert self._outbox is not None and self._reader is not None
        if self._reaper is not None:
            self._reaper.cancel()
        tasks = []
        for peer_id, peer in list(self._peers.items()):
            for call in list(peer.calls.values()):
                self._post(peer_id, p.plain_error_envelope(
                    call.call_id, p.ERR_UNAVAILABLE, "ServerUnavailable", "server shutting down"))
                if call.task is not None:
                    call.task.cancel()
                    tasks.append(call.task)
        self._peers.clear()
        self._outbox.flush()
        if tasks:
            await asyncio.wait(tasks, timeout=max(grace, 1.0))
        self._reader.stop()
        self._outbox.close()
        sock, self._sock = self._sock, None
        # A short linger lets the goodbye errors leave; zmq_close does not block on it.
        sock.close(linger=int(grace * 1000))
        if self.address.startswith("ipc://"):
            # zmq unlinks the socket file later, from its I/O thread; do it now so that
            # "closed" means "gone" for whoever removes the directory next.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address[len("ipc://"):])

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the server's loop; callable from any thread."""
        self.loop.call_soon_threadsafe(fn, *args)

    # -- receiving ---------------------------------------------------------------------------

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            log.warning("rpc server: dropped a message of %d frame(s)", len(frames))
            return
        peer_id = frames[0].bytes
        peer = self._peers.get(peer_id)
        if peer is None:
            peer = self._peers[peer_id] = _Peer(last_seen=time.monotonic())
        else:
            peer.last_seen = time.monotonic()
        try:
            envelopes = p.split_batch(frames[1:])
        except DecodeError as e:
            log.warning("rpc server: dropped a malformed message from peer %s: %s", peer_id.hex(), e)
            return
        del frames
        codec = self._codec
        for doc, buffers in envelopes:
            try:
                envelope = p.unpack_envelope(codec, doc, buffers)
            except DecodeError as e:
                self._reject(peer_id, doc, e)
                continue
            try:
                self._dispatch(peer_id, peer, envelope)
            except DecodeError as e:
                self._reject(peer_id, doc, e)
            envelope = None  # R1: the handler task holds the payload now, not this frame

    def _reject(self, peer_id: bytes, doc: Any, err: DecodeError) -> None:
        head = p.peek_call(doc)
        log.warning("rpc server: malformed envelope from peer %s: %s", peer_id.hex(), err)
        if head is not None and head[0] in (p.CALL, p.STREAM):
            self._post(peer_id, p.plain_error_envelope(
                head[1], p.ERR_BAD_REQUEST, "DecodeError", str(err)))

    def _dispatch(self, peer_id: bytes, peer: _Peer, env: list[Any]) -> None:
        kind, call_id = env[0], env[1]
        if kind == p.CALL or kind == p.STREAM:
            self._start_call(peer_id, peer, kind, call_id, env)
        elif kind == p.CREDIT:
            call = peer.calls.get(call_id)
            if len(env) != 3 or type(env[2]) is not int or env[2] <= 0:
                raise DecodeError("bad CREDIT envelope")
            if call is not None:
                call.credits = min(call.credits + env[2], self._max_window)
                waiter = call.credit_waiter
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
        elif kind == p.CANCEL:
            call = peer.calls.get(call_id)
            if call is not None and call.task is not None:
                call.task.cancel()
        elif kind == p.PING:
            self._post(peer_id, [p.PONG, 0])
        else:
            raise DecodeError(f"unexpected envelope kind {kind} from a client")

    def _start_call(self, peer_id: bytes, peer: _Peer, kind: int, call_id: int, env: list[Any]) -> None:
        is_stream = kind == p.STREAM
        if len(env) != (6 if is_stream else 5):
            raise DecodeError(f"bad {p.KIND_NAMES[kind]} envelope of {len(env)} items")
        method, args, timeout = env[2], env[3], env[4]
        if not isinstance(method, str) or not isinstance(args, list):
            raise DecodeError("method must be a string and args a list")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
            raise DecodeError(f"bad timeout {timeout!r}")
        window = 0
        if is_stream:
            window = env[5]
            if type(window) is not int or not 0 < window <= self._max_window:
                raise DecodeError(f"bad stream window {window!r} (1..{self._max_window})")
        if call_id in peer.calls:
            raise DecodeError(f"call id {call_id} already in flight")
        handler = (self._streams if is_stream else self._unary).get(method)
        if handler is None:
            other = "unary" if is_stream else "stream"
            known = method in (self._unary if is_stream else self._streams)
            msg = f"method {method!r} is a {other} method" if known else f"no method {method!r}"
            self._post(peer_id, p.plain_error_envelope(call_id, p.ERR_UNKNOWN_METHOD, "UnknownMethod", msg))
            return
        if len(peer.calls) >= self._max_calls_per_peer:
            self._post(peer_id, p.plain_error_envelope(
                call_id, p.ERR_BUSY, "TooManyCalls",
                f"peer has {len(peer.calls)} calls in flight (max {self._max_calls_per_peer})"))
            return
        call = _Call(peer=peer_id, call_id=call_id, credits=window)
        peer.calls[call_id] = call
        assert self._loop is not None
        if is_stream:
            coro = self._run_stream(call, handler, args)
        else:
            coro = self._run_unary(call, handler, args)
        args = env = None  # R1: only the task holds the arguments
        call.task = self._loop.create_task(coro)
        # A task cancelled before its first step never enters its try/finally.
        call.task.add_done_callback(lambda _, call=call: self._finish(call))
        if timeout is not None:
            call.deadline = self._loop.call_later(timeout, self._expire, call)

    # -- running calls -----------------------------------------------------------------------

    async def _run_unary(self, call: _Call, fn: UnaryHandler, args: list[Any]) -> None:
        try:
            coro = fn(*args)
            args = None  # R1
            result = await coro
        except asyncio.CancelledError:
            if call.expired:
                self._post_deadline(call)
            return
        except Exception as e:
            self._post(call.peer, p.error_envelope(call.call_id, p.ERR_REMOTE, e))
            return
        finally:
            self._finish(call)
        self._post_value(call, p.RESULT, result)

    async def _run_stream(self, call: _Call, fn: StreamHandler, args: list[Any]) -> None:
        loop = asyncio.get_running_loop()
        agen: Any = None
        try:
            agen = fn(*args)
            args = None  # R1: the generator's frame holds the arguments now
            if not hasattr(agen, "__anext__"):
                raise TypeError(f"stream handler returned {type(agen).__name__}, not an async iterator")
            while True:
                if call.credits <= 0:
                    call.credit_waiter = loop.create_future()
                    await call.credit_waiter
                    call.credit_waiter = None
                    continue
                try:
                    item = await agen.__anext__()
                except StopAsyncIteration:
                    break
                call.credits -= 1
                if not self._post_value(call, p.ITEM, item):
                    return
                item = None  # R1
            self._post(call.peer, [p.END, call.call_id])
        except asyncio.CancelledError:
            if call.expired:
                self._post_deadline(call)
        except Exception as e:
            self._post(call.peer, p.error_envelope(call.call_id, p.ERR_REMOTE, e))
        finally:
            self._finish(call)
            await _close_quietly(agen)

    def _post_value(self, call: _Call, kind: int, value: Any) -> bool:
        try:
            item = p.pack_envelope(self._codec, [kind, call.call_id, value])
        except EncodeError as e:
            self._post(call.peer, p.error_envelope(call.call_id, p.ERR_REMOTE, e))
            return False
        assert self._outbox is not None
        self._outbox.post(call.peer, item)
        return True

    def _post_deadline(self, call: _Call) -> None:
        self._post(call.peer, p.plain_error_envelope(
            call.call_id, p.ERR_DEADLINE, "DeadlineExceeded", "deadline exceeded on the server"))

    def _post(self, peer_id: bytes, envelope: list[Any]) -> None:
        if self._outbox is not None:
            self._outbox.post(peer_id, p.pack_envelope(self._codec, envelope))

    def _expire(self, call: _Call) -> None:
        call.expired = True
        if call.task is not None:
            call.task.cancel()

    def _finish(self, call: _Call) -> None:
        # A task cancelled before its first step ends with a CancelledError whose traceback
        # holds the never-run frame, with the call's arguments, and `call`, which held the
        # task: a cycle only the garbage collector would free. Letting go of the task here
        # breaks it, so the arguments die with the task (R1).
        call.task = None
        if call.deadline is not None:
            call.deadline.cancel()
        peer = self._peers.get(call.peer)
        if peer is not None and peer.calls.get(call.call_id) is call:
            del peer.calls[call.call_id]

    # -- peers ------------------------------------------------------------------------------

    def _on_peer_gone(self, peer_id: bytes) -> None:
        peer = self._peers.pop(peer_id, None)
        if peer is None:
            return
        if peer.calls:
            log.info("rpc server: peer %s gone, cancelling %d call(s)", peer_id.hex(), len(peer.calls))
        for call in peer.calls.values():
            if call.task is not None:
                call.task.cancel()

    async def _reap_silent_peers(self) -> None:
        """Clients ping several times a second; one silent for peer_timeout died or hung, and
        its calls (suspended generators included) must not live on."""
        while True:
            await asyncio.sleep(self._peer_timeout / 4)
            if self._reader is not None and self._reader.input_pending():
                self._reader.kick()  # this loop was busy: judge peers once it caught up
                continue
            now = time.monotonic()
            for peer_id, peer in list(self._peers.items()):
                if now - peer.last_seen > self._peer_timeout:
                    self._on_peer_gone(peer_id)
                    if self._outbox is not None:
                        self._outbox.discard(peer_id)


async def _close_quietly(agen: Any) -> None:
    aclose = getattr(agen, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:
        log.exception("rpc server: error while closing a stream generator")
    except asyncio.CancelledError:
        if inspect.isasyncgen(agen):
            log.warning("rpc server: closing a stream generator was cancelled")
