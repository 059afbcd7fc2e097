"""The request pipeline behind /v1/chat/completions and /v1/completions.

    read body -> validate -> fetch images + read headers -> template, tokenize, expand
    -> admit (bytes sized from headers) -> decode + resize (worker pool) -> submit to an
    engine -> DROP payload -> first output: release admission -> detokenize -> JSON or SSE

`prepare_*` does everything up to the handoff and returns a `Prepared`: ids, counters and
detokenizers only (R2). The payload lives only in prepare's frame and in the objects it
hands on with take() semantics, so when prepare returns, nothing in this process reaches the
body bytes, the base64 strings, the encoded bytes or the pixels (R1); the streaming phase
cannot pin them because it never sees them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pydantic
from starlette.requests import ClientDisconnect, Request

from api_proc.admission import AdmissionController, Reservation
from api_proc.config import ApiConfig
from api_proc.detokenizer import IncrementalDetokenizer
from api_proc.engine_client import EngineClient, RequestStream
from api_proc.errors import (
    APIError,
    BadRequestError,
    NotFoundError,
    PayloadTooLargeError,
    format_validation_errors,
)
from api_proc.media_loader import EncodedImage, MediaLoader, MediaRef
from api_proc.metrics import Metrics
from api_proc.prompt_builder import PromptBuilder, template_messages
from api_proc.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    ImageURLPart,
    UsageInfo,
)
from shared.messages import GenerateRequest, ImageInput
from shared.sampling_params import SamplingParams

DONE = b"data: [DONE]\n\n"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
OFFLOAD_TEXT_CHARS = 16_384  # longer prompts are templated and tokenized off the event loop


class ClientGone(Exception):
    """The HTTP client disconnected; nothing is sent back."""


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


@dataclass(eq=False)
class Choice:
    index: int
    stream: RequestStream
    detok: IncrementalDetokenizer
    num_tokens: int = 0
    finish_reason: str | None = None
    texts: list[str] = field(default_factory=list)  # non-streaming responses only


@dataclass(eq=False)
class Prepared:
    """Everything a response needs after the handoff: ids, counters, detokenizers (R2)."""

    kind: str  # "chat" | "completion"
    id: str
    created: int
    model: str
    stream: bool
    include_usage: bool
    num_prompt_tokens: int
    choices: list[Choice]
    arrival: float
    first_token_at: float | None = None

    @property
    def usage(self) -> UsageInfo:
        completion = sum(c.num_tokens for c in self.choices)
        return UsageInfo(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
                         total_tokens=self.num_prompt_tokens + completion)


# Bodies below this are read without admission: uvicorn buffers this much of every
# connection's body before the app reads it anyway.
BODY_ADMISSION_MIN_BYTES = 64 << 10
# While a body is parsed, its bytes and the strings parsed from them exist together.
BODY_COPIES = 2


async def read_body(request: Request, limit: int, admission: AdmissionController
                    ) -> RequestBody:
    """The request body, refused with 413 as soon as it passes `limit` bytes. A large body
    is admitted before it is read (R4): its declared length up front, an undeclared one in
    doubling steps as it arrives. Until admitted, its bytes stay in the socket buffers."""
    declared = request.headers.get("content-length")
    size_hint = int(declared) if declared is not None and declared.isdigit() else None
    if size_hint is not None and size_hint > limit:
        raise PayloadTooLargeError(f"request body is larger than max_body_bytes={limit}",
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
                raise PayloadTooLargeError(f"request body is larger than max_body_bytes={limit}",
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


def _parse(model: type[pydantic.BaseModel], body: bytes):
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as e:
        message = format_validation_errors(e.errors(include_input=False, include_url=False))
    raise BadRequestError(message)  # outside the except: no traceback pins the body (R1)


async def _settle(coros) -> list:
    """Run coroutines concurrently and let every one finish before the first error is raised:
    worker-pool jobs cannot be interrupted, and their memory counts until they end."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is not None:
        results = None  # R1: the traceback keeps this frame; not the other images' pixels
        raise error
    return results


