"""The API process's view of the engines: one RpcClient each, least-loaded routing.

    stream = engine_client.submit(request)   # takes ownership of the request (R1)
    request = None
    async for output in stream: ...          # RequestOutput items; aclose() aborts

or, as one async generator, `async for output in engine_client.generate(request)`.

R1: `submit` hands the request to `RpcClient.stream(...)` and keeps only its id and token
counts; the rpc stream drops its own reference once the envelope is posted, and zmq drops
the pixel frames once they are sent. No frame, closure or exception here holds the request
after that, and errors raised here are rebuilt from text, never chained to a payload.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from api_proc.admission import Reservation
from api_proc.errors import (
    APIError,
    BadRequestError,
    EngineError,
    EngineUnavailableError,
)
from rpc import Codec, DeadlineExceeded, RemoteError, RpcClient, RpcError, ServerUnavailable
from shared.messages import WIRE_TYPES, EngineStats, GenerateRequest, RequestOutput

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class EngineHandle:
    """One engine and the work this API process has routed to it."""

    address: str
    rpc: Any  # RpcClient (or anything with call / stream / available / close)
    process: Any = None  # the engine's Popen when this process launched it
    num_requests: int = 0
    num_tokens: int = 0  # prompt tokens not yet prefilled + completion tokens not yet made
    last_error: str | None = None
    aborts: set = field(default_factory=set)

    def death_reason(self) -> str | None:
        """Why this engine cannot serve, or None while it can (as far as we know)."""
        if self.process is not None and self.process.poll() is not None:
            return f"engine process exited with code {self.process.returncode}"
        if not getattr(self.rpc, "available", True) and self.last_error:
            return self.last_error
        return None


class EngineClient:
    def __init__(self, engines: Sequence[EngineHandle], call_timeout_s: float = 5.0):
        self.engines = list(engines)
        self.call_timeout_s = call_timeout_s
        self._rr = itertools.count()
        self._background: set[asyncio.Task] = set()

    @classmethod
    def connect(cls, addresses: Sequence[str], processes: Sequence[Any] | None = None,
                call_timeout_s: float = 5.0, **rpc_kwargs) -> EngineClient:
        codec = Codec(types=WIRE_TYPES)
        procs = list(processes or [])
        engines = [EngineHandle(a, RpcClient(a, codec, **rpc_kwargs),
                                procs[i] if i < len(procs) else None)
                   for i, a in enumerate(addresses)]
        return cls(engines, call_timeout_s)

    async def start(self, timeout_s: float = 10.0) -> None:
        """Attach every RpcClient to this loop and wait (bounded) until each answers."""
        async def ready(engine: EngineHandle) -> None:
            try:
                await engine.rpc.wait_ready(timeout_s)
            except RpcError as e:
                engine.last_error = f"not reachable at start: {e}"
                logger.warning("engine %s %s", engine.address, engine.last_error)
        await asyncio.gather(*(ready(e) for e in self.engines))

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*(e.rpc.close() for e in self.engines), return_exceptions=True)

    # -- routing

    @property
    def num_in_flight(self) -> int:
        return sum(e.num_requests for e in self.engines)

    def pick(self) -> EngineHandle:
        """The usable engine with the least outstanding work (tokens, then requests)."""
        if not self.engines:
            raise EngineUnavailableError("no engine is configured")
        rr = next(self._rr)
        n = len(self.engines)
        usable = [(e.num_tokens, e.num_requests, (i - rr) % n, e)
                  for i, e in enumerate(self.engines)
                  if e.death_reason() is None and getattr(e.rpc, "available", True)]
        if not usable:
            reasons = "; ".join(f"{e.address}: {e.death_reason() or 'not answering'}"
                                for e in self.engines)
            raise EngineUnavailableError(f"no engine is available ({reasons})")
        return min(usable, key=lambda t: t[:3])[3]

    # -- requests

    def submit(self, request: GenerateRequest, mm_reservation: Reservation | None = None
               ) -> RequestStream:
        """Start `request` on the least-loaded engine. Takes ownership: the caller drops its
        references; only the rpc layer holds the payload from here until it is sent (R1).
        `mm_reservation` (the admission bytes of the request's pixels) is released when the
        first output arrives, i.e. once the engine has freed the pixels (R3), or when the
        stream ends before that."""
        request_id = request.request_id
        prompt_tokens = len(request.prompt_token_ids)
        max_tokens = request.sampling.max_tokens
        try:
            engine = self.pick()
            rpc_stream = engine.rpc.stream("generate", request)
        except BaseException:
            if mm_reservation is not None:
                mm_reservation.release()  # owned from the call on, like the request
            raise
        request = None  # noqa: F841 (R1: the rpc stream owns it now)
        return RequestStream(self, engine, request_id, rpc_stream, prompt_tokens, max_tokens,
                             mm_reservation)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        stream = self.submit(request)
        request = None  # noqa: F841 (R1)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    async def abort(self, engine: EngineHandle, request_id: str) -> None:
        try:
            await engine.rpc.call("abort", request_id, timeout=self.call_timeout_s)
        except (RpcError, OSError) as e:
            logger.debug("abort of %s on %s failed: %s", request_id, engine.address, e)

    def abort_soon(self, engine: EngineHandle, request_id: str) -> None:
        """Fire-and-forget abort: safe from finally blocks and cancelled tasks."""
        try:
            task = asyncio.get_running_loop().create_task(self.abort(engine, request_id))
        except RuntimeError:  # no running loop (interpreter shutdown)
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- status

    async def health(self) -> list[dict]:
        """One entry per engine: {"address", "ok", "reason", "num_requests"}."""
        async def check(engine: EngineHandle) -> dict:
            reason = engine.death_reason()
            if reason is None:
                try:
                    await engine.rpc.call("health", timeout=self.call_timeout_s)
                    engine.last_error = None
                except (RpcError, OSError) as e:
                    reason = f"{type(e).__name__}: {e}"
            return {"address": engine.address, "ok": reason is None, "reason": reason,
                    "num_requests": engine.num_requests}
        return list(await asyncio.gather(*(check(e) for e in self.engines)))

    async def stats(self) -> list[EngineStats | None]:
        async def one(engine: EngineHandle) -> EngineStats | None:
            try:
                return await engine.rpc.call("stats", timeout=self.call_timeout_s)
            except (RpcError, OSError):
                return None
        return list(await asyncio.gather(*(one(e) for e in self.engines)))


def _engine_error(engine: EngineHandle, exc: BaseException) -> APIError:
    """Map an rpc failure to the API error a client should see (built from text only)."""
    if isinstance(exc, ServerUnavailable):
        engine.last_error = str(exc)
        return EngineUnavailableError(f"engine unavailable: {exc}")
    if isinstance(exc, DeadlineExceeded):
        return EngineError(f"engine did not answer in time: {exc}", code="engine_timeout")
    if isinstance(exc, RemoteError):
        message = exc.message or exc.type_name
        if "queue is full" in message:
            return EngineUnavailableError(f"engine busy: {message}", code="engine_busy")
        if "RequestRejected" in message or exc.type_name in ("RequestRejected", "ValueError"):
            return BadRequestError(f"engine refused the request: {message}",
                                   code="engine_rejected")
        return EngineError(f"engine error: {exc.type_name}: {message}")
    return EngineError(f"engine error: {type(exc).__name__}: {exc}")


class RequestStream:
    """One request's outputs from its engine; keeps only ids and counters (R2)."""

    __slots__ = ("request_id", "_client", "_engine", "_rpc_stream", "_prompt_tokens",
                 "_budget", "_first", "_done", "_mm_reservation", "__weakref__")

    def __init__(self, client: EngineClient, engine: EngineHandle, request_id: str,
                 rpc_stream: Any, prompt_tokens: int, max_tokens: int,
                 mm_reservation: Reservation | None = None):
        self.request_id = request_id
        self._mm_reservation = mm_reservation
        self._client = client
        self._engine = engine
        self._rpc_stream = rpc_stream
        self._prompt_tokens = prompt_tokens
        self._budget = prompt_tokens + max_tokens  # this request's share of engine.num_tokens
        self._first = True
        self._done = False
        engine.num_requests += 1
        engine.num_tokens += self._budget

    @property
    def engine(self) -> EngineHandle:
        return self._engine

    @property
    def finished(self) -> bool:
        return self._done

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        error: APIError | None = None
        try:
            output = await self._rpc_stream.__anext__()
        except StopAsyncIteration:
            error = EngineError("the engine ended the stream without a finish reason")
        except (RpcError, OSError) as e:
            error = _engine_error(self._engine, e)
        if error is not None:  # raised outside the except: no chained rpc exception
            if self._done:  # closed by aclose() while this call waited
                raise StopAsyncIteration
            self._finish()
            raise error
        self._account(output)
        if output.finish_reason == "error":
            self._finish()
            raise EngineError(f"engine error: {output.error or 'unknown'}")
        if output.finish_reason is not None:
            self._finish()
        return output

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

    def _finish(self) -> None:
        self._release_mm()
        if self._done:
            return
        self._done = True
        self._engine.num_requests -= 1
        self._engine.num_tokens -= self._budget
        self._budget = 0

    async def aclose(self) -> None:
        """Stop early: cancel the rpc stream and abort the request in the engine."""
        if self._done:
            return
        self._finish()
        try:
            await self._rpc_stream.aclose()
        finally:
            self._client.abort_soon(self._engine, self.request_id)

    def __del__(self) -> None:
        # Safety net for a stream dropped unconsumed (e.g. the client left before the
        # response body started): settle the counters; the rpc stream's own finalizer
        # cancels a started call, and the abort covers the rest.
        if not self._done:
            self._finish()
            self._client.abort_soon(self._engine, self.request_id)
