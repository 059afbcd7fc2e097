"""The request pipeline behind /v1/chat/completions and /v1/completions.

    read body -> validate -> fetch images + read headers -> template, tokenize, expand
    -> admit (bytes sized from headers) -> decode + resize (worker pool) -> submit to an
    engine -> DROP payload -> first output: release admission -> detokenize -> JSON or SSE

An image whose key the chosen engine's encoder cache holds is neither decoded nor sent
(its pixels are left out; image_resubmit.py covers the engine having evicted it meanwhile).

`prepare_*` does everything up to the handoff and returns a `Prepared`: ids, counters and
detokenizers only (R2). The payload lives only in prepare's frame and in the objects it
hands on with take() semantics, so when prepare returns, nothing in this process reaches the
body bytes, the base64 strings, the encoded bytes or the pixels (R1); the streaming phase
cannot pin them because it never sees them. The body is read by request_body.py, and the
outputs become a response in responses.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import pydantic

from api_proc.admission import AdmissionController, Reservation
from api_proc.chat_output import ChatOutputParser
from api_proc.config import ApiConfig, check_media_io_kwargs
from api_proc.detokenizer import IncrementalDetokenizer
from api_proc.engine_client import EngineClient, RequestStream
from api_proc.errors import (
    BadRequest,
    NotFound,
    format_validation_errors,
)
from api_proc.image_resubmit import KeptImages, ResubmittingStream
from api_proc.media_loader import EncodedImage, MediaLoader, MediaRef
from api_proc.metrics import Metrics
from api_proc.prompt_builder import LONG_TEXT_CHARS, PromptBuilder, template_messages, text_chars
from api_proc.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ImageURLPart,
    UsageInfo,
    VideoURLPart,
)
from api_proc.reasoning_parser import ReasoningParser, start_mode
from api_proc.request_body import RequestBody
from api_proc.tool_grammar import tool_call_constraint
from api_proc.tool_parser import ToolCallParser, read_hermes_call
from api_proc.video_loader import EncodedVideo, VideoLoader, VideoSampling
from api_proc.xml_tool_call import XmlCallReader, parameter_types
from shared.messages import AddRequest, ImageInput
from shared.model_config import load_model_config
from shared.sampling_params import SamplingParams
from shared.video_layout import VideoSettings

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(eq=False)
class Choice:
    index: int
    stream: RequestStream
    detok: IncrementalDetokenizer
    num_tokens: int = 0
    finish_reason: str | None = None
    texts: list[str] = field(default_factory=list)  # non-streaming responses only
    logprobs: list | None = None  # non-streaming: chat entries or completion parts so far
    echo: str = ""  # completions with echo: the prompt's text, sent before the completion
    first_token_at: float | None = None  # time.monotonic(), for the latency metrics
    last_token_at: float | None = None
    num_chars: int = 0  # of the completion so far (completion logprobs' text_offset)
    output: ChatOutputParser | None = None  # chat: reads reasoning and tool calls out


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
    reasoning: bool = False  # a reasoning parser reads the choices (messages carry its fields)

    @property
    def usage(self) -> UsageInfo:
        completion = sum(c.num_tokens for c in self.choices)
        return UsageInfo(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
                         total_tokens=self.num_prompt_tokens + completion)


def _parse(model: type[pydantic.BaseModel], body: bytes):
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as e:
        errors = e.errors(include_input=False, include_url=False)
        message = format_validation_errors(errors)
        loc = errors[0].get("loc") if errors else None
        param = str(loc[0]) if loc else None
    raise BadRequest(message, param=param)  # outside the except: no traceback pins the body (R1)


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
        self.defaults = config.default_sampling()  # --generation-config
        settings = VideoSettings.of(load_model_config(config.model), loader.image_config)
        self.videos = VideoLoader(loader, settings)

    # ------------------------------------------------------------------ preparing

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.config.served_model_name:
            raise NotFound(f"model {name!r} does not exist; this server serves "
                                f"{self.config.model_name!r}", param="model",
                                code="model_not_found")

    def _sampling(self, req, max_tokens: int, choice: int) -> SamplingParams:
        seed = None if req.seed is None else (req.seed + choice) % 2**63
        if req.logprobs is not None and req.logprobs > self.config.max_logprobs:
            field = req.logprobs_field
            raise BadRequest(f"{field}: {req.logprobs} log-probabilities per token asked; at "
                             f"most max_logprobs={self.config.max_logprobs}", param=field)
        defaults = self.defaults
        top_k = defaults.get("top_k", 0) if req.top_k is None else req.top_k
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=defaults.get("temperature", 1.0) if req.temperature is None
                else req.temperature,
                top_p=defaults.get("top_p", 1.0) if req.top_p is None else req.top_p,
                top_k=0 if top_k == -1 else top_k,
                seed=seed,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=req.repetition_penalty or defaults.get("repetition_penalty", 1.0),
                min_tokens=req.min_tokens or 0,
                logit_bias=tuple((int(t), b) for t, b in (req.logit_bias or {}).items()),
                logprobs=req.logprobs,
                structured=req.structured,
            )
        except ValueError as e:
            message = str(e)
        raise BadRequest(message)

    def _tool_settings(self, req: ChatCompletionRequest, settings: _RequestSettings
                       ) -> _RequestSettings:
        """Settings with the tool choice's constraint and whether calls are read out."""
        mode = req.tool_choice_mode
        if mode == "none":
            return settings
        if mode == "auto" and not self.config.enable_auto_tool_choice:
            raise BadRequest('"auto" tool choice requires --enable-auto-tool-choice and '
                             "--tool-call-parser to be set", param="tool_choice")
        named = req.tool_choice.function.name if mode == "named" else None
        parallel = req.parallel_tool_calls is not False
        structured = tool_call_constraint(req.tools, mode, named, parallel,
                                          self.config.tool_call_parser or "hermes")
        if structured is None:
            return dataclasses.replace(settings, parse_tool_calls=True,
                                       parallel_tool_calls=parallel)
        # auto: text is free until a call starts; required, named: a call from the start
        return dataclasses.replace(settings, structured=structured, parse_tool_calls=True,
                                   parallel_tool_calls=parallel, constrained=mode != "auto")

    def _output_parsers(self, settings: _RequestSettings, tools: list[dict] | None,
                        start: str | None) -> Callable[[], ChatOutputParser] | None:
        """What makes each choice's reader of reasoning and tool calls (None: its text is
        read as it is); `start`: where the reasoning parser starts (reasoning_parser.py)."""
        reasoning = self.config.reasoning_parser
        if reasoning is None and not settings.parse_tool_calls:
            return None
        read_call = read_hermes_call
        if settings.parse_tool_calls and self.config.tool_call_parser == "qwen3_coder":
            read_call = XmlCallReader(parameter_types(tools or []))
        parallel = settings.parallel_tool_calls

        def make() -> ChatOutputParser:
            return ChatOutputParser(
                None if reasoning is None else ReasoningParser.create(reasoning, start),
                ToolCallParser(parallel, read_call) if settings.parse_tool_calls else None)
        return make

    def _check_n(self, n: int) -> None:
        if n > self.config.max_n:
            raise BadRequest(f"n is {n}; at most max_n={self.config.max_n}", param="n")

    async def prepare_chat(self, body: RequestBody, arrival: float) -> Prepared:
        req = _parse(ChatCompletionRequest, body.take())
        self._check_model(req.model)
        self._check_n(req.n)
        refs = [MediaRef(part.image_url.url) if isinstance(part, ImageURLPart)
                else MediaRef(part.video_url.url, "video")
                for m in req.messages if isinstance(m.content, list)
                for part in m.content if isinstance(part, ImageURLPart | VideoURLPart)]
        self._check_media_counts(refs)
        sampling_video = self._video_sampling(req.media_io_kwargs)
        messages = template_messages(req.messages)
        num_chars = text_chars(messages)
        self.builder.check_prompt_chars(num_chars, "messages")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        template_kwargs = {**self.config.template_defaults, **(req.chat_template_kwargs or {})}
        requested = req.requested_max_tokens
        settings = self._tool_settings(req, _RequestSettings.of(req))
        req = None  # R1: the model held the base64 strings; only the MediaRefs do now
        if not refs:
            body.release()  # parsed: no image will need the body's bytes

        encoded = await _settle([self.loader.fetch(ref) if ref.kind == "image"
                                 else self.videos.fetch(ref, sampling_video) for ref in refs])
        refs = None
        grids = [e.grid_thw for e in encoded if isinstance(e, EncodedImage)]
        videos = [e.layout for e in encoded if isinstance(e, EncodedVideo)]
        build = functools.partial(self._chat_prompt, messages, grids, tools, template_kwargs,
                                  videos)
        if num_chars > LONG_TEXT_CHARS:
            prompt_ids, prompt_end = await asyncio.to_thread(build)
        else:
            prompt_ids, prompt_end = build()
        parser = self.config.reasoning_parser
        start = parser and start_mode(parser, prompt_end, template_kwargs, settings.constrained)
        make_output = self._output_parsers(settings, tools, start)
        max_tokens = self.builder.resolve_max_tokens(len(prompt_ids), requested)
        sampling = [self._sampling(settings, max_tokens, i) for i in range(settings.n)]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._hand_off(rid, [prompt_ids] * settings.n, sampling, encoded,
                                       body.reservation)
        encoded = None
        return self._prepared("chat", rid, arrival, settings, len(prompt_ids), streams,
                              make_output)

    def _chat_prompt(self, messages: list[dict], grids: list[tuple[int, int, int]],
                     tools: list[dict] | None, template_kwargs: dict,
                     videos: list = ()) -> tuple[list[int], str]:
        """The prompt's token ids, and the end of its text (where thinking may be open)."""
        text = self.builder.render_chat(messages, tools=tools, template_kwargs=template_kwargs)
        return self.builder.prompt_ids(text, grids, videos), text[-64:]

    def _check_media_counts(self, refs: list[MediaRef]) -> None:
        """--limit-mm-per-prompt, per modality (the image limit is named as the flag's
        plain count, the video limit by its JSON key)."""
        for kind, limit, name in (
                ("image", self.config.max_images_per_prompt, "limit_mm_per_prompt"),
                ("video", self.config.max_videos_per_prompt, "limit_mm_per_prompt video")):
            count = sum(ref.kind == kind for ref in refs)
            if count > limit:
                raise BadRequest(f"the request has {count} {kind}s; at most {name}={limit}",
                                 param="messages", code=f"too_many_{kind}s")

    def _video_sampling(self, request_kwargs: dict | None) -> VideoSampling:
        """The server's --media-io-kwargs, or the request's video settings instead: fps it
        leaves out is none (as vLLM's merge drops it), num_frames it leaves out the
        server's (vLLM: 32); at most max_video_frames."""
        num_frames, fps = self.config.video_num_frames, self.config.video_fps
        if request_kwargs is not None:
            try:
                video = check_media_io_kwargs(request_kwargs).get("video")
            except ValueError as e:
                message = str(e)
            else:
                message = None
            if message is not None:
                raise BadRequest(message, param="media_io_kwargs")
            if video:
                num_frames = video.get("num_frames", self.config.video_num_frames)
                fps = video.get("fps")
        if num_frames > self.config.max_video_frames:
            raise BadRequest(f"media_io_kwargs asks for {num_frames} frames a video; at most "
                             f"max_video_frames={self.config.max_video_frames}",
                             param="media_io_kwargs", code="video_too_large")
        return VideoSampling(num_frames, fps)

    async def prepare_completion(self, body: RequestBody, arrival: float) -> Prepared:
        req = _parse(CompletionRequest, body.take())
        body.release()  # parsed: the prompts are all that is left of the body
        self._check_model(req.model)
        self._check_n(req.n)
        prompts = req.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if len(prompts) * req.n > self.config.max_n:
            raise BadRequest(f"{len(prompts)} prompts x n={req.n} choices is more than "
                                  f"max_n={self.config.max_n}", param="prompt")
        requested = req.requested_max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
        settings = _RequestSettings.of(req)
        echo = req.echo
        req = None
        for p in prompts:
            if isinstance(p, str):
                self.builder.check_prompt_chars(len(p), "prompt")
        if sum(len(p) for p in prompts if isinstance(p, str)) > LONG_TEXT_CHARS:
            ids_per_prompt = await asyncio.to_thread(
                lambda: [self.builder.build_completion(p) for p in prompts])
        else:
            ids_per_prompt = [self.builder.build_completion(p) for p in prompts]
        for ids in ids_per_prompt:
            if not ids:
                raise BadRequest("prompt is empty", param="prompt")
            self.builder.resolve_max_tokens(len(ids), requested)
        prompt_ids, sampling = [], []
        for ids in ids_per_prompt:
            for i in range(settings.n):
                prompt_ids.append(ids)
                sampling.append(self._sampling(settings, requested, i))
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._hand_off(rid, prompt_ids, sampling, [])
        prepared = self._prepared("completion", rid, arrival, settings,
                                  sum(len(ids) for ids in ids_per_prompt), streams)
        if echo:
            texts = [p if isinstance(p, str) else self.builder.decoder.decode(p) for p in prompts]
            for choice in prepared.choices:  # choices go prompt by prompt, n of each
                choice.echo = texts[choice.index // settings.n]
        return prepared

    def _prepared(self, kind, rid, arrival, settings, num_prompt_tokens, streams,
                  make_output: Callable[[], ChatOutputParser] | None = None) -> Prepared:
        decoder = (self.builder.decoder if settings.skip_special_tokens
                   else self.builder.decoder_with_specials)
        choices = [Choice(i, s, IncrementalDetokenizer(decoder, settings.stop,
                                                       settings.include_stop_str_in_output),
                          logprobs=None if settings.logprobs is None else [],
                          output=None if make_output is None else make_output())
                   for i, s in enumerate(streams)]
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        return Prepared(kind=kind, id=rid, created=int(time.time()),
                        model=self.config.model_name, stream=settings.stream,
                        include_usage=settings.include_usage,
                        num_prompt_tokens=num_prompt_tokens, choices=choices, arrival=arrival,
                        reasoning=kind == "chat" and self.config.reasoning_parser is not None)

    async def _hand_off(self, rid: str, prompt_ids: list[list[int]],
                        sampling: list[SamplingParams], encoded: list[EncodedImage],
                        held: Reservation | None = None) -> list[RequestStream]:
        """Admit, decode, submit one engine request per choice. Every choice shares the same
        ImageInput objects: the pixels exist once in this process whatever n is. Each engine
        request takes its share of the reservation (its pixels' bytes) and gives it back at
        its first output, when the engine has freed them (R3, R4).
        An image whose key the chosen engine's encoder cache holds goes without pixels and
        is not even decoded; such a request keeps its images' encoded bytes until its first
        output, to resend them if the engine evicted one meanwhile (image_resubmit.py).
        `held`: the body's reservation, exchanged for the images' (emptied by the exchange;
        the caller releases it on every other path)."""
        # 503 now, before any pixel is decoded, when no engine is up; wait while all are full
        await self.engines.wait_for_room(self.config.admission_timeout_s)
        reservation = kept = None
        if encoded:
            # every choice after the first sends its own copy of the pixels to an engine
            per_request = sum(e.resized_bytes for e in encoded)
            # the same whether images are skipped or not: kept encoded bytes are the bytes
            # decoding counts as its input, not a second copy (a cache hit needs no more)
            need = sum(e.need_bytes for e in encoded) + (len(prompt_ids) - 1) * per_request
            if held is not None and held.nbytes:
                reservation = await self.admission.exchange(held, need)
            else:
                reservation = await self.admission.acquire(need)
            if any(e.held_by(c) for c in self.engines.engines for e in encoded):
                # before decoding takes the bytes; held by this call until it has submitted
                kept = KeptImages([dataclasses.replace(e) for e in encoded],
                                  reservation.split(sum(e.nbytes for e in encoded)))
                kept.hold()
        held = None
        try:
            streams: list[RequestStream | ResubmittingStream] = []
            try:
                images: list[ImageInput | None] = [None] * len(encoded)  # decoded when needed
                for i, (ids, params) in enumerate(zip(prompt_ids, sampling, strict=True)):
                    engine = self.engines.pick()
                    skip = [kept is not None and e.held_by(engine) for e in encoded]
                    todo = [j for j, s in enumerate(skip) if not s and images[j] is None]
                    if todo:
                        decoded = await self._decode([encoded[j] for j in todo], reservation,
                                                     kept is not None)
                        for j, image in zip(todo, decoded, strict=True):
                            images[j] = image
                        decoded = None
                    inputs = _flatten([e.without_pixels() if s else images[j]
                                       for j, (e, s) in enumerate(zip(encoded, skip,
                                                                      strict=True))])
                    self._count_skipped(encoded, skip)
                    share = None
                    if reservation is not None:
                        share = reservation.split(sum(im.nbytes for im in inputs))
                    request_id = f"{rid}-{i}"
                    stream = self.engines.submit(AddRequest(
                        request_id=request_id, prompt_token_ids=ids, sampling=params,
                        images=inputs), mm_reservation=share, engine=engine)
                    inputs = None
                    if any(skip):
                        stream = ResubmittingStream(stream, kept, functools.partial(
                            self._resubmit, request_id, ids, params))
                    streams.append(stream)
                images = encoded = None  # R1: the engines and KeptImages hold them
            except BaseException:
                for s in streams:
                    await s.aclose()
                raise
            return streams
        finally:
            if kept is not None:
                kept.release()  # the streams sent without pixels hold it now, if any
                kept = None
            if reservation is not None:
                reservation.release()

    def _count_skipped(self, encoded: list[EncodedImage], skip: list[bool]) -> None:
        for e, s in zip(encoded, skip, strict=True):
            if s:
                self.metrics.image_bytes_skipped.inc(e.resized_bytes)
                self.metrics.image_decodes_skipped.inc()

    async def _resubmit(self, request_id: str, ids: list[int], params: SamplingParams,
                        encoded: list[EncodedImage]) -> RequestStream:
        """Send a request refused with IMAGE_MISSING again, with every image's pixels."""
        self.metrics.image_resubmits.inc()
        reservation = await self.admission.acquire(sum(e.need_bytes for e in encoded))
        try:
            images = _flatten(await self._decode(encoded, reservation))
            encoded = None
            share = reservation.split(sum(im.nbytes for im in images))
            return self.engines.submit(AddRequest(
                request_id=request_id, prompt_token_ids=ids, sampling=params, images=images),
                mm_reservation=share)
        finally:
            reservation.release()

    async def _decode(self, encoded: list[EncodedImage | EncodedVideo], reservation: Reservation,
                      bytes_kept: bool = False) -> list[ImageInput | list[ImageInput]]:
        """An ImageInput per image, a list of them (one per temporal group) per video.
        `bytes_kept`: KeptImages holds the encoded bytes (and their budget) on."""
        async def one(image: EncodedImage | EncodedVideo) -> ImageInput | list[ImageInput]:
            if isinstance(image, EncodedVideo):
                result = await self.videos.decode(image)
            else:
                result = await self.loader.decode(image)
            done = image.need_bytes - image.resized_bytes  # decoding is over
            reservation.release(done - image.nbytes if bytes_kept else done)
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

def _flatten(inputs: list[ImageInput | list[ImageInput]]) -> list[ImageInput]:
    """What an AddRequest carries: each image, and each video's groups in order."""
    out: list[ImageInput] = []
    for item in inputs:
        if isinstance(item, list):
            out.extend(item)
        else:
            out.append(item)
    return out


def _retrieve(fut: asyncio.Future) -> None:
    """Mark a future's exception as seen (its request is gone; the error is moot)."""
    if not fut.cancelled():
        fut.exception()


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
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    min_tokens: int | None
    logit_bias: dict[str, float] | None
    logprobs: int | None  # top alternatives per token (0: the token's own), None: none
    logprobs_field: str  # the request field that asks for them
    structured: tuple[str, str] | None  # what the output must match (kind, spec)
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    parse_tool_calls: bool = False  # chat with a tool choice other than none
    parallel_tool_calls: bool = True
    constrained: bool = False  # a grammar governs the output from its first token

    @classmethod
    def of(cls, req) -> _RequestSettings:
        return cls(n=req.n, stream=req.stream, include_usage=req.include_usage, stop=req.stop,
                   temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                   stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                   presence_penalty=req.presence_penalty,
                   frequency_penalty=req.frequency_penalty,
                   repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens,
                   logit_bias=req.logit_bias, logprobs=req.requested_logprobs,
                   logprobs_field="logprobs" if hasattr(req, "prompt") else "top_logprobs",
                   structured=req.structured, skip_special_tokens=req.skip_special_tokens,
                   include_stop_str_in_output=req.include_stop_str_in_output,
                   constrained=req.structured is not None)
