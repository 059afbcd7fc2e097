"""Non-blocking, order-preserving sender that coalesces envelopes per peer and loop tick.

The first envelope posted to a peer in a loop tick is sent at once (no added latency for a
lone unary reply); envelopes posted to the same peer later in the same tick are sent together
in one multipart message when the tick ends (the engine posts all outputs of one step at
once). A send that hits the high-water mark (EAGAIN) stays queued, in order, and is retried;
nothing is dropped. Loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq

from rpc.protocol import Encoded, batch_frames
from rpc.sockets import SocketReader, send_frames

MAX_ENVELOPES_PER_SEND = 512
# A peer whose pipe stays full while this many envelopes wait for it is not reading: it is
# dropped (its calls cancelled) rather than allowed to grow this process's memory.
MAX_QUEUED_PER_PEER = 100_000
RETRY_MIN_S = 0.0005
RETRY_MAX_S = 0.02

Peer = bytes | None  # routing id on a ROUTER, None on a DEALER

log = logging.getLogger("rpc")


class Outbox:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: zmq.Socket,
        reader: SocketReader,
        *,
        routed: bool,
        on_unreachable: Callable[[bytes], None] | None = None,
        coalesce: bool = True,
    ) -> None:
        self._loop = loop
        self._sock = sock
        self._reader = reader
        self._routed = routed
        self._on_unreachable = on_unreachable
        self._coalesce = coalesce
        self._queued: dict[Peer, list[Encoded]] = {}
        self._num_queued = 0
        self._sent_this_tick: set[Peer] = set()
        self._tick_end_scheduled = False
        self._retry: asyncio.TimerHandle | None = None
        self._retry_delay = RETRY_MIN_S
        self._room_waiters: list[asyncio.Future[None]] = []
        self._closed = False

    @property
    def num_queued(self) -> int:
        """Envelopes waiting for the end of the tick or for room in the pipe."""
        return self._num_queued

    def post(self, peer: Peer, item: Encoded) -> None:
        if self._closed:
            return
        queued = self._queued.get(peer)
        if queued is None:
            if not self._coalesce or peer not in self._sent_this_tick:
                self._sent_this_tick.add(peer)
                self._schedule_tick_end()
                if self._send(peer, [item]):
                    return
            queued = self._queued[peer] = []
        queued.append(item)
        self._num_queued += 1
        self._schedule_tick_end()
        if self._routed and len(queued) > MAX_QUEUED_PER_PEER:
            log.warning("rpc: peer %s stopped reading; dropping it", peer.hex())  # type: ignore[union-attr]
            self._drop_peer(peer)  # type: ignore[arg-type]

    def send_now_or_drop(self, peer: Peer, item: Encoded) -> None:
        """For heartbeats: send if nothing is queued and the pipe has room, else drop."""
        if not self._closed and peer not in self._queued:
            self._send(peer, [item])
            self._schedule_tick_end()

    def discard(self, peer: Peer = None, *, everything: bool = False) -> None:
        """Forget queued envelopes (for a peer that is gone, or all of them)."""
        peers = list(self._queued) if everything else [peer]
        for p in peers:
            self._num_queued -= len(self._queued.pop(p, ()))
        self._wake_room_waiters()

    async def wait_for_room(self, limit: int) -> None:
        """Wait until fewer than `limit` envelopes are queued (backpressure for callers)."""
        while self._num_queued >= limit and not self._closed:
            fut = self._loop.create_future()
            self._room_waiters.append(fut)
            await fut

    def close(self) -> None:
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._queued.clear()
        self._num_queued = 0
        self._wake_room_waiters()

    def flush(self) -> None:
        """Send everything queued that the pipes accept now."""
        self._tick_end_scheduled = False
        self._sent_this_tick.clear()
        if self._closed:
            return
        blocked = False
        for peer in list(self._queued):
            queued = self._queued[peer]
            while queued:
                batch = queued[:MAX_ENVELOPES_PER_SEND]
                if not self._send(peer, batch):
                    blocked = True
                    break
                if self._queued.get(peer) is not queued:
                    break  # the peer is gone: _send discarded its queue
                del queued[: len(batch)]
                self._num_queued -= len(batch)
            if not queued and self._queued.get(peer) is queued:
                del self._queued[peer]
        self._reader.kick()
        self._wake_room_waiters()
        if blocked:
            if self._retry is None:
                self._retry = self._loop.call_later(self._retry_delay, self._retry_flush)
                self._retry_delay = min(self._retry_delay * 2, RETRY_MAX_S)
        else:
            self._retry_delay = RETRY_MIN_S

    def _retry_flush(self) -> None:
        self._retry = None
        self.flush()

    def _schedule_tick_end(self) -> None:
        if not self._tick_end_scheduled:
            self._tick_end_scheduled = True
            self._loop.call_soon(self.flush)

    def _send(self, peer: Peer, items: list[Encoded]) -> bool:
        """True when sent (or dropped because the peer is gone); False on EAGAIN."""
        frames = batch_frames(items)
        if self._routed:
            frames.insert(0, peer)
        try:
            send_frames(self._sock, frames, 2 if self._routed else 1)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH and self._routed:
                assert peer is not None
                self._drop_peer(peer)
                return True
            raise
        return True

    def _drop_peer(self, peer: bytes) -> None:
        self.discard(peer)
        if self._on_unreachable is not None:
            self._on_unreachable(peer)

    def _wake_room_waiters(self) -> None:
        waiters, self._room_waiters = self._room_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
