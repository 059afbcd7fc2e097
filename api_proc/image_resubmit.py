"""Requests sent with some images' pixels left out, and their one resubmission with pixels.

The pipeline leaves out the pixels of an image when the chosen engine's encoder cache holds
its key (EngineConnection.holds_image): neither the decode nor the transfer is needed. That
mirror lags the engine, so the engine may have evicted the key by the time the request
arrives. It then refuses the request with ErrorCode.IMAGE_MISSING before producing any
output, and `ResubmittingStream` decodes the images from their encoded bytes and sends the
request again, once, with every image's pixels; the client never sees the refusal. The
engine checks the key when it adds the request and from then on the request holds its own
reference to the embeddings, so no eviction can change an answer: a request either runs on
the embeddings of exactly its key or is refused and resent.

R1/R4: to resend, the encoded bytes must still exist. `KeptImages` keeps them, counted in
the admission budget, until every choice sent without pixels has its first output (the
point where the engine is past its images, where the pixel reservation is given back too)
or has ended; then the bytes are dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable

from api_proc.admission import Reservation
from api_proc.engine_client import EngineConnection, OnError, OnOutput, RequestStream
from api_proc.errors import EngineFailed, HTTPError
from api_proc.media_loader import EncodedImage
from shared.messages import RequestOutput

logger = logging.getLogger(__name__)

IMAGE_MISSING = "image_missing"  # the HTTPError code engine_client.py gives that ErrorCode


class KeptImages:
    """The encoded bytes of one request's images, shared by its choices that were sent
    without some pixels, with their admission bytes; dropped when the last one lets go."""

    __slots__ = ("_encoded", "_reservation", "_users", "_loop", "__weakref__")

    def __init__(self, encoded: list[EncodedImage], reservation: Reservation) -> None:
        self._encoded = encoded
        self._reservation = reservation
        self._users = 0
        self._loop = asyncio.get_running_loop()

    def hold(self) -> None:
        self._users += 1

    def copies(self) -> list[EncodedImage]:
        """Fresh holders of the same bytes: decoding one takes only its own (R1)."""
        return [dataclasses.replace(e) for e in self._encoded]

    def release(self) -> None:
        self._users -= 1
        if self._users <= 0:
            self._encoded = []
            self._reservation.release()

    def release_soon(self) -> None:
        """release() from a finalizer, which may run in any thread."""
        try:
            self._loop.call_soon_threadsafe(self.release)
        except RuntimeError:  # the loop is closed: nothing waits for these bytes any more
            pass


Resubmit = Callable[[list[EncodedImage]], Awaitable[RequestStream]]


class ResubmittingStream:
    """A RequestStream whose request left out some pixels: on IMAGE_MISSING it resubmits
    the request with pixels (once) and goes on delivering from the new stream."""

    __slots__ = ("_stream", "_kept", "_resubmit", "_on_output", "_on_error", "_again",
                 "__weakref__")

    def __init__(self, stream: RequestStream, kept: KeptImages, resubmit: Resubmit) -> None:
        self._stream = stream
        self._kept: KeptImages | None = kept
        self._resubmit: Resubmit | None = resubmit
        self._on_output: OnOutput | None = None
        self._on_error: OnError | None = None
        self._again: asyncio.Task | None = None
        kept.hold()

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    @property
    def engine(self) -> EngineConnection:
        return self._stream.engine

    def deliver(self, on_output: OnOutput, on_error: OnError) -> None:
        """As RequestStream.deliver; an IMAGE_MISSING refusal is resubmitted, not handed on."""
        self._on_output, self._on_error = on_output, on_error
        self._stream.deliver(self._output, self._error)

    def pause(self) -> None:
        self._stream.pause()

    def abort(self) -> None:
        self._let_go()
        if self._again is not None:
            self._again.cancel()
        self._stream.abort()
        self._on_output = self._on_error = None

    async def aclose(self) -> None:
        self.abort()

    def _output(self, output: RequestOutput) -> None:
        self._let_go()  # the engine is past the images: their bytes can go (R1)
        if self._on_output is not None:
            self._on_output(output)

    def _error(self, error: HTTPError) -> None:
        if self._kept is None or error.code != IMAGE_MISSING:
            self._let_go()
            if self._on_error is not None:
                self._on_error(error)
            return
        encoded, resubmit = self._kept.copies(), self._resubmit
        self._let_go()
        self._again = asyncio.ensure_future(self._send_again(resubmit, encoded))

    async def _send_again(self, resubmit: Resubmit, encoded: list[EncodedImage]) -> None:
        try:
            self._stream = await resubmit(encoded)
        except Exception as error:
            if not isinstance(error, HTTPError):
                logger.exception("request %s: resending it with pixels failed", self.request_id)
                error = EngineFailed("internal error while resending the request's images")
            error = error.with_traceback(None)  # its frames may hold the images (R1)
            if self._on_error is not None:
                self._on_error(error)
            return
        finally:
            encoded = resubmit = None  # R1: the new request holds its pixels now
            self._again = None
        if self._on_output is None:  # aborted meanwhile
            self._stream.abort()
        else:
            self._stream.deliver(self._on_output, self._on_error)

    def _let_go(self) -> None:
        kept, self._kept, self._resubmit = self._kept, None, None
        if kept is not None:
            kept.release()

    def __del__(self) -> None:
        if self._kept is not None:
            self._kept.release_soon()
