"""The engine's end of the wire: a ROUTER socket, read by a thread of its own.

The engine's busy loop stays synchronous. Between steps it takes the commands that arrived
(`take_commands`: AddRequest and AbortRequests, in arrival order) and after each step it
sends the step's outputs itself (`send_step`), one StepOutputs per API process: a step costs
no wake of another thread. The thread receives: it answers pings at once, with the stats
the busy loop last published, so a long model step never looks like a dead engine, and it
aborts the requests of an API process that has gone silent for `peer_timeout_s` (the API
pings several times a second); if that process speaks again, each of those requests ends
with ErrorCode.DROPPED, so none waits on an engine that forgot it. Both threads use the
socket under one lock (what zmq asks of a socket shared by threads); the thread waits on
the socket's file descriptor, outside the lock.

Encoder cache keys: the busy loop posts, with each step, the keys its encoder cache added and
removed; every API process learns them with its next message from here (a reply to its
pings at the latest), so it can leave out the pixels of images the engine holds. A new API
process first gets every key held now. This is a hint only (ErrorCode.IMAGE_MISSING).

Flow control: the engine holds at most `max_requests` requests. The API reads that capacity
from the stats and never sends more; an AddRequest beyond it is refused here at once with
ErrorCode.BUSY and its pixels dropped, so nothing queues in this process without bound.

With `keys` the socket is a CURVE server on a zmq context of its own, whose ZAP handler
admits only the authorized API keys: a refused peer's messages never reach this thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import threading
import time
from collections import deque
from typing import Any

import zmq

from rpc.codec import DecodeError, decode, encode, peek_request_id
from rpc.curve import ServerKeys, start_authenticator
from rpc.sockets import make_socket
from shared.memory_plan import MemoryPlan
from shared.messages import (
    AbortRequests,
    AddRequest,
    EncoderKeyNews,
    EngineStats,
    ErrorCode,
    Ping,
    RequestOutput,
    StepOutputs,
)

log = logging.getLogger(__name__)

MAX_RECV_PER_WAKE = 1024
MAX_PENDING_PER_PEER = 1000  # steps waiting for a peer whose pipe stays full: it is not reading
MAX_KEY_NEWS = 4096  # key changes kept for one API process before it gets all keys instead
MAX_DROPPED_PEERS = 16  # API processes whose aborted requests are kept to tell them, if back


class _KeyNews:
    """Encoder cache key changes one API process has not heard yet."""

    __slots__ = ("reset", "added", "removed")

    def __init__(self, reset: bool = False, added: list[bytes] = ()) -> None:
        self.reset = reset
        self.added: dict[bytes, None] = dict.fromkeys(added)
        self.removed: set[bytes] = set()

    def record(self, added: list[bytes], removed: list[bytes]) -> None:
        for key in removed:
            self.added.pop(key, None)
            if not self.reset:  # after a reset the peer knows nothing to remove
                self.removed.add(key)
        for key in added:
            self.removed.discard(key)
            self.added[key] = None

    def __len__(self) -> int:
        return len(self.added) + len(self.removed)

    def message(self) -> EncoderKeyNews:
        return EncoderKeyNews(self.reset, list(self.added), list(self.removed))


class EngineServer:
    def __init__(self, address: str, max_requests: int, *, peer_timeout_s: float = 3.0,
                 keys: ServerKeys | None = None) -> None:
        self.address = address
        self.keys = keys
        self.max_requests = max_requests
        self.peer_timeout_s = peer_timeout_s
        self.stats: EngineStats | None = None  # published by the busy loop, read here
        self.memory_plan: MemoryPlan | None = None  # set once before start, sent with the
        #                                           first answer to each API process's ping
        self._commands: queue.SimpleQueue[AddRequest | AbortRequests] = queue.SimpleQueue()
        self._has_commands = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()  # the socket and everything below: either thread
        self._sock: zmq.Socket | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._owner: dict[str, bytes] = {}  # request id -> the API process that sent it
        self._last_seen: dict[bytes, float] = {}
        self._pending: dict[bytes, deque[list[Any]]] = {}  # frames waiting for room
        self._cache_keys: set[bytes] = set()  # the engine's encoder cache keys, as posted
        self._key_news: dict[bytes, _KeyNews] = {}  # per API process, not sent yet
        # per dropped API process, oldest first: (why, the requests aborted), told if it returns
        self._dropped: dict[bytes, tuple[str, list[str]]] = {}
        self._plan_told: set[bytes] = set()  # API processes that have the memory plan

    # ---- the busy loop's side ---------------------------------------------------------

    def start(self) -> None:
        """Bind and start serving; raises if the address cannot be bound."""
        ready: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="engine-io",
                                        daemon=True)
        self._thread.start()
        error = ready.get()
        if error is not None:
            raise error

    def take_commands(self) -> list[AddRequest | AbortRequests]:
        self._has_commands.clear()
        commands = []
        with contextlib.suppress(queue.Empty):
            while True:
                commands.append(self._commands.get_nowait())
        return commands

    def wait_for_commands(self, timeout: float) -> None:
        self._has_commands.wait(timeout)

    def send_step(self, outputs: list[RequestOutput], keys_added: list[bytes] = (),
                  keys_removed: list[bytes] = ()) -> None:
        """Send a step's outputs, each to the API process that sent its request, and record
        its encoder cache key changes (every API process hears of them with its next
        message). Before start() or after stop(), nothing is sent."""
        with self._lock:
            sock = self._sock
            if sock is None:
                return
            if keys_added or keys_removed:
                self._record_keys(list(keys_added), list(keys_removed))
            self._route(sock, outputs)
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                # a send can take the edge of input that arrived meanwhile: the thread
                # would not see it on the descriptor
                os.write(self._wake_w, b"\0")

    def stop(self) -> None:
        """Close the socket (what send_step sent is out: the socket lingers to send it)."""
        self._stopping.set()
        os.write(self._wake_w, b"\0")
        if self._thread is not None:
            self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---- the I/O thread ---------------------------------------------------------------

    def _run(self, ready: queue.SimpleQueue) -> None:
        # ZAP is per context: a CURVE server gets one of its own and its own authenticator
        ctx = zmq.Context.instance() if self.keys is None else zmq.Context()
        auth = None if self.keys is None else start_authenticator(ctx, self.keys)
        sock = make_socket(ctx, zmq.ROUTER, self.keys)
        try:
            sock.bind(self.address)
            self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            sock.close()
            self._close_context(ctx, auth)
            ready.put(OSError(f"cannot bind {self.address}: {e}"))
            return
        with self._lock:
            self._sock = sock
            fd = sock.getsockopt(zmq.FD)
        ready.put(None)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        more = True
        try:
            while not self._stopping.is_set():
                if not more:  # zmq's descriptor is edge-triggered: wait only once drained
                    for ready_fd, _ in poller.poll(1 if self._pending else 250):
                        if ready_fd == self._wake_r:
                            os.read(self._wake_r, 4096)
                with self._lock:
                    self._receive(sock)
                    self._flush(sock)
                    self._reap_silent_peers()
                    more = bool(sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        finally:
            with self._lock:
                self._sock = None
                sock.close(linger=200)
            self._close_context(ctx, auth)
            if self.address.startswith("ipc://"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.address[len("ipc://"):])

    def _close_context(self, ctx: zmq.Context, auth: Any) -> None:
        if self.keys is not None:  # the context is this server's own
            auth.stop()
            ctx.term()

    def _receive(self, sock: zmq.Socket) -> None:
        for _ in range(MAX_RECV_PER_WAKE):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            peer = frames[0].bytes
            if peer not in self._last_seen:  # a new API process: it first hears every key
                self._key_news[peer] = _KeyNews(True, list(self._cache_keys))
                self._tell_dropped(sock, peer)
            self._last_seen[peer] = time.monotonic()
            try:
                message = decode(frames[1:])
            except DecodeError as e:
                log.warning("malformed message from %s refused: %s", peer.hex(), e)
                request_id = peek_request_id(frames[1:])
                if request_id is not None and request_id not in self._owner:
                    self._refuse(sock, peer, request_id, ErrorCode.REJECTED, f"malformed: {e}")
                continue
            del frames
            kind = type(message)
            if kind is AddRequest:
                self._add(sock, peer, message)
            elif kind is AbortRequests:
                ids = [r for r in message.request_ids if self._owner.get(r) == peer]
                for request_id in ids:
                    del self._owner[request_id]
                self._command(AbortRequests(ids))
            elif kind is Ping:
                plan = None if peer in self._plan_told else self.memory_plan
                self._plan_told.add(peer)
                self._post(sock, peer, StepOutputs([], self.stats, memory_plan=plan))
            else:
                log.warning("unexpected %s from %s ignored", kind.__name__, peer.hex())
            message = None  # R1: the busy loop holds the request now

    def _add(self, sock: zmq.Socket, peer: bytes, request: AddRequest) -> None:
        request_id = request.request_id
        if not isinstance(request_id, str):
            log.warning("AddRequest without a string request id from %s ignored", peer.hex())
        elif request_id in self._owner:
            self._refuse(sock, peer, request_id, ErrorCode.REJECTED,
                         f"request id {request_id!r} is already running")
        elif len(self._owner) >= self.max_requests:
            self._refuse(sock, peer, request_id, ErrorCode.BUSY,
                         f"engine holds its maximum of {self.max_requests} requests")
        else:
            self._owner[request_id] = peer
            self._command(request)

    def _command(self, command: AddRequest | AbortRequests) -> None:
        self._commands.put(command)
        self._has_commands.set()

    def _refuse(self, sock: zmq.Socket, peer: bytes, request_id: str, code: ErrorCode,
                error: str) -> None:
        output = RequestOutput(request_id, [], "error", error=error, error_code=code)
        self._post(sock, peer, StepOutputs([output], self.stats))

    def _route(self, sock: zmq.Socket, outputs: list[RequestOutput]) -> None:
        by_peer: dict[bytes, list[RequestOutput]] = {}
        for output in outputs:
            peer = self._owner.get(output.request_id)
            if peer is None:
                continue  # aborted by its API process, or that process is gone
            if output.finish_reason is not None:
                del self._owner[output.request_id]
            by_peer.setdefault(peer, []).append(output)
        for peer, mine in by_peer.items():
            self._post(sock, peer, StepOutputs(mine, self.stats))

    def _record_keys(self, added: list[bytes], removed: list[bytes]) -> None:
        self._cache_keys.difference_update(removed)
        self._cache_keys.update(added)
        for peer, news in self._key_news.items():
            news.record(added, removed)
            if len(news) > MAX_KEY_NEWS + len(self._cache_keys):
                self._key_news[peer] = _KeyNews(True, list(self._cache_keys))

    def _post(self, sock: zmq.Socket, peer: bytes, message: StepOutputs) -> None:
        news = self._key_news.get(peer)
        if news is not None and (news.reset or len(news)):
            message.encoder_keys = news.message()
            self._key_news[peer] = _KeyNews()
        frames = [peer, *encode(message)]
        pending = self._pending.get(peer)
        if pending is None and self._send(sock, peer, frames):
            return
        if pending is None:
            pending = self._pending[peer] = deque()
        pending.append(frames)
        if len(pending) > MAX_PENDING_PER_PEER:
            self._drop_peer(peer, f"{len(pending)} messages waiting: it stopped reading")

    def _send(self, sock: zmq.Socket, peer: bytes, frames: list[Any]) -> bool:
        """True when sent or the peer is gone; False when its pipe is full."""
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._drop_peer(peer, "disconnected")
        return True

    def _flush(self, sock: zmq.Socket) -> None:
        for peer, pending in list(self._pending.items()):
            while pending and self._send(sock, peer, pending[0]):
                if self._pending.get(peer) is not pending:
                    break  # dropped while sending
                pending.popleft()
            if not pending and self._pending.get(peer) is pending:
                del self._pending[peer]

    def _tell_dropped(self, sock: zmq.Socket, peer: bytes) -> None:
        """An API process that was dropped (silent, or not reading) speaks again: it still
        counts the requests aborted then as running, so each ends now with an error (their
        streams would otherwise wait, holding their image budget, until their clients gave
        up)."""
        reason, ids = self._dropped.pop(peer, ("", []))
        if ids:
            error = f"aborted: this API process was {reason}"
            self._post(sock, peer, StepOutputs(
                [RequestOutput(r, [], "error", error=error, error_code=ErrorCode.DROPPED)
                 for r in ids], self.stats))

    def _reap_silent_peers(self) -> None:
        now = time.monotonic()
        for peer, seen in list(self._last_seen.items()):
            if now - seen > self.peer_timeout_s:
                self._drop_peer(peer, f"silent for {now - seen:.1f} s")

    def _drop_peer(self, peer: bytes, reason: str) -> None:
        ids = [r for r, p in self._owner.items() if p == peer]
        if ids:
            log.warning("API process %s %s: aborting its %d requests", peer.hex(), reason, len(ids))
            for request_id in ids:
                del self._owner[request_id]
            self._command(AbortRequests(ids))
            self._dropped.pop(peer, None)
            self._dropped[peer] = (reason, ids)
            while len(self._dropped) > MAX_DROPPED_PEERS:
                del self._dropped[next(iter(self._dropped))]
        self._pending.pop(peer, None)
        self._last_seen.pop(peer, None)
        self._key_news.pop(peer, None)
        self._plan_told.discard(peer)
