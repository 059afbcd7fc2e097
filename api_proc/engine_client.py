"""The API process's side of the engines: one connection each, least-loaded routing, and
every request's outputs.

    stream = engines.submit(AddRequest(...))  # sent before it returns; keeps only ids (R1)
    async for output in stream: ...           # RequestOutputs; aclose() aborts the request

One reader per engine receives its StepOutputs (one per engine step) and hands each output
to its request's stream. A stream holds at most its undelivered tokens: outputs that arrive
while its consumer is busy are merged into one, never queued one by one, so a slow HTTP
client costs memory bounded by its max_tokens. An engine that dies (its process exits, or it
leaves pings unanswered for heartbeat_timeout_s) fails all of its requests at once with a
typed 503; its connection starts over on a fresh socket and the engine is used again once it
answers.

Over tcp:// a connection uses CURVE keys when given (rpc/curve.py) and watches its handshakes:
an engine that refuses our key, or holds another key than the one we pin, is reported as such
(health, 503s) instead of as a silent engine; the socket starts over so a fixed engine is
found again.

Each connection mirrors the keys of its engine's encoder cache (StepOutputs.encoder_keys),
bounded, so the pipeline can leave out the pixels of images the engine holds (serving.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from api_proc.admission import Reservation
from api_proc.errors import BadRequest, EngineFailed, EngineUnavailable, HTTPError
from rpc.codec import DecodeError, decode, encode
from rpc.curve import ClientKeys, uses_curve
from rpc.sockets import check_address, make_socket
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

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.2
HEARTBEAT_TIMEOUT_S = 1.0
MAX_MIRRORED_KEYS = 1 << 16  # 17-byte keys: a few MB at most; the oldest go first
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)
NOT_CONNECTED = "not connected yet"
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class EngineConnection:
    """One engine: its DEALER socket, liveness, stats and the streams routed to it. Belongs
    to the event loop that opened it."""

    def __init__(self, address: str, process: Any = None, *,
                 heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
                 keys: ClientKeys | None = None) -> None:
        check_address(address)
        self.address = address
        self.keys = keys if uses_curve(address) else None
        self.process = process  # the engine's Popen when this process launched it
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # weak: a stream dropped unconsumed (its client left before the response started)
        # is noticed by its finalizer and aborted, instead of running on to max_tokens
        self.streams: weakref.WeakValueDictionary[str, RequestStream] = \
            weakref.WeakValueDictionary()
        self.on_request_end: Callable[[], None] = lambda: None
        self.num_tokens = 0  # prompt tokens not yet prefilled + completion tokens not yet made
        self.stats: EngineStats | None = None
        self.memory_plan: MemoryPlan | None = None  # the engine's, from its answers to pings
        self.encoder_keys: dict[bytes, None] = {}  # the engine's encoder cache, as last heard
        self.lost_reason: str | None = NOT_CONNECTED
        self._ready = asyncio.Event()
        self._heard = asyncio.Event()  # an answer, or a refused handshake
        self._reasons_logged: set[str] = set()  # since it last answered: a few at most
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None  # tcp:// only: handshake failures
        self._heartbeat: asyncio.Task | None = None
        self._unanswered_since: float | None = None
        self._num_unsettled = 0  # streams dropped unended whose abort is not sent yet

    @property
    def available(self) -> bool:
        return self.lost_reason is None and self.death_reason() is None

    @property
    def has_room(self) -> bool:
        num_requests = len(self.streams) + self._num_unsettled
        return self.stats is None or num_requests < self.stats.max_requests

    def holds_image(self, key: bytes) -> bool:
        """Whether the engine's encoder cache held `key` when it last said (a hint: an
        image sent without pixels on it may still come back ErrorCode.IMAGE_MISSING)."""
        return bool(key) and key in self.encoder_keys

    def death_reason(self) -> str | None:
        if self.process is not None and self.process.poll() is not None:
            return f"engine process exited with code {self.process.returncode}"
        return None

    def open(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._open_socket()
        self._heartbeat = self._loop.create_task(self._beat())

    async def wait_ready(self, timeout_s: float) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout_s)

    async def wait_heard(self, timeout_s: float) -> None:
        """Until the engine answers or refuses our handshake."""
        await asyncio.wait_for(self._heard.wait(), timeout_s)

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self.streams:  # the engine stops them now, not when it notices this process is gone
            self.send(AbortRequests(list(self.streams)))
        self._fail_all(EngineUnavailable("the API server is shutting down"))
        self._close_socket()

    def send(self, message: AddRequest | AbortRequests | Ping) -> bool:
        """Send at once (zmq keeps the pixel frames until they are out); False when the
        engine is not connected or its pipe is full."""
        if self._sock is None:
            return False
        try:
            self._sock.send_multipart(encode(message), _NOBLOCK, copy=False)
        except zmq.Again:
            return False
        finally:
            self._kick()  # a send can consume the edge of a message that arrived meanwhile
        return True

    # ---- receiving

    def _open_socket(self) -> None:
        self._sock = make_socket(zmq.Context.instance(), zmq.DEALER, self.keys)
        if self.address.startswith("tcp://"):
            self._monitor = self._sock.get_monitor_socket(HANDSHAKE_FAILED)
        self._sock.connect(self.address)
        self._loop.add_reader(self._sock.getsockopt(zmq.FD), self._drain)
        self._kick()

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
            if self._monitor is not None:
                self._sock.disable_monitor()
                self._monitor.close(linger=0)
                self._monitor = None
            self._sock.close(linger=0)
            self._sock = None

    def _kick(self) -> None:
        if self._sock is not None and self._sock.getsockopt(_EVENTS) & _POLLIN:
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        """zmq's FD is edge-triggered: read until the socket says no input is left."""
        for _ in range(256):
            sock = self._sock
            if sock is None or not sock.getsockopt(_EVENTS) & _POLLIN:
                return
            try:
                frames = sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                message = decode(frames)
            except DecodeError as e:
                logger.error("engine %s sent a malformed message: %s", self.address, e)
                continue
            if type(message) is StepOutputs:
                self._on_step(message)
        self._loop.call_soon(self._drain)  # more is waiting: let other work run first

    def _on_step(self, step: StepOutputs) -> None:
        self._unanswered_since = None
        if step.stats is not None:
            self.stats = step.stats
        if step.memory_plan is not None:
            self.memory_plan = step.memory_plan
        if step.encoder_keys is not None:
            self._apply_key_news(step.encoder_keys)
        if self.lost_reason is not None:
            self.lost_reason = None
            self._reasons_logged.clear()
            self._ready.set()
            self._heard.set()
        streams = self.streams
        for output in step.outputs:
            stream = streams.get(output.request_id)
            if stream is not None:
                stream._push(output)

    def _apply_key_news(self, news: EncoderKeyNews) -> None:
        keys = self.encoder_keys
        if news.reset:
            keys.clear()
        for key in news.removed:
            keys.pop(key, None)
        for key in news.added:
            keys[key] = None
        while len(keys) > MAX_MIRRORED_KEYS:
            del keys[next(iter(keys))]

    # ---- liveness

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            reason = self.death_reason()
            if reason is not None:
                if self.lost_reason != reason:
                    self._lose(reason)
                continue
            refused = self._handshake_failure()
            if refused is not None:  # zmq gives up on such a connection: start over
                self._lose(refused)
                self._heard.set()
                continue
            if self._sock is not None and self._sock.getsockopt(_EVENTS) & _POLLIN:
                self._kick()  # replies are waiting: this loop was busy, the engine was not
                continue
            # silence counts from the first ping after the last answer: a stall of this
            # loop (no pings sent) says nothing about the engine
            if self._unanswered_since is None:
                self._unanswered_since = time.monotonic()
            elif time.monotonic() - self._unanswered_since > self.heartbeat_timeout_s:
                if self.lost_reason is None:
                    self._lose(f"no answer to pings for {self.heartbeat_timeout_s} s")
                elif self.lost_reason == NOT_CONNECTED:  # not logged: it may be loading
                    self.lost_reason = ("no answer to pings since connecting: the engine is "
                                        "unreachable" + (" or refused our key" if self.keys
                                                         else ""))
            self.send(Ping())

    def _handshake_failure(self) -> str | None:
        """Why the last handshake failed, if one did since the last look."""
        reason = None
        while self._monitor is not None:
            try:
                event = recv_monitor_message(self._monitor, _NOBLOCK)
            except zmq.Again:
                break
            reason = self._describe_handshake_failure(event["event"], event["value"])
        return reason

    def _describe_handshake_failure(self, event: int, value: int) -> str:
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (f"the engine refused our key (ZAP status {value}): put our client.key "
                    "into its authorized/ folder")
        # a peer that drops the connection at once reads as "no detail": a mismatch too
        mismatch = (event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
        if self.keys is None:
            if mismatch:
                return "the engine requires CURVE keys: give --curve-key-dir"
            return ("handshake failed: the engine requires CURVE keys (give --curve-key-dir) "
                    "or is no flatserve engine")
        if mismatch:
            return "the engine takes no CURVE keys: start it with --curve-key-dir"
        return ("CURVE handshake failed: the engine's key is not our server.key, or it takes "
                "no keys")

    def _lose(self, reason: str) -> None:
        """Fail everything routed to this engine; start over on a fresh socket (a new
        identity: nothing stale reaches the engine that answers next)."""
        if reason not in self._reasons_logged:  # a refused handshake repeats every beat
            self._reasons_logged.add(reason)
            logger.warning("engine %s unavailable: %s", self.address, reason)
        self.lost_reason = reason
        self.stats = None  # its gauges must not show it busy; the next answer brings fresh ones
        self.encoder_keys.clear()  # the engine that answers next may be a fresh one
        self._ready.clear()
        self._unanswered_since = None
        self._fail_all(EngineUnavailable(f"engine unavailable: {reason}"))
        self._close_socket()
        self._open_socket()

    def _fail_all(self, error: HTTPError) -> None:
        for stream in list(self.streams.values()):
            stream._fail(error)

    def _forget(self, request_id: str, budget: int, reservation: Reservation | None) -> None:
        """Settle a stream dropped before it ended; runs in whatever thread dropped it."""
        def settle() -> None:
            self.num_tokens -= budget
            if reservation is not None:
                reservation.release()
            self.send(AbortRequests([request_id]))  # before its room shows as free
            self._num_unsettled -= 1
            self.on_request_end()
        self._num_unsettled += 1
        try:
            self._loop.call_soon_threadsafe(settle)
        except (AttributeError, RuntimeError):  # never opened, or the loop is closed
            self._num_unsettled -= 1


class EngineClient:
    """Routes each request to the usable engine with the least outstanding work."""

    def __init__(self, engines: Sequence[EngineConnection]) -> None:
        self.engines = list(engines)
        self._rr = itertools.count()
        self._room_freed = asyncio.Event()
        self._num_waiting_for_room = 0
        self._stopping: str | None = None
        for engine in self.engines:
            engine.on_request_end = self._request_ended

    @classmethod
    def connect(cls, addresses: Sequence[str], processes: Sequence[Any] | None = None,
                **kwargs: Any) -> EngineClient:
        procs = list(processes or [])
        return cls([EngineConnection(a, procs[i] if i < len(procs) else None, **kwargs)
                    for i, a in enumerate(addresses)])

    async def start(self, timeout_s: float = 10.0) -> None:
        """Connect every engine and wait (bounded) until each answers or refuses us."""
        for engine in self.engines:
            engine.open()
        results = await asyncio.gather(*(e.wait_heard(timeout_s) for e in self.engines),
                                       return_exceptions=True)
        for engine, result in zip(self.engines, results, strict=True):
            if isinstance(result, BaseException):
                logger.warning("engine %s not answering %.0f s after start: %s",
                               engine.address, timeout_s, engine.lost_reason)

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.engines))

    @property
    def num_in_flight(self) -> int:
        return sum(len(e.streams) for e in self.engines)

    def abort_all(self, reason: str) -> int:
        """Shutting down: fail every request in flight with 503 `reason` and abort it in its
        engine; refuse new ones from now on. How many there were."""
        self._stopping = reason
        num_aborted = 0
        for engine in self.engines:
            streams = list(engine.streams.values())
            for stream in streams:
                stream._fail(EngineUnavailable(reason, code="server_shutting_down"))
            if streams:
                engine.send(AbortRequests([s.request_id for s in streams]))
            num_aborted += len(streams)
        return num_aborted

    def pick(self) -> EngineConnection:
        """The usable engine with room and the least outstanding work (tokens, then
        requests, then round robin); 503 when none is usable."""
        if self._stopping is not None:
            raise EngineUnavailable(self._stopping, code="server_shutting_down")
        if not self.engines:
            raise EngineUnavailable("no engine is configured")
        rr, n = next(self._rr), len(self.engines)
        usable = [(not e.has_room, e.num_tokens, len(e.streams), (i - rr) % n, e)
                  for i, e in enumerate(self.engines) if e.available]
        if not usable:
            reasons = "; ".join(f"{e.address}: {e.death_reason() or e.lost_reason}"
                                for e in self.engines)
            raise EngineUnavailable(f"no engine is available ({reasons})")
        return min(usable, key=lambda t: t[:4])[4]

    async def wait_for_room(self, timeout_s: float) -> None:
        """Wait until an engine can take one more request (engines refuse past their
        capacity; requests wait here instead, holding their admission bytes)."""
        deadline = time.monotonic() + timeout_s
        self._num_waiting_for_room += 1
        try:
            while not self.pick().has_room:
                self._room_freed.clear()
                left = deadline - time.monotonic()
                try:
                    await asyncio.wait_for(self._room_freed.wait(), max(left, 0))
                except TimeoutError:
                    raise EngineUnavailable(
                        f"every engine holds its maximum of requests for {timeout_s} s",
                        code="engine_busy") from None
        finally:
            self._num_waiting_for_room -= 1

    def submit(self, request: AddRequest, mm_reservation: Reservation | None = None,
               engine: EngineConnection | None = None) -> RequestStream:
        """Send `request` to `engine` (default: the least-loaded) before returning; keep
        only its id and token counts. `mm_reservation` (its pixels' admission bytes) is
        released at its first output, when the engine has freed the pixels (R3), or when it
        ends earlier."""
        try:
            engine = engine or self.pick()
            stream = RequestStream(engine, request.request_id,
                                   len(request.prompt_token_ids), request.sampling.max_tokens,
                                   mm_reservation)
        except BaseException:
            if mm_reservation is not None:
                mm_reservation.release()
            raise
        if not engine.send(request):
            stream._fail(EngineUnavailable(f"engine {engine.address} is not taking requests"))
        return stream

    def _request_ended(self) -> None:
        if self._num_waiting_for_room:
            self._room_freed.set()

    async def health(self) -> list[dict]:
        """One entry per engine: {"address", "ok", "reason", "num_requests"}."""
        return [{"address": e.address, "ok": e.available,
                 "reason": e.death_reason() or e.lost_reason, "num_requests": len(e.streams)}
                for e in self.engines]