class Serving:
    def __init__(self, config: ApiConfig, builder: PromptBuilder, loader: MediaLoader,
                 admission: AdmissionController, engines: EngineClient, metrics: Metrics):
        self.config = config
        self.builder = builder
        self.loader = loader
        self.admission = admission
        self.engines = engines
        self.metrics = metrics

    # ------------------------------------------------------------------ preparing

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise NotFoundError(f"model {name!r} does not exist; this server serves "
                                f"{self.config.served_model_name!r}", param="model",
                                code="model_not_found")

    def _sampling(self, req, max_tokens: int, choice: int) -> SamplingParams:
        seed = None if req.seed is None else (req.seed + choice) % 2**63
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k in (None, -1) else req.top_k,
                seed=seed,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
            )
        except ValueError as e:
            message = str(e)
        raise BadRequestError(message)

    def _check_n(self, n: int) -> None:
        if n > self.config.max_n:
            raise BadRequestError(f"n is {n}; at most max_n={self.config.max_n}", param="n")

    async def prepare_chat(self, body: RequestBody, arrival: float) -> Prepared:
        req = _parse(ChatCompletionRequest, body.take())
        self._check_model(req.model)
        self._check_n(req.n)
        refs = [MediaRef(part.image_url.url) for m in req.messages if isinstance(m.content, list)
                for part in m.content if isinstance(part, ImageURLPart)]
        if len(refs) > self.config.limit_mm_per_prompt:
            raise BadRequestError(f"the request has {len(refs)} images; at most "
                                  f"limit_mm_per_prompt={self.config.limit_mm_per_prompt}",
                                  param="messages", code="too_many_images")
        messages = template_messages(req.messages)
        requested = req.requested_max_tokens
        settings = _RequestSettings.of(req)
        req = None  # R1: the model held the base64 strings; only the MediaRefs do now
        if not refs:
            body.release()  # parsed: no image will need the body's bytes

        encoded = await _settle([self.loader.fetch(ref) for ref in refs])
        refs = None
        grids = [e.grid_thw for e in encoded]
        if sum(len(str(m["content"])) for m in messages) > OFFLOAD_TEXT_CHARS:
            prompt_ids = await asyncio.to_thread(self.builder.build_chat, messages, grids)
        else:
            prompt_ids = self.builder.build_chat(messages, grids)
        max_tokens = self.builder.resolve_max_tokens(len(prompt_ids), requested)
        sampling = [self._sampling(settings, max_tokens, i) for i in range(settings.n)]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._hand_off(rid, [prompt_ids] * settings.n, sampling, encoded,
                                       body.reservation)
        encoded = None
        return self._prepared("chat", rid, arrival, settings, len(prompt_ids), streams)

    async def prepare_completion(self, body: RequestBody, arrival: float) -> Prepared:
        req = _parse(CompletionRequest, body.take())
        body.release()  # parsed: the prompts are all that is left of the body
        self._check_model(req.model)
        self._check_n(req.n)
        prompts = req.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if len(prompts) * req.n > self.config.max_n:
            raise BadRequestError(f"{len(prompts)} prompts x n={req.n} choices is more than "
                                  f"max_n={self.config.max_n}", param="prompt")
        requested = req.requested_max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
        settings = _RequestSettings.of(req)
        req = None
        ids_per_prompt = [self.builder.build_completion(p) for p in prompts]
        for ids in ids_per_prompt:
            if not ids:
                raise BadRequestError("prompt is empty", param="prompt")
            self.builder.resolve_max_tokens(len(ids), requested)
        prompt_ids, sampling = [], []
        for ids in ids_per_prompt:
            for i in range(settings.n):
                prompt_ids.append(ids)
                sampling.append(self._sampling(settings, requested, i))
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._hand_off(rid, prompt_ids, sampling, [])
        return self._prepared("completion", rid, arrival, settings,
                              sum(len(ids) for ids in ids_per_prompt), streams)

    def _prepared(self, kind, rid, arrival, settings, num_prompt_tokens, streams) -> Prepared:
        choices = [Choice(i, s, IncrementalDetokenizer(self.builder.decoder, settings.stop))
                   for i, s in enumerate(streams)]
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        return Prepared(kind=kind, id=rid, created=int(time.time()),
                        model=self.config.served_model_name, stream=settings.stream,
                        include_usage=settings.include_usage,
                        num_prompt_tokens=num_prompt_tokens, choices=choices, arrival=arrival)

    async def _hand_off(self, rid: str, prompt_ids: list[list[int]],
                        sampling: list[SamplingParams], encoded: list[EncodedImage],
                        held: Reservation | None = None) -> list[RequestStream]:
        """Admit, decode, submit one engine request per choice. Every choice shares the same
        ImageInput objects: the pixels exist once in this process whatever n is. Each engine
        request takes its share of the reservation (its pixels' bytes) and gives it back at
        its first output, when the engine has freed them (R3, R4).
        `held`: the body's reservation, exchanged for the images' (emptied by the exchange;
        the caller releases it on every other path)."""
        self.engines.pick()  # 503 now, before any pixel is decoded, when no engine is up
        reservation = None
        per_request = sum(e.resized_bytes for e in encoded)  # what each engine request holds
        if encoded:
            # every choice after the first sends its own copy of the pixels to an engine
            need = sum(e.need_bytes for e in encoded) + (len(prompt_ids) - 1) * per_request
            if held is not None and held.nbytes:
                reservation = await self.admission.exchange(held, need)
            else:
                reservation = await self.admission.acquire(need)
        held = None
        try:
            images = await self._decode(encoded, reservation) if encoded else []
            encoded = None
            streams: list[RequestStream] = []
            try:
                for i, (ids, params) in enumerate(zip(prompt_ids, sampling, strict=True)):
                    share = reservation.split(per_request) if reservation is not None else None
                    streams.append(self.engines.submit(GenerateRequest(
                        request_id=f"{rid}-{i}", prompt_token_ids=ids, sampling=params,
                        images=images), mm_reservation=share))
            except BaseException:
                for s in streams:
                    await s.aclose()
                raise
            images = None  # R1: the rpc streams own the pixels now
            return streams
        finally:
            if reservation is not None:
                reservation.release()

    async def _decode(self, encoded: list[EncodedImage], reservation: Reservation
                      ) -> list[ImageInput]:
        async def one(image: EncodedImage) -> ImageInput:
            result = await self.loader.decode(image)
            reservation.release(image.need_bytes - image.resized_bytes)  # decoding is over
            return result

        work = asyncio.ensure_future(_settle([one(e) for e in encoded]))
        encoded = None
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            # pool threads cannot be interrupted: the budget stays held until they end
            left = reservation.transfer()
            work.add_done_callback(lambda f: (_retrieve(f), left.release()))
            raise

    # ------------------------------------------------------------------ outputs

    async def _outputs(self, p: Prepared) -> AsyncIterator[tuple[Choice, object]]:
        if len(p.choices) == 1:
            c = p.choices[0]
            async for out in c.stream:
                yield c, out
            return
        pending = {asyncio.ensure_future(c.stream.__anext__()): c for c in p.choices}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    c = pending.pop(fut)
                    try:
                        out = fut.result()
                    except StopAsyncIteration:
                        continue
                    yield c, out
                    if not c.stream.finished:
                        pending[asyncio.ensure_future(c.stream.__anext__())] = c
        finally:
            for fut in pending:
                fut.cancel()
                fut.add_done_callback(_retrieve)

    async def _advance(self, p: Prepared, c: Choice, out) -> tuple[str, str | None]:
        """New text and finish reason of choice `c` after engine output `out`."""
        ids = out.new_token_ids
        if ids:
            c.num_tokens += len(ids)
            self.metrics.completion_tokens.inc(len(ids))
            if p.first_token_at is None:
                p.first_token_at = time.monotonic()
                self.metrics.ttft.observe(p.first_token_at - p.arrival)
        text = c.detok.step(ids)
        finish = out.finish_reason
        if c.detok.stopped:
            finish = "stop"
            await c.stream.aclose()  # stop string: the engine stops too
        elif finish is not None:
            text += c.detok.finish()
        c.finish_reason = finish
        return text, finish

    async def close(self, p: Prepared) -> None:
        for c in p.choices:
            await c.stream.aclose()

    async def collect(self, p: Prepared) -> dict:
        """Run a non-streaming request to the end; the OpenAI response body."""
        outputs = self._outputs(p)
        try:
            async for c, out in outputs:
                text, _ = await self._advance(p, c, out)
                if text:
                    c.texts.append(text)
        finally:
            await outputs.aclose()
            await self.close(p)
        if p.kind == "chat":
            return ChatCompletionResponse(
                id=p.id, created=p.created, model=p.model, usage=p.usage,
                choices=[ChatCompletionChoice(index=c.index, finish_reason=c.finish_reason,
                                              message=ChatCompletionMessage(content="".join(c.texts)))
                         for c in p.choices]).model_dump()
        return CompletionResponse(
            id=p.id, created=p.created, model=p.model, usage=p.usage,
            choices=[CompletionChoice(index=c.index, text="".join(c.texts),
                                      finish_reason=c.finish_reason) for c in p.choices]
        ).model_dump()

    async def stream(self, p: Prepared, on_end) -> AsyncIterator[bytes]:
        """SSE chunks of a streaming request, ending with `data: [DONE]`; on_end(status)."""
        status = 200
        outputs = self._outputs(p)
        try:
            if p.kind == "chat":
                for c in p.choices:
                    yield self._chunk(p, c.index, None, None)
            async for c, out in outputs:
                text, finish = await self._advance(p, c, out)
                if text or finish:
                    yield self._chunk(p, c.index, text, finish)
            if p.include_usage:
                cls = ChatCompletionChunk if p.kind == "chat" else CompletionChunk
                body = cls(id=p.id, created=p.created, model=p.model, choices=[], usage=p.usage)
                yield _sse(body.model_dump_json())
            yield DONE
        except APIError as e:
            status = e.status
            yield _sse(json.dumps(e.to_dict()))
            yield DONE
        except BaseException:
            status = 499  # client gone (cancelled) or a bug
            raise
        finally:
            await outputs.aclose()
            await self.close(p)
            on_end(status)

    def _chunk(self, p: Prepared, index: int, text: str | None, finish: str | None) -> bytes:
        """One SSE chunk (built as a dict: exactly OpenAI's field set, nulls included).
        For chat, text=None is the opening chunk that carries the role."""
        if p.kind == "chat":
            delta = {"role": "assistant", "content": ""} if text is None else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return _sse(json.dumps({"id": p.id, "object": obj, "created": p.created,
                                "model": p.model, "choices": [choice]}, ensure_ascii=False))


def _retrieve(fut: asyncio.Future) -> None:
    """Mark a future's exception as seen (its request is gone; the error is moot)."""
    if not fut.cancelled():
        fut.exception()


def _sse(payload: str) -> bytes:
    return b"data: " + payload.encode() + b"\n\n"


@dataclass(frozen=True)
class _RequestSettings:
    """The small, payload-free part of a request kept after its body model is dropped."""

    n: int
    stream: bool
    include_usage: bool
    stop: list[str] | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop_token_ids: list[int] | None
    ignore_eos: bool

    @classmethod
    def of(cls, req) -> _RequestSettings:
        return cls(n=req.n, stream=req.stream, include_usage=req.include_usage, stop=req.stop,
                   temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                   stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos)
