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
from api_proc.beam_search import BeamSearch, FinishedStream
from api_proc.chat_output import ChatOutputParser
from api_proc.config import ApiConfig, check_media_io_kwargs
from api_proc.detokenizer import IncrementalDetokenizer, NoDetokenizer
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
    EMPTY_PROMPT,
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    ChatMessage,
    ChatPromptFields,
    CompletionRequest,
    ImageURLPart,
    TextPart,
    UsageInfo,
    VideoURLPart,
)
from api_proc.reasoning_parser import REASONING, ReasoningParser, start_mode
from api_proc.request_body import RequestBody
from api_proc.tool_grammar import tool_call_constraint
from api_proc.tool_parser import ToolCallParser, read_cut_hermes_call, read_hermes_call
from api_proc.unknown_keys import note_unknown_keys
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
    num_streamed: int = 0  # of num_tokens, those whose step has been written (streaming)
    finish_reason: str | None = None
    texts: list[str] = field(default_factory=list)  # non-streaming responses only
    logprobs: list | None = None  # non-streaming: chat entries or completion parts so far
    echo: str = ""  # echo: the text sent before the completion (the prompt; chat: the last
    # message, the assistant's)
    first_token_at: float | None = None  # time.monotonic(), for the latency metrics
    last_token_at: float | None = None
    queued_s: float = 0.0  # in an engine's waiting queue (with its first token)
    # vLLM's per-request metrics: its prompt's tokens, its max_tokens, its request's n
    num_prompt_tokens: int = 0
    max_tokens: int = 0
    n: int = 1
    num_chars: int = 0  # of the completion so far (completion logprobs' text_offset)
    output: ChatOutputParser | None = None  # chat: reads reasoning and tool calls out
    # prompt_logprobs: the engine's entries, once they came (non-streaming responses)
    prompt_logprobs: list | None = None
    # return_token_ids: the prompt's ids (streamed: until its first chunk carries them),
    # the completion's (non-streaming) and those of the step being written (streaming)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    step_ids: list[int] | None = None
    # streaming: a text-only chunk's bytes around its text (and usage), () if none; responses.py
    chunk_template: tuple[bytes, ...] | None = None


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
    tokens_as_ids: bool = False  # log-probability tokens written "token_id:ID"
    continuous_usage: bool = False  # usage in every streamed chunk
    return_token_ids: bool = False
    prompt_logprobs: bool = False  # asked for: the response's prompt_logprobs are filled in
    echo_logprobs: bool = False  # completions: the echoed prompt's tokens in logprobs
    include_reasoning: bool = True  # false: reasoning is read out and left out

    @property
    def usage(self) -> UsageInfo:
        completion = sum(c.num_tokens for c in self.choices)
        return UsageInfo(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
                         total_tokens=self.num_prompt_tokens + completion)


