"""The load: chat requests with generated images at a set concurrency (asyncio + httpx)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from flatserve.soak.config import SoakConfig
from flatserve.soak.conversation import conversation_messages, words
from flatserve.soak.images import ImagePool
from flatserve.soak.videos import VideoPool

KEEP_ERRORS = 10  # error messages kept verbatim; the rest are only counted by kind
POOL_TIMEOUT_S = 60.0


@dataclass
class LoadStats:
    sent: int = 0
    finished: int = 0  # every outcome below
    ok: int = 0
    disconnects: int = 0  # planned client disconnects: expected
    rejected: int = 0  # statuses in allow_status: expected
    errors: int = 0  # everything else
    in_flight: int = 0
    errors_by_kind: Counter = field(default_factory=Counter)
    error_messages: list[str] = field(default_factory=list)
    stop_reason: str | None = None  # set when the load stopped before its planned end
    started_at: float = 0.0
    ended_at: float = 0.0

    @property
    def duration_s(self) -> float:
        return max(0.0, (self.ended_at or time.monotonic()) - self.started_at)

    def record_error(self, index: int, kind: str, message: str) -> None:
        self.errors += 1
        self.errors_by_kind[kind] += 1
        if len(self.error_messages) < KEEP_ERRORS:
            self.error_messages.append(f"request {index}: {kind}: {message}"[:500])


@dataclass(frozen=True)
class RequestPlan:
    index: int
    num_images: int
    disconnect: bool
    disconnect_after_chunks: int  # streaming: close after this many chunks
    disconnect_fraction: float  # not streaming: abort after this share of a typical latency
    conversation: int = 0  # with --turns N: request `index` is turn index % N of index // N
    turn: int = 0


def plan_request(config: SoakConfig, index: int) -> RequestPlan:
    """What request `index` does; a function of the seed and the index only. Whether it has
    images is drawn per conversation (one request each without --turns)."""
    conversation, turn = divmod(index, config.turns)
    text_only = random.Random(config.seed * 1_000_003 + conversation).random() \
        < config.text_only_share
    rng = random.Random(config.seed * 1_000_003 + index)
    rng.random()  # the draw above, for the request of a one-turn conversation
    return RequestPlan(
        index=index,
        num_images=0 if text_only else config.images_per_request,
        disconnect=rng.random() < config.disconnect_share,
        disconnect_after_chunks=rng.randint(1, 3),
        disconnect_fraction=rng.uniform(0.2, 0.8),
        conversation=conversation,
        turn=turn,
    )


def build_body(config: SoakConfig, model: str, pool: ImagePool | VideoPool,
               plan: RequestPlan) -> bytes:
    k, c = plan.num_images, plan.conversation
    urls = [pool.variant(c * k + j).data_url() for j in range(k)]
    kind = "video" if isinstance(pool, VideoPool) else "image"

    def user_text(turn: int) -> str:
        if turn:
            return f"Request {c}.{turn}: and what else?"
        task = f"describe the {kind}s" if k else "write a short story about a lighthouse"
        return f"Request {c}: {task}."

    messages = conversation_messages(urls, plan.turn, user_text,
                                     lambda turn: words(f"{config.seed}/{c}/{turn}", 24), kind)
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": config.max_tokens,
        "stream": config.stream,
        **(config.extra_body or {}),
    }
    return json.dumps(body).encode()


class StreamFailure(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class LoadGenerator:
    """Runs the load: `concurrency` workers take request indices until a stop condition."""

    def __init__(
        self,
        config: SoakConfig,
        url: str,
        model: str,
        pool: ImagePool | VideoPool,
        headers: dict[str, str] | None = None,
        on_finish: Callable[[LoadStats], None] | None = None,
        should_stop: Callable[[], str | None] | None = None,
    ):
        self.config = config
        self.url = url.rstrip("/") + "/v1/chat/completions"
        self.model = model
        self.pool = pool
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.on_finish = on_finish
        self.should_stop = should_stop
        self.stats = LoadStats()
        self._next_index = 0
        self._deadline: float | None = None
        self._latency_s = 0.2  # running estimate of a non-streamed request's latency
        self._timeout = httpx.Timeout(config.request_timeout_s)
        self._ssl_context = httpx.create_ssl_context()  # made once: it costs ~80 ms of CPU

    def counts(self) -> tuple[int, int]:
        return self.stats.finished, self.stats.in_flight

    def _stopping(self) -> bool:
        """Whether the load must end now: its planned end, or `_interrupted()`."""
        requests = self.config.requests
        return (requests is not None and self._next_index >= requests) or self._interrupted()

    def _interrupted(self) -> bool:
        """Whether the load must end before its planned number of requests (setting
        stats.stop_reason unless the time is up)."""
        stats, config = self.stats, self.config
        if stats.stop_reason is not None:
            return True
        if self._deadline is not None and time.monotonic() >= self._deadline:
            return True
        if stats.errors >= config.max_errors:
            stats.stop_reason = f"stopped after {stats.errors} unexpected errors"
            return True
        reason = self.should_stop() if self.should_stop else None
        if reason is not None:
            stats.stop_reason = reason
            return True
        return False

    def _take_conversation(self) -> range | None:
        """The request indices of the next conversation (one request without --turns), cut
        at --requests; None when the load is over."""
        if self._stopping():
            return None
        first = self._next_index
        end = first + self.config.turns
        if self.config.requests is not None:
            end = min(end, self.config.requests)
        self._next_index = end
        return range(first, end)

    async def run(self) -> LoadStats:
        config = self.config
        limits = httpx.Limits(max_connections=config.concurrency,
                              max_keepalive_connections=config.concurrency)
        # A pool wait past POOL_TIMEOUT_S means a lost pool slot: an error, never a hang.
        timeout = self._timeout = httpx.Timeout(config.request_timeout_s, connect=10.0,
                                                pool=POOL_TIMEOUT_S)
        self.stats.started_at = time.monotonic()
        if config.duration_s is not None:
            self._deadline = self.stats.started_at + config.duration_s
        try:
            async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=self.headers,
                                         verify=self._ssl_context) as client:
                workers = [asyncio.create_task(self._worker(client))
                           for _ in range(config.concurrency)]
                try:
                    await asyncio.gather(*workers)
                finally:
                    for task in workers:
                        task.cancel()
                    await asyncio.gather(*workers, return_exceptions=True)
        finally:
            self.stats.ended_at = time.monotonic()
        return self.stats

    async def _worker(self, client: httpx.AsyncClient) -> None:
        while (indices := self._take_conversation()) is not None:
            for index in indices:
                if index > indices.start and self._interrupted():
                    break
                await self._request(client, index)

    async def _request(self, client: httpx.AsyncClient, index: int) -> None:
        plan = plan_request(self.config, index)
        body = await asyncio.to_thread(build_body, self.config, self.model, self.pool, plan)
        self.stats.sent += 1
        self.stats.in_flight += 1
        try:
            outcome = await self._send(client, plan, body)
        except StreamFailure as failure:
            self.stats.record_error(index, failure.kind, str(failure))
        except httpx.TimeoutException as err:
            self.stats.record_error(index, "timeout", repr(err))
        except httpx.TransportError as err:
            self.stats.record_error(index, "connection", repr(err))
        except httpx.HTTPError as err:
            self.stats.record_error(index, type(err).__name__, repr(err))
        else:
            if outcome == "ok":
                self.stats.ok += 1
            elif outcome == "disconnect":
                self.stats.disconnects += 1
            else:
                self.stats.rejected += 1
        finally:
            del body
            self.stats.in_flight -= 1
            self.stats.finished += 1
        if self.on_finish is not None:
            self.on_finish(self.stats)

    async def _send(self, client: httpx.AsyncClient, plan: RequestPlan, body: bytes) -> str:
        if self.config.stream:
            return await self._send_streaming(client, plan, body)
        if not plan.disconnect:
            return await self._send_unary(client, body)
        # Cancelling an httpx request can strand a connection in httpcore 1.0's pool for good
        # (encode/httpcore#830): a request that will be cancelled gets a client of its own.
        async with httpx.AsyncClient(timeout=self._timeout, headers=self.headers,
                                     verify=self._ssl_context) as own:
            try:
                delay = plan.disconnect_fraction * self._latency_s
                return await asyncio.wait_for(self._send_unary(own, body), delay)
            except asyncio.TimeoutError:
                return "disconnect"

    def _check_status(self, response: httpx.Response) -> str | None:
        if response.status_code == 200:
            return None
        if response.status_code in self.config.allow_status:
            return "rejected"
        raise StreamFailure(f"HTTP {response.status_code}", response.text[:300])

    async def _send_unary(self, client: httpx.AsyncClient, body: bytes) -> str:
        started = time.monotonic()
        response = await client.post(self.url, content=body)
        if (rejected := self._check_status(response)) is not None:
            return rejected
        try:
            data = response.json()
            choices = data["choices"]
            if not choices or "message" not in choices[0]:
                raise ValueError("no choice with a message")
        except (ValueError, KeyError, TypeError) as err:
            raise StreamFailure("malformed response", f"{err!r}: {response.text[:200]}") from None
        self._latency_s = 0.8 * self._latency_s + 0.2 * (time.monotonic() - started)
        return "ok"

    async def _send_streaming(self, client: httpx.AsyncClient, plan: RequestPlan,
                              body: bytes) -> str:
        async with client.stream("POST", self.url, content=body) as response:
            if response.status_code != 200:
                await response.aread()
                return self._check_status(response) or "rejected"
            chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event/id fields
                data = line[5:].strip()
                if data == "[DONE]":
                    return "ok"
                chunks += 1
                _check_chunk(data)
                if plan.disconnect and chunks >= plan.disconnect_after_chunks:
                    return "disconnect"  # leaving the block closes the connection mid-stream
        raise StreamFailure("incomplete stream", f"ended after {chunks} chunks without [DONE]")


def parse_chunk(data: str) -> dict:
    """One SSE `data:` payload -> its JSON object; StreamFailure if it is not one or carries
    an error."""
    try:
        chunk = json.loads(data)
    except ValueError:
        raise StreamFailure("malformed SSE", f"not JSON: {data[:200]!r}") from None
    if not isinstance(chunk, dict):
        raise StreamFailure("malformed SSE", f"not an object: {data[:200]!r}")
    if "error" in chunk:
        raise StreamFailure("stream error", json.dumps(chunk["error"])[:300])
    return chunk


def _check_chunk(data: str) -> None:
    chunk = parse_chunk(data)
    if not isinstance(chunk.get("choices"), list):
        raise StreamFailure("malformed SSE", f"no choices: {data[:200]!r}")
