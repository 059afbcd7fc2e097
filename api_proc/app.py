"""The OpenAI-compatible HTTP app: `build_app(config) -> FastAPI`.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics; vLLM's POST /v1/chat/completions/batch, POST /invocations (SageMaker's: chat
or completions by the body's form), POST /tokenize, POST /detokenize, GET /version, GET /load
(with --enable-server-load-tracking) and GET /openapi.json. Request bodies are read by the pipeline itself (api_proc/request_body.py), not by
FastAPI's body parameters: FastAPI's route wrapper keeps the parsed body in its frame while a
streaming response runs, which would pin every base64 image for the whole stream (R1).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from api_proc.admission import AdmissionController
from api_proc.config import ApiConfig
from api_proc.engine_client import EngineClient
from api_proc.errors import (
    BadRequest,
    HTTPError,
    Unauthorized,
    error_response,
    install_error_handlers,
)
from api_proc.logprobs import LogprobsFormatter
from api_proc.media_loader import MediaLoader
from api_proc.metrics import Metrics
from api_proc.openapi import (
    BODY_ERRORS,
    ENGINE_ERRORS,
    SSE,
    UNHEALTHY,
    answers,
    install_openapi,
)
from api_proc.prompt_builder import PromptBuilder
from api_proc.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from api_proc.request_body import (
    BodyReader,
    ClientGone,
    RequestBody,
    body_keys,
    wait_for_disconnect,
)
from api_proc.responses import ResponseWriter, StreamedResponse
from api_proc.serving import Prepared, Serving
from api_proc.tokenization import Tokenization
from shared.model_config import load_model_config


async def run_until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; cancel it (its finally blocks release budget and abort engine requests)
    if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            raise ClientGone()
    try:
        return task.result()
    finally:
        # The task holds its exception, whose traceback holds this frame, which holds the
        # task: a cycle that would keep every frame's locals (payloads included) until the
        # garbage collector runs (R1).
        task = watcher = None


logger = logging.getLogger(__name__)

try:
    VERSION = importlib.metadata.version("flatserve")
except importlib.metadata.PackageNotFoundError:  # run from a checkout without installing
    VERSION = "0.0.0"

def build_app(config: ApiConfig, *, engine_processes: Sequence[Any] | None = None,
              engine_client: EngineClient | None = None,
              media_loader: MediaLoader | None = None) -> FastAPI:
    """The API app for `config`. `engine_processes` (Popen objects, one per address) let
    /health report a dead engine process at once; `engine_client` and `media_loader` replace
    the defaults (tests)."""
    model_config = load_model_config(config.model)
    builder = PromptBuilder(config.model, model_config, config.max_model_len, config.chat_template)
    loader = media_loader or MediaLoader(config, config.image_config(model_config.image))
    admission = AdmissionController(config.mm_inflight_budget, config.admission_timeout_s)
    engines = engine_client or EngineClient.connect(config.engine_addresses, engine_processes,
                                                    keys=config.client_keys())
    metrics = Metrics(num_waiting=lambda: admission.num_waiting,
                      num_running=lambda: engines.num_in_flight,
                      mm_inflight_bytes=lambda: admission.in_flight_bytes,
                      mm_inflight_budget=config.mm_inflight_budget,
                      engine_stats=lambda: [e.stats for e in engines.engines],
                      engine_plans=lambda: [e.memory_plan for e in engines.engines],
                      model_name=config.model_name, max_model_len=builder.max_model_len)
    bodies = BodyReader(config.max_body_bytes, admission, config.body_read_timeout_s,
                        config.max_unread_bodies)
    serving = Serving(config, builder, loader, admission, engines, metrics)
    responses = ResponseWriter(metrics, LogprobsFormatter(builder.decoder),
                               config.stream_interval, config.sse_keep_alive_interval)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await engines.start()
        try:
            yield
        finally:
            await engines.close()
            await loader.aclose()

    app = FastAPI(title="flatserve", version=VERSION, lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.root_path = config.root_path  # behind a proxy serving under a prefix (as vLLM sets it)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=list(config.allowed_methods),
                           allow_headers=list(config.allowed_headers),
                           allow_credentials=config.allow_credentials)
    install_error_handlers(app)
    app.state.config = config
    app.state.serving = serving
    app.state.admission = admission
    app.state.bodies = bodies
    app.state.engine_client = engines
    app.state.metrics = metrics

    def has_api_key(request: Request) -> bool:
        if config.api_key is None:
            return True
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(),
                                                                     config.api_key.encode())

    def check_api_key(request: Request) -> None:
        if not has_api_key(request):
            raise Unauthorized("invalid or missing API key (Authorization: Bearer ...)")

    load = ServerLoad(config.enable_server_load_tracking)

    async def handle(endpoint: str, request: Request,
                     prepare: Callable[[RequestBody, float], Awaitable[Prepared]]) -> Response:
        load.enter()
        streaming = False
        try:
            response = await _handle(endpoint, request, prepare)
            streaming = isinstance(response, StreamedResponse)
            return response
        finally:
            if not streaming:
                load.leave()

    def count_end(endpoint: str, status: int) -> None:
        """A streamed response is over."""
        load.leave()
        metrics.count_request(endpoint, status)

    async def read_and_run(endpoint: str, request: Request,
                           work: Callable[[RequestBody], Awaitable[Any]]) -> Any:
        """Read the body and run `work(body)` until the client goes: its result, or the
        counted error response (an HTTPError, or 499 when the client left). The body's
        admission bytes that `work` did not take over are released either way (R1, R4)."""
        body = None
        try:
            # The body is read before the disconnect watcher starts: both would receive().
            body = await bodies.read(request)
            return await run_until_disconnect(request, work(body))
        except HTTPError as e:
            metrics.count_request(endpoint, e.status)
            return error_response(e, close=body is None)
        except ClientGone:
            metrics.count_request(endpoint, 499)
            return Response(status_code=499)
        finally:
            if body is not None:
                body.release()
            body = None

    async def _handle(endpoint: str, request: Request,
                      prepare: Callable[[RequestBody, float], Awaitable[Prepared]]) -> Response:
        arrival = time.monotonic()
        metrics.num_preparing.inc()
        try:
            prepared = await read_and_run(endpoint, request,
                                          lambda body: prepare(body, arrival))
        finally:
            metrics.num_preparing.dec()
        if isinstance(prepared, Response):
            return prepared
        if config.enable_log_requests:
            logger.info("request %s (%s): %d prompt tokens, %d choices, stream %s",
                        prepared.id, endpoint, prepared.num_prompt_tokens,
                        len(prepared.choices), prepared.stream)
        if prepared.stream:
            return responses.stream(prepared, functools.partial(count_end, endpoint))
        try:
            body = await run_until_disconnect(request, responses.collect(prepared))
        except HTTPError as e:
            metrics.count_request(endpoint, e.status)
            return error_response(e)
        except ClientGone:
            metrics.count_request(endpoint, 499)
            return Response(status_code=499)
        metrics.count_request(endpoint, 200)
        return JSONResponse(body)

    generation = answers(401, *BODY_ERRORS, *ENGINE_ERRORS, ok_types=(SSE,))

    @app.post("/v1/chat/completions", dependencies=[Depends(check_api_key)],
              responses=generation)
    async def chat_completions(request: Request) -> Response:
        return await handle("chat", request, serving.prepare_chat)

    @app.post("/v1/completions", dependencies=[Depends(check_api_key)], responses=generation)
    async def completions(request: Request) -> Response:
        return await handle("completions", request, serving.prepare_completion)

    @app.post("/v1/chat/completions/batch", dependencies=[Depends(check_api_key)],
              responses=answers(401, *BODY_ERRORS, *ENGINE_ERRORS))  # never streamed
    async def chat_completions_batch(request: Request) -> Response:
        return await handle("chat_batch", request, serving.prepare_chat_batch)

    async def prepare_invocation(body: RequestBody, arrival: float) -> Prepared:
        data = body.take()
        keys = body_keys(data)
        if "messages" not in keys and "prompt" not in keys:
            raise BadRequest("an invocation is a chat request (messages) or a completion "
                             "request (prompt); this body has neither")
        body.data = data
        data = None
        if "messages" in keys:
            return await serving.prepare_chat(body, arrival)
        return await serving.prepare_completion(body, arrival)

    @app.post("/invocations", dependencies=[Depends(check_api_key)], responses=generation)
    async def invocations(request: Request) -> Response:
        return await handle("invocations", request, prepare_invocation)

    tokenization = Tokenization(serving)

    async def tokenization_route(endpoint: str, request: Request, work) -> Response:
        result = await read_and_run(endpoint, request, work)
        if isinstance(result, Response):
            return result
        metrics.count_request(endpoint, 200)
        return JSONResponse(result)

    async def detokenize_body(body: RequestBody) -> dict:
        return tokenization.detokenize(body)

    @app.post("/tokenize", dependencies=[Depends(check_api_key)],
              responses=answers(401, *BODY_ERRORS, 404))
    async def tokenize(request: Request) -> Response:
        return await tokenization_route("tokenize", request, tokenization.tokenize)

    @app.post("/detokenize", dependencies=[Depends(check_api_key)],
              responses=answers(401, *BODY_ERRORS, 404))
    async def detokenize(request: Request) -> Response:
        return await tokenization_route("detokenize", request, detokenize_body)

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    if config.enable_server_load_tracking:
        @app.get("/load")
        async def server_load() -> dict:
            return {"server_load": load.num_requests}

    created = int(time.time())

    @app.get("/v1/models", dependencies=[Depends(check_api_key)], responses=answers(401))
    async def models() -> dict:
        # vLLM's root: the checkpoint the served names stand for
        cards = [ModelCard(id=name, created=created, max_model_len=builder.max_model_len,
                           root=config.model)
                 for name in config.served_model_name]
        return ModelList(data=cards).model_dump()

    @app.get("/health", responses={503: UNHEALTHY})
    async def health(request: Request) -> JSONResponse:
        engines_health = await engines.health()
        dead = [e for e in engines_health if not e["ok"]]
        status = 503 if dead or not engines_health else 200
        if not has_api_key(request):
            # probes need no key, but engine addresses and failure details are for key holders
            body = {"status": "ok" if status == 200 else "unhealthy"}
            if status != 200:
                body["reason"] = (f"{len(dead)} of {len(engines_health)} engines unavailable"
                                  if engines_health else "no engine is configured")
            return JSONResponse(body, status_code=status)
        if not engines_health:
            return JSONResponse({"status": "unhealthy", "reason": "no engine is configured",
                                 "engines": []}, status_code=503)
        if dead:
            reason = "; ".join(f"{e['address']}: {e['reason']}" for e in dead)
            return JSONResponse({"status": "unhealthy", "reason": reason,
                                 "engines": engines_health}, status_code=503)
        return JSONResponse({"status": "ok", "engines": engines_health})

    metrics_auth = [] if config.allow_unauthenticated_metrics else [Depends(check_api_key)]
    metrics_errors = () if config.allow_unauthenticated_metrics else (401,)

    @app.get("/metrics", dependencies=metrics_auth, response_class=Response,
             responses=answers(*metrics_errors, ok_types=(metrics.content_type,)))
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    install_openapi(app, {
        "/v1/chat/completions": [ChatCompletionRequest],
        "/v1/completions": [CompletionRequest],
        "/v1/chat/completions/batch": [BatchChatCompletionRequest],
        "/invocations": [ChatCompletionRequest, CompletionRequest],
        "/tokenize": [TokenizeCompletionRequest, TokenizeChatRequest],
        "/detokenize": [DetokenizeRequest]})
    return app


class ServerLoad:
    """vLLM's server_load: the requests being served (chat, completions, their batch and
    invocations), from the arrival of each to the end of its response, streamed or not.
    Counted only when tracking is on."""

    __slots__ = ("enabled", "num_requests")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.num_requests = 0

    def enter(self) -> None:
        if self.enabled:
            self.num_requests += 1

    def leave(self) -> None:
        if self.enabled:
            self.num_requests -= 1