_ERRORS: dict[int, tuple[type[HTTPError], str]] = {
    ErrorCode.REJECTED: (BadRequest, "engine_rejected"),
    ErrorCode.BUSY: (EngineUnavailable, "engine_busy"),
    ErrorCode.STOPPING: (EngineUnavailable, "engine_stopping"),
    ErrorCode.DROPPED: (EngineUnavailable, "engine_dropped_request"),
    # caught by image_resubmit.py, which sends the request again with its pixels
    ErrorCode.IMAGE_MISSING: (EngineFailed, "image_missing"),
}


def _api_error(output: RequestOutput) -> HTTPError:
    cls, code = _ERRORS.get(output.error_code, (EngineFailed, "engine_error"))
    return cls(f"engine: {output.error or 'request failed'}", code=code)


OnOutput = Callable[[RequestOutput], None]
OnError = Callable[[HTTPError], None]


class RequestStream:
    """One request's outputs; keeps only ids, counters and undelivered tokens (R2).

    Read either by iterating (a task wakes for every output), or by `deliver(on_output,
    on_error)`: each output is handed on inside the engine reader's callback as it arrives,
    so one engine step costs one wake of this process whatever the number of requests (how
    responses.py streams)."""

    __slots__ = ("request_id", "_engine", "_prompt_tokens", "_budget", "_first",
                 "_done", "_output", "_error", "_waiter", "_mm_reservation", "_on_output",
                 "_on_error", "_aborted", "__weakref__")

    def __init__(self, engine: EngineConnection, request_id: str,
                 prompt_tokens: int, max_tokens: int, mm_reservation: Reservation | None) -> None:
        self.request_id = request_id
        self._engine = engine
        self._prompt_tokens = prompt_tokens
        self._budget = prompt_tokens + max_tokens  # this request's share of engine.num_tokens
        self._first = True
        self._done = False
        self._output: RequestOutput | None = None
        self._error: HTTPError | None = None
        self._waiter: asyncio.Future | None = None
        self._mm_reservation = mm_reservation
        self._on_output: OnOutput | None = None
        self._on_error: OnError | None = None
        self._aborted = False
        engine.streams[request_id] = self
        engine.num_tokens += self._budget

    @property
    def engine(self) -> EngineConnection:
        return self._engine

    @property
    def finished(self) -> bool:
        """Ended, and everything it received was delivered."""
        return self._done and self._output is None and self._error is None

    def deliver(self, on_output: OnOutput, on_error: OnError) -> None:
        """From now on, call on_output(output) for each output as it arrives (what arrived
        before, at once), and on_error(error) for the error that ends the request, if one
        does; both run in the engine reader's callback and must not block. Not after
        iterating; again after pause()."""
        if self._aborted:
            return
        self._on_output, self._on_error = on_output, on_error
        output, error = self._output, self._error
        self._output = self._error = None
        if output is not None:
            self._hand(output, on_output, on_error)
        if error is not None and not self._aborted:  # not when the consumer just aborted
            self._hand_error(error, on_error)

    def pause(self) -> None:
        """Hand nothing on until deliver() is called again: outputs arriving meanwhile
        are merged into one (at most the request's own tokens), as for a busy iterator."""
        self._on_output = self._on_error = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            output = self._output
            if output is not None:
                self._output = None
                output, error = self._settle(output)
                if error is not None:
                    self._error = error  # the tokens first, then the error
                if output is not None:
                    return output
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self._done:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def abort(self) -> None:
        """Stop early: abort the request in the engine; nothing more is delivered."""
        self._aborted = True
        if not self._done:
            self._end()
            self._engine.send(AbortRequests([self.request_id]))
        self._output = None
        self._on_output = self._on_error = None

    async def aclose(self) -> None:
        self.abort()

    def _push(self, output: RequestOutput) -> None:
        on_output = self._on_output
        if on_output is not None:
            self._hand(output, on_output, self._on_error)
            return
        pending = self._output
        if pending is None:
            self._output = output
        else:  # the consumer is behind: merge, so a stream never holds more than its tokens
            pending.new_token_ids.extend(output.new_token_ids)
            if output.logprobs:
                if pending.logprobs is None:
                    pending.logprobs = output.logprobs
                else:
                    pending.logprobs.extend(output.logprobs)
            if output.prompt_logprobs is not None:  # sent once, with the first token
                pending.prompt_logprobs = output.prompt_logprobs
            pending.finish_reason = output.finish_reason
            pending.num_completion_tokens = output.num_completion_tokens
            pending.error, pending.error_code = output.error, output.error_code
        if output.finish_reason is not None:
            self._end()
        self._wake()

    def _fail(self, error: HTTPError) -> None:
        if not self._done:
            self._end()
            on_error = self._on_error
            if on_error is not None:
                self._hand_error(error, on_error)
                return
            self._error = error
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _settle(self, output: RequestOutput) -> tuple[RequestOutput | None, HTTPError | None]:
        """Account for an output handed to the consumer: what to hand on (None: no tokens
        to show) and the error that ends the request, if any."""
        self._account(output)
        if output.finish_reason is None:
            return output, None
        self._end()
        if output.finish_reason != "error":
            return output, None
        error = _api_error(output)
        if not output.new_token_ids:
            return None, error
        output.finish_reason = None
        return output, error

    def _hand(self, output: RequestOutput, on_output: OnOutput, on_error: OnError) -> None:
        output, error = self._settle(output)
        try:
            if output is not None:
                on_output(output)
            if error is not None and not self._aborted:  # the consumer may stop on a token
                on_error(error)
        except Exception:  # a bug in one response: that request fails, the reader goes on
            logger.exception("request %s: handing on an output failed", self.request_id)
            self.abort()
            with contextlib.suppress(Exception):
                on_error(EngineFailed("internal error while streaming the output"))
        if self._done:
            self._on_output = self._on_error = None  # the consumer holds this stream: no cycle

    def _hand_error(self, error: HTTPError, on_error: OnError) -> None:
        self._on_output = self._on_error = None
        try:
            on_error(error)
        except Exception:
            logger.exception("request %s: handing on its error failed", self.request_id)

    def _account(self, output: RequestOutput) -> None:
        used = len(output.new_token_ids)
        if self._first:
            used += self._prompt_tokens
            self._first = False
            self._release_mm()  # prefill is done: the engine holds no pixels of it (R3)
        used = min(used, self._budget)
        self._budget -= used
        self._engine.num_tokens -= used

    def _release_mm(self) -> None:
        if self._mm_reservation is not None:
            self._mm_reservation.release()
            self._mm_reservation = None

    def _end(self) -> None:
        if self._done:
            return
        self._done = True
        self._release_mm()
        engine = self._engine
        if engine.streams.get(self.request_id) is self:
            del engine.streams[self.request_id]
        engine.num_tokens -= self._budget
        self._budget = 0
        engine.on_request_end()

    def __del__(self) -> None:
        if not self._done:
            self._engine._forget(self.request_id, self._budget, self._mm_reservation)
