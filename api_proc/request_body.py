"""Reading a request body: refused at max_body_bytes, and admitted by bytes before it is
read when it is large (R4); the pipeline takes the bytes out of the holder (R1)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import ClientDisconnect, Request

from api_proc.admission import AdmissionController, Reservation
from api_proc.errors import PayloadTooLarge, UnsupportedMediaType


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


async def read_body(request: Request, limit: int, admission: AdmissionController
                    ) -> RequestBody:
    """The request body, refused with 415 unless it is declared as JSON and with 413 as soon
    as it passes `limit` bytes. A large body is admitted before it is read (R4): its
    declared length up front, an undeclared one in doubling steps as it arrives. Until
    admitted, its bytes stay in the socket buffers."""
    require_json(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    size_hint = int(declared) if declared is not None and declared.isdigit() else None
    if size_hint is not None and size_hint > limit:
        raise PayloadTooLarge(f"request body is larger than max_body_bytes={limit}",
                                   code="body_too_large")
    budget = admission.budget_bytes
    reservation = None
    if size_hint is not None and size_hint >= BODY_ADMISSION_MIN_BYTES:
        reservation = await admission.acquire(min(BODY_COPIES * size_hint, budget))
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body is larger than max_body_bytes={limit}",
                                           code="body_too_large")
            chunks.append(chunk)
            if size_hint is None and size >= BODY_ADMISSION_MIN_BYTES:
                held = reservation.nbytes if reservation is not None else 0
                if held < min(BODY_COPIES * size, budget):
                    more = await admission.acquire(min(max(2 * held, BODY_COPIES * size),
                                                       budget) - held)
                    if reservation is None:
                        reservation = more
                    else:
                        reservation.absorb(more)
    except BaseException as e:
        if reservation is not None:
            reservation.release()
        if isinstance(e, ClientDisconnect):
            raise ClientGone() from None
        raise
    return RequestBody(chunks[0] if len(chunks) == 1 else b"".join(chunks), reservation)
