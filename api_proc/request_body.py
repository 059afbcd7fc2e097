"""Reading a request body: JSON only, refused at max_body_bytes, bounded in time and in the
number read at once, and admitted by bytes as it arrives when it is large (R4); the
pipeline takes the bytes out of the holder (R1)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request

from api_proc.admission import AdmissionController, Reservation
from api_proc.errors import OverBudget, PayloadTooLarge, RequestTimeout, UnsupportedMediaType


class ClientGone(Exception):
    """The HTTP client disconnected; nothing is sent back."""


async def wait_for_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Until the HTTP client disconnects (`receive`: the ASGI receive, body already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class RequestBody:
    """Holder of a request's raw bytes; the pipeline takes them out (R1). `reservation`:
    the admission bytes a large body holds until the pipeline exchanges them for its images'
    or, with no images, lets them go once parsed (R4)."""

    __slots__ = ("data", "reservation")

    def __init__(self, data: bytes, reservation: Reservation | None = None):
        self.data: bytes | None = data
        self.reservation = reservation

    def take(self) -> bytes:
        data, self.data = self.data, None
        if data is None:
            raise RuntimeError("request body already taken")
        return data

    def release(self) -> None:
        """Give back whatever the pipeline has not exchanged (idempotent)."""
        if self.reservation is not None:
            self.reservation.release()


def body_keys(data: bytes) -> frozenset[str]:
    """The top-level keys of a JSON object body (none when it is not one), for routes that
    take several request forms; the form's own parse reports what is wrong."""
    try:
        value = json.loads(data)
    except ValueError:
        return frozenset()
    return frozenset(value) if isinstance(value, dict) else frozenset()


# Bodies below this are read without admission: uvicorn buffers this much of every
# connection's body before the app reads it anyway.
BODY_ADMISSION_MIN_BYTES = 64 << 10
# While a body is parsed, its bytes and the strings parsed from them exist together.
BODY_COPIES = 2


def require_json(content_type: str | None) -> None:
    """415 unless the body is declared as JSON. A web page can send text/plain (or no type)
    to any server without a CORS preflight; only a page the CORS settings allow can send
    application/json, so a keyless local server runs nothing a foreign page asks for."""
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        shown = repr(content_type) if content_type else "none"
        raise UnsupportedMediaType(f"Content-Type must be application/json, got {shown}")


class BodyReader:
    """Reads request bodies within three bounds: at most `max_unread` bodies are being
    received at once (others wait for a turn, 429 after `timeout_s`); a body's bytes must
    all arrive within `timeout_s` of reading (waits for budget not counted; 408 past it);
    and a large body holds admission bytes for what has arrived, never for what its
    Content-Length declares, so a client that sends headers and no body holds nothing (R4).
    A body whose reservation cannot grow at once gives back what it holds and waits, holding
    nothing, for all it can need: one that waited holding its part would keep the bytes
    others need to finish (bodies, and the pixels of bodies already read) while they keep
    the bytes it needs, and at load they all stalled.
    """

    def __init__(self, limit: int, admission: AdmissionController, timeout_s: float,
                 max_unread: int):
        self.limit = limit
        self.admission = admission
        self.timeout_s = timeout_s
        self.max_unread = max_unread
        self._turns = asyncio.Semaphore(max_unread)
        self.num_unread = 0  # bodies being received now
        self.num_waiting = 0  # requests waiting for their turn

    async def read(self, request: Request) -> RequestBody:
        """The request body, refused with 415 unless it is declared as JSON and with 413 as
        soon as it passes `limit` bytes."""
        require_json(request.headers.get("content-type"))
        declared = request.headers.get("content-length")
        size_hint = int(declared) if declared is not None and declared.isdigit() else None
        if size_hint is not None and size_hint > self.limit:
            raise self._too_large()
        await self._take_turn()
        self.num_unread += 1
        try:
            return await self._receive(request.receive, size_hint)
        finally:
            self.num_unread -= 1
            self._turns.release()

    async def _take_turn(self) -> None:
        if not self._turns.locked():
            await self._turns.acquire()  # free: returns at once
            return
        self.num_waiting += 1
        try:
            await asyncio.wait_for(self._turns.acquire(), self.timeout_s)
        except asyncio.TimeoutError:
            raise OverBudget(f"{self.max_unread} request bodies are being received (the most "
                             f"max_unread_bodies allows) and none finished within "
                             f"{self.timeout_s:g} s; retry later",
                             code="too_many_unread_bodies") from None
        finally:
            self.num_waiting -= 1

    async def _receive(self, receive: Callable[[], Awaitable[dict]],
                       size_hint: int | None) -> RequestBody:
        budget = self.admission.budget_bytes
        cap = budget if size_hint is None else min(BODY_COPIES * size_hint, budget)
        left_s = self.timeout_s
        reservation = None
        chunks: list[bytes] = []
        size = 0
        more = True
        try:
            while more:
                started = time.monotonic()
                message = await self._next_message(receive, left_s)
                left_s -= time.monotonic() - started
                chunk, more = message.get("body", b""), message.get("more_body", False)
                size += len(chunk)
                if size > self.limit:
                    raise self._too_large()
                if chunk:
                    chunks.append(chunk)
                if size >= BODY_ADMISSION_MIN_BYTES:
                    reservation = await self._admit(reservation, size, cap)
        except BaseException:
            if reservation is not None:
                reservation.release()
            raise
        return RequestBody(chunks[0] if len(chunks) == 1 else b"".join(chunks), reservation)

    async def _next_message(self, receive: Callable[[], Awaitable[dict]], left_s: float) -> dict:
        try:
            message = await asyncio.wait_for(receive(), max(left_s, 0.0))
        except asyncio.TimeoutError:
            raise RequestTimeout(f"the request body did not arrive within "
                                 f"body_read_timeout_s={self.timeout_s:g}",
                                 code="body_timeout") from None
        if message["type"] == "http.disconnect":
            raise ClientGone()
        return message

    async def _admit(self, reservation: Reservation | None, size: int, cap: int) -> Reservation:
        """Hold BODY_COPIES x the bytes that have arrived, growing in doubling steps up to
        `cap`; until admitted the rest of the body stays in the socket buffers."""
        held = reservation.nbytes if reservation is not None else 0
        need = min(BODY_COPIES * size, self.admission.budget_bytes)
        if held >= need:
            return reservation
        more_bytes = max(need, min(2 * held, cap)) - held
        admission = self.admission
        if admission.can_admit(more_bytes):
            more = await admission.acquire(more_bytes)  # at once
            if reservation is None:
                return more
            reservation.absorb(more)
            return reservation
        # no hold-and-wait: give the held bytes back, wait for the most this body can need
        if reservation is not None:
            reservation.release()
        return await admission.acquire(max(need, cap))

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"request body is larger than max_body_bytes={self.limit}",
                               code="body_too_large")
