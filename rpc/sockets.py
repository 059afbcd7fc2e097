"""zmq socket setup and the single reader that drains a socket on the event loop.

Sockets are plain (synchronous) pyzmq sockets driven by the loop through their FD, not
zmq.asyncio sockets: one reader per socket drains it and routes messages synchronously, and
sends are non-blocking calls with no future per message (see Outbox). Everything here runs
on the loop's thread only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq

log = logging.getLogger("rpc")

# Messages (multipart) queued per pipe and direction. A ROUTER without ROUTER_MANDATORY drops
# messages silently at this mark; ours raises EAGAIN instead and the outbox retries, and
# flow-control credits keep the real depth far below it.
DEFAULT_HWM = 10_000
RECONNECT_IVL_MS = 100

# Plain ints: pyzmq's IntFlag constants cost an enum construction per operation.
EVENTS = int(zmq.EVENTS)
POLLIN = int(zmq.POLLIN)
DONTWAIT = int(zmq.DONTWAIT)
SNDMORE = int(zmq.SNDMORE)


def make_socket(ctx: zmq.Context, kind: int, *, hwm: int = DEFAULT_HWM) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if kind == zmq.ROUTER:
        # EHOSTUNREACH for a gone peer and EAGAIN at the high-water mark, never a silent drop.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if kind == zmq.DEALER:
        # Queue only on a live connection: requests are never parked for a dead server and
        # replayed to its successor after the client already failed them.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    return sock


class SocketReader:
    """Drains a zmq socket from the loop and hands each multipart message (list of
    zmq.Frame, received with copy=False) to `on_message`.

    The zmq FD is edge-triggered: it signals only that the socket's state changed, so the
    reader drains until ZMQ_EVENTS shows no input, and `kick()` must be called after sends
    on the same socket (a send can consume the edge of a message that arrived meanwhile)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: zmq.Socket,
        on_message: Callable[[list[zmq.Frame]], None],
        *,
        max_per_wake: int = 256,
    ) -> None:
        self._loop = loop
        self._sock = sock
        self._on_message = on_message
        self._max_per_wake = max_per_wake
        self._fd: int | None = None
        self._scheduled = False

    def start(self) -> None:
        self._fd = self._sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._drain)
        self.kick()

    def stop(self) -> None:
        if self._fd is not None:
            self._loop.remove_reader(self._fd)
            self._fd = None

    def input_pending(self) -> bool:
        return self._fd is not None and bool(self._sock.getsockopt(EVENTS) & POLLIN)

    def kick(self) -> None:
        if self._fd is None or self._scheduled:
            return
        if self._sock.getsockopt(EVENTS) & POLLIN:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        sock = self._sock
        for _ in range(self._max_per_wake):
            if self._fd is None or not sock.getsockopt(EVENTS) & POLLIN:
                return
            try:
                frames = sock.recv_multipart(DONTWAIT, copy=False)
            except zmq.Again:
                return
            try:
                self._on_message(frames)
            except Exception:  # one bad message must not stop the reader
                log.exception("rpc: error while handling a message")
            del frames
        # More input is waiting: yield to the loop so other work runs, then continue.
        if self._fd is not None and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._drain)


def send_frames(sock: zmq.Socket, frames: list, num_small: int) -> None:
    """Send one multipart message without blocking: the first `num_small` frames (routing
    id, header, body) are copied, the rest (array buffers) go zero-copy. zmq checks the
    high-water mark and the peer's presence on the first frame only, so Again /
    EHOSTUNREACH can only come from it, before anything is queued."""
    send = sock.send
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        send(frame, DONTWAIT if i == last else DONTWAIT | SNDMORE, copy=i < num_small)