def parse_body(model: type[pydantic.BaseModel], body: bytes):
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

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.config.served_model_name:
            raise NotFound(f"model {name!r} does not exist; this server serves "
                                f"{self.config.model_name!r}", param="model",
                                code="model_not_found")

    def _sampling(self, req, max_tokens: int, choice: int) -> SamplingParams:
        seed = None if req.seed is None else (req.seed + choice) % 2**63
        logprobs = self._num_logprobs(req.logprobs, req.logprobs_field)
        prompt_logprobs = self._num_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if req.echo_logprobs:  # the echoed prompt's entries come from prompt_logprobs
            prompt_logprobs = max(prompt_logprobs or 0, logprobs)
        self._check_logit_bias(req.logit_bias)
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
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured=req.structured,
            )
        except ValueError as e:
            message = str(e)
        raise BadRequest(message)

    def _num_logprobs(self, asked: int | None, field: str) -> int | None:
        """Top alternatives per token: -1 is the whole vocabulary (vLLM's), allowed up to
        --max-logprobs (-1 there: any number); never more than the vocabulary."""
        if asked is None:
            return None
        vocab = self.builder.num_logits
        limit = vocab if self.config.max_logprobs == -1 else self.config.max_logprobs
        k = vocab if asked == -1 else asked
        if k > limit:
            raise BadRequest(f"{field}: {asked} log-probabilities per token asked "
                             f"({k} tokens); at most max_logprobs="
                             f"{self.config.max_logprobs} (--max-logprobs; -1 allows the whole "
                             f"vocabulary of {vocab})", param=field)
        return min(k, vocab)

    def _thinking(self, params: SamplingParams, settings: _RequestSettings,
                  start: str | None) -> SamplingParams:
        """`params` with the request's thinking_token_budget: the markers' ids (from
        --reasoning-config or the parser's) and whether the prompt leaves thinking open."""
        if settings.thinking_token_budget is None:
            return params
        if self.config.reasoning_parser is None:
            raise BadRequest("thinking_token_budget needs --reasoning-parser (the server "
                             "must know where thinking starts and ends)",
                             param="thinking_token_budget")
        if settings.constrained:
            raise BadRequest("thinking_token_budget cannot go with an output constraint (a "
                             "grammar or a forced tool call governs the output from its "
                             "first token)", param="thinking_token_budget")
        start_ids, end_ids = self._marker_ids
        return dataclasses.replace(params, thinking_token_budget=settings.thinking_token_budget,
                                   think_start_ids=start_ids, think_end_ids=end_ids,
                                   thinking_open=start == REASONING)

    @functools.cached_property
    def _marker_ids(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        start, end = self.config.reasoning_markers
        return tuple(self.builder.encode(start)), tuple(self.builder.encode(end))

    async def _beam_search(self, rid: str, ids_per_prompt: list[list[int]],
                           settings: _RequestSettings, max_tokens: int) -> list[FinishedStream]:
        """Each prompt's n best beams (api_proc/beam_search.py), as finished streams."""
        width, length_penalty = settings.beam
        if width > self.config.max_n:
            raise BadRequest(f"a beam width of {width} (best_of) is more than max_n="
                             f"{self.config.max_n}", param="best_of")
        search = BeamSearch(width=width, n=settings.n, max_tokens=max_tokens,
                            temperature=settings.temperature or 0.0,
                            length_penalty=length_penalty, ignore_eos=settings.ignore_eos,
                            eos_token_ids=self.builder.eos_token_ids,
                            num_logits=self.builder.num_logits,
                            placeholder_ids=self.builder.placeholder_ids)

        def submit(request_id: str, ids: list[int], params: SamplingParams) -> RequestStream:
            return self.engines.submit(AddRequest(request_id=request_id, prompt_token_ids=ids,
                                                  sampling=params))

        await self.engines.wait_for_room(self.config.admission_timeout_s)
        streams = []
        for i, ids in enumerate(ids_per_prompt):
            beams = await search.run(submit, f"{rid}-{i}", ids)
            streams += [FinishedStream(beam) for beam in beams]
        return streams

    def _check_logit_bias(self, bias: dict[str, float] | None) -> None:
        size = self.builder.num_logits
        outside = sorted(int(t) for t in bias or () if int(t) >= size)
        if outside:
            shown = ", ".join(map(str, outside[:8])) + (", ..." if len(outside) > 8 else "")
            raise BadRequest(f"logit_bias has out-of-vocab token ids [{shown}]: the vocabulary "
                             f"size is {size}", param="logit_bias")

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
                                   parallel_tool_calls=parallel, constrained=mode != "auto",
                                   named_function=named)

    def _output_parsers(self, settings: _RequestSettings, tools: list[dict] | None,
                        start: str | None) -> Callable[[], ChatOutputParser] | None:
        """What makes each choice's reader of reasoning and tool calls (None: its text is
        read as it is); `start`: where the reasoning parser starts (reasoning_parser.py)."""
        reasoning = self.config.reasoning_parser
        if reasoning is None and not settings.parse_tool_calls:
            return None
        read_call, read_cut_call = read_hermes_call, read_cut_hermes_call
        if settings.parse_tool_calls and self.config.tool_call_parser == "qwen3_coder":
            read_call = XmlCallReader(parameter_types(tools or []))
            read_cut_call = read_call.cut
        named = settings.named_function
        if named is not None:  # cut before its name was whole: the name is known
            read_cut_call = functools.partial(_named_cut, named, read_cut_call)
        if not (settings.parse_tool_calls and settings.constrained):
            read_cut_call = None  # text is free: a cut call stays text
        parallel = settings.parallel_tool_calls

        def make() -> ChatOutputParser:
            return ChatOutputParser(
                None if reasoning is None else ReasoningParser.create(reasoning, start),
                ToolCallParser(parallel, read_call, read_cut_call) if settings.parse_tool_calls
                else None)
        return make

    def _check_n(self, n: int) -> None:
        if n > self.config.max_n:
            raise BadRequest(f"n is {n}; at most max_n={self.config.max_n}", param="n")

    async def prepare_chat(self, body: RequestBody, arrival: float) -> Prepared:
        # the request model goes straight into _prepare_chat, which drops it (R1)
        return await self._prepare_chat(self._parse_chat(body), body, arrival)

    def _check_tokenizer(self, what: str, param: str) -> None:
        if self.config.skip_tokenizer_init:
            raise BadRequest(f"{what} needs the tokenizer, and this server runs with "
                             "--skip-tokenizer-init: send token ids to /v1/completions",
                             param=param)

    def _parse_chat(self, body: RequestBody) -> ChatCompletionRequest:
        self._check_tokenizer("a chat request", "messages")
        req = parse_body(ChatCompletionRequest, body.take())
        self.check_model(req.model)
        self._check_n(req.n)
        return req

    async def _prepare_chat(self, req: ChatCompletionRequest, body: RequestBody,
                            arrival: float, rid: str | None = None) -> Prepared:
        spec, refs = self.chat_prompt_spec(req)
        requested = req.requested_max_tokens
        settings = self._tool_settings(req, _RequestSettings.of(req))
        echo = _echo_text(req.messages[-1]) if req.echo else ""
        req = None  # R1: the model held the base64 strings; only the MediaRefs do now
        if not refs:
            body.release()  # parsed: no image will need the body's bytes

        encoded = await self.fetch_media(refs, spec.video_sampling)
        refs = None
        prompt_ids, prompt_end = await self.chat_prompt_ids(spec, *media_layouts(encoded))
        parser = self.config.reasoning_parser
        start = parser and start_mode(parser, prompt_end, spec.template_kwargs,
                                      settings.constrained)
        make_output = self._output_parsers(settings, spec.tools, start)
        max_tokens = self.builder.resolve_max_tokens(len(prompt_ids), requested)
        sampling = [self._thinking(self._sampling(settings, max_tokens, i), settings, start)
                    for i in range(settings.n)]
        rid = rid or f"chatcmpl-{uuid.uuid4().hex}"
        if settings.beam is not None:
            if encoded:
                raise BadRequest("use_beam_search with images is not supported",
                                 param="use_beam_search")
            streams = await self._beam_search(rid, [prompt_ids], settings, max_tokens)
        else:
            streams = await self._hand_off(rid, [prompt_ids] * settings.n, sampling, encoded,
                                           body.reservation)
        encoded = None
        prepared = self._prepared("chat", rid, arrival, settings, len(prompt_ids), streams,
                                  max_tokens, make_output, [prompt_ids] * settings.n)
        for choice in prepared.choices:
            choice.echo = echo
        return prepared

    async def prepare_chat_batch(self, body: RequestBody, arrival: float) -> Prepared:
        """POST /v1/chat/completions/batch (vLLM's): one choice per conversation, in order,
        in one chat completion."""
        self._check_tokenizer("a chat request", "messages")
        req = parse_body(BatchChatCompletionRequest, body.take())
        self.check_model(req.model)
        if len(req.messages) > self.config.max_n:
            raise BadRequest(f"{len(req.messages)} conversations; at most max_n="
                             f"{self.config.max_n}", param="messages")
        conversations, req.messages = req.messages, []
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        parts: list[Prepared] = []
        try:
            for i in range(len(conversations)):
                # R1: each conversation's model goes straight into _prepare_chat
                parts.append(await self._prepare_chat(
                    _conversation_request(req, conversations, i), body, arrival, f"{rid}-{i}"))
        except BaseException:
            for part in parts:
                for c in part.choices:
                    c.stream.abort()
            raise
        choices = [c for part in parts for c in part.choices]
        for i, c in enumerate(choices):
            c.index = i
        return dataclasses.replace(parts[0], id=rid, choices=choices,
                                   num_prompt_tokens=sum(p.num_prompt_tokens for p in parts))

    def chat_prompt_spec(self, req: ChatPromptFields) -> tuple[ChatPromptSpec, list[MediaRef]]:
        """What renders a request's chat prompt, and its images to fetch."""
        note_unknown_keys(req.messages, self.metrics.count_unknown_key)
        refs = [MediaRef(part.image_url.url) if isinstance(part, ImageURLPart)
                else MediaRef(part.video_url.url, "video")
                for m in req.messages if isinstance(m.content, list)
                for part in m.content if isinstance(part, ImageURLPart | VideoURLPart)]
        self._check_media_counts(refs)
        video_sampling = self._video_sampling(req.media_io_kwargs)
        messages = template_messages(req.messages)
        num_chars = text_chars(messages)
        self.builder.check_prompt_chars(num_chars, "messages")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        template_kwargs = {**self.config.template_defaults, **(req.chat_template_kwargs or {})}
        return ChatPromptSpec(messages, tools, template_kwargs, req.add_generation_prompt,
                              req.continue_final_message, num_chars, video_sampling), refs

    async def fetch_media(self, refs: list[MediaRef], video_sampling: VideoSampling
                          ) -> list[EncodedImage | EncodedVideo]:
        """Each image's and video's bytes and size (headers read, nothing decoded)."""
        return await _settle([self.loader.fetch(ref) if ref.kind == "image"
                              else self.videos.fetch(ref, video_sampling) for ref in refs])

    async def chat_prompt_ids(self, spec: ChatPromptSpec, grids: list[tuple[int, int, int]],
                              videos: list) -> tuple[list[int], str]:
        """The prompt's token ids (images of `grids` and videos of layouts `videos`
        expanded), and the end of its text (where thinking may be open); long prompts are
        built off the event loop."""
        build = functools.partial(self._chat_prompt, spec, grids, videos)
        if spec.num_chars > LONG_TEXT_CHARS:
            return await asyncio.to_thread(build)
        return build()

    def _chat_prompt(self, spec: ChatPromptSpec, grids: list[tuple[int, int, int]],
                     videos: list) -> tuple[list[int], str]:
        text = self.builder.render_chat(
            spec.messages, spec.add_generation_prompt, spec.tools, spec.template_kwargs,
            spec.continue_final_message)
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
        req = parse_body(CompletionRequest, body.take())
        body.release()  # parsed: the prompts are all that is left of the body
        self.check_model(req.model)
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
        if any(isinstance(p, str) for p in prompts):
            self._check_tokenizer("a text prompt", "prompt")
        if settings.stop:
            self._check_tokenizer("stop", "stop")
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
                raise BadRequest(EMPTY_PROMPT, param="prompt")
            self.builder.resolve_max_tokens(len(ids), requested)
        prompt_ids, sampling = [], []
        for ids in ids_per_prompt:
            for i in range(settings.n):
                prompt_ids.append(ids)
                sampling.append(self._sampling(settings, requested, i))
        rid = f"cmpl-{uuid.uuid4().hex}"
        if settings.beam is not None:
            streams = await self._beam_search(rid, ids_per_prompt, settings, requested)
        else:
            streams = await self._hand_off(rid, prompt_ids, sampling, [])
        prepared = self._prepared("completion", rid, arrival, settings,
                                  sum(len(ids) for ids in ids_per_prompt), streams, requested,
                                  prompt_ids=prompt_ids)
        if echo and not self.config.skip_tokenizer_init:  # token-out: ids, no text
            texts = [p if isinstance(p, str) else self.builder.decoder.decode(p) for p in prompts]
            for choice in prepared.choices:  # choices go prompt by prompt, n of each
                choice.echo = texts[choice.index // settings.n]
                choice.num_chars = len(choice.echo)  # text_offset counts the echo too
        return prepared

    def _prepared(self, kind, rid, arrival, settings, num_prompt_tokens, streams, max_tokens,
                  make_output: Callable[[], ChatOutputParser] | None = None,
                  prompt_ids: list[list[int]] | None = None) -> Prepared:
        decoder = (self.builder.decoder if settings.skip_special_tokens
                   else self.builder.decoder_with_specials)
        ids = settings.return_token_ids
        token_out = self.config.skip_tokenizer_init

        def detokenizer():
            if token_out:
                return NoDetokenizer()
            return IncrementalDetokenizer(decoder, settings.stop,
                                          settings.include_stop_str_in_output)
        choices = [Choice(i, s, detokenizer(), num_prompt_tokens=len(prompt_ids[i]),
                          max_tokens=max_tokens, n=settings.n,
                          logprobs=None if settings.logprobs is None else [],
                          output=None if make_output is None else make_output(),
                          prompt_token_ids=list(prompt_ids[i])
                          if ids or settings.prompt_logprobs is not None
                          or settings.echo_logprobs else None,
                          token_ids=[] if ids else None, step_ids=[] if ids else None)
                   for i, s in enumerate(streams)]
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        # vLLM's --enable-force-include-usage: every streamed chunk carries usage
        forced = self.config.enable_force_include_usage and settings.stream
        return Prepared(kind=kind, id=rid, created=int(time.time()),
                        model=self.config.model_name, stream=settings.stream,
                        include_usage=settings.include_usage or forced,
                        continuous_usage=settings.continuous_usage or forced,
                        return_token_ids=ids,
                        prompt_logprobs=settings.prompt_logprobs is not None,
                        echo_logprobs=settings.echo_logprobs,
                        include_reasoning=settings.include_reasoning,
                        num_prompt_tokens=num_prompt_tokens, choices=choices, arrival=arrival,
                        reasoning=kind == "chat" and self.config.reasoning_parser is not None,
                        tokens_as_ids=token_out or (
                            self.config.return_tokens_as_token_ids
                            if settings.tokens_as_ids is None else settings.tokens_as_ids))

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

def _named_cut(name: str, read_cut_call: Callable[[str], tuple[str, str]],
               body: str) -> tuple[str, str]:
    return name, read_cut_call(body)[1]


def media_layouts(media: list[EncodedImage | EncodedVideo]) -> tuple[list, list]:
    """(each image's patch grid, each video's layout): what a prompt's placeholders need."""
    return ([e.grid_thw for e in media if isinstance(e, EncodedImage)],
            [e.layout for e in media if isinstance(e, EncodedVideo)])


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
class ChatPromptSpec:
    """A chat request's prompt as the template renders it (no image data: markers only)."""

    messages: list[dict]
    tools: list[dict] | None
    template_kwargs: dict
    add_generation_prompt: bool
    continue_final_message: bool
    num_chars: int  # of the messages' text
    video_sampling: VideoSampling


def _conversation_request(batch: BatchChatCompletionRequest, conversations: list,
                          i: int) -> ChatCompletionRequest:
    """Conversation `i` of a batch as a chat request of its own, taken out of the list."""
    messages, conversations[i] = conversations[i], None
    return ChatCompletionRequest.model_construct(**{**dict(batch), "messages": messages})


def _echo_text(last: ChatMessage) -> str:
    """vLLM's chat echo: the final message's text when it is the assistant's."""
    if last.role != "assistant" or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "".join(p.text for p in last.content if isinstance(p, TextPart))


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
    named_function: str | None = None  # tool_choice names this function
    tokens_as_ids: bool | None = None  # "token_id:ID" tokens; None: the server's setting
    continuous_usage: bool = False  # usage in every streamed chunk
    return_token_ids: bool = False
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs (-1: all)
    echo_logprobs: bool = False  # completions: the echoed prompt with log-probabilities
    include_reasoning: bool = True
    thinking_token_budget: int | None = None
    beam: tuple[int, float] | None = None  # use_beam_search: (width, length_penalty)

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
                   constrained=req.structured is not None,
                   tokens_as_ids=req.return_tokens_as_token_ids,
                   continuous_usage=req.continuous_usage, return_token_ids=req.return_token_ids,
                   prompt_logprobs=req.prompt_logprobs,
                   echo_logprobs=getattr(req, "echo_logprobs", False),
                   include_reasoning=getattr(req, "include_reasoning", True),
                   thinking_token_budget=getattr(req, "thinking_token_budget", None),
                   beam=(req.beam_width, req.length_penalty) if req.use_beam_search else None)
