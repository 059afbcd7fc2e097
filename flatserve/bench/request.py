"""One streamed chat request, timed token by token from its SSE stream (or chunk by chunk,
from a server whose chunks carry no token counts).

The load goes through aiohttp: on two cores a client's CPU is taken from the server it
measures, and aiohttp reads an SSE event for about a third of what httpx spends."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import aiohttp

from flatserve.soak.load import StreamFailure, parse_chunk

ERROR_HEAD = 300  # characters of an error body kept


@dataclass
class RequestResult:
    sent_at: float  # time.perf_counter()
    turn: int = 0  # its place in a multi-turn conversation (0: the first, or no conversation)
    ended_at: float = 0.0
    ok: bool = False
    ttft_s: float | None = None  # None: no token (or content) came
    itl_s: list[float] = field(default_factory=list)  # gaps between tokens (or content chunks)
    per_token: bool = False  # timed by token (usage in every chunk), else by content chunk
    content_chunks: int = 0
    completion_tokens: int | None = None  # from usage, when the server sends it
    prompt_tokens: int | None = None
    error_kind: str | None = None
    error: str | None = None

    @property
    def e2e_s(self) -> float:
        return self.ended_at - self.sent_at

    @property
    def output_tokens(self) -> int:
        return self.content_chunks if self.completion_tokens is None else self.completion_tokens

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def fail(self, kind: str, message: str) -> None:
        self.error_kind, self.error = kind, message[:ERROR_HEAD]


async def send_request(session: aiohttp.ClientSession, url: str, body: bytes) -> RequestResult:
    """POST `body` to `url` and read its stream to [DONE]; failures are recorded in the result,
    never raised."""
    result = RequestResult(sent_at=time.perf_counter())
    try:
        async with session.post(url, data=body) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                raise StreamFailure(f"HTTP {response.status}", f"HTTP {response.status}: {text}")
            await _read_stream(response, result)
        result.ok = True
    except StreamFailure as err:
        result.fail(err.kind, str(err))
    except TimeoutError as err:  # aiohttp's timeouts are TimeoutErrors too
        result.fail("timeout", repr(err))
    except aiohttp.ClientConnectionError as err:
        result.fail("connection", repr(err))
    except aiohttp.ClientError as err:
        result.fail(type(err).__name__, repr(err))
    result.ended_at = time.perf_counter()
    return result


@dataclass
class _Arrivals:
    """When a stream's tokens (or content chunks) reached the client: the first after the
    send, then the gap before each of the others. Tokens that come in one chunk came
    together: after the first, their gaps are 0 (a server that holds tokens back and sends
    them in bursts shows as bursts)."""

    sent_at: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    last_at: float | None = None

    def add(self, now: float, n: int = 1) -> None:
        if self.last_at is None:
            self.ttft_s = now - self.sent_at
        else:
            self.itl_s.append(now - self.last_at)
        self.itl_s += [0.0] * (n - 1)
        self.last_at = now


async def _read_stream(response: aiohttp.ClientResponse, result: RequestResult) -> None:
    """Read to [DONE], or to the end of a stream whose last choice chunk had a
    finish_reason: servers such as `transformers serve` omit [DONE], and the openai client
    accepts that too.

    Latencies are per token where the chunks carry usage (vLLM's continuous_usage_stats):
    each chunk's new completion tokens arrived with it, whatever text they decode to (a
    token may have none yet, or none at all). Otherwise they are per content chunk."""
    tokens, chunks = _Arrivals(result.sent_at), _Arrivals(result.sent_at)
    num_timed = 0  # completion tokens seen in the usage of choice chunks
    finished = False
    async for raw in response.content:  # one line at a time
        if not raw.startswith(b"data:"):
            continue  # blank separators, comments, event/id fields
        now = time.perf_counter()
        data = raw[5:].strip().decode()
        if data == "[DONE]":
            break
        chunk = parse_chunk(data)
        finished = _finished(chunk, finished)
        if usage := chunk.get("usage"):
            result.completion_tokens = usage.get("completion_tokens")
            result.prompt_tokens = usage.get("prompt_tokens")
            count = result.completion_tokens
            if chunk.get("choices") and isinstance(count, int) and count > num_timed:
                tokens.add(now, count - num_timed)
                num_timed = count
        if _has_content(chunk):
            chunks.add(now)
            result.content_chunks += 1
    else:
        if not finished:
            raise StreamFailure("incomplete stream",
                               f"the stream ended after {result.content_chunks} content "
                               "chunks without [DONE] or a finish_reason")
    result.per_token = num_timed > 0
    timed = tokens if result.per_token else chunks
    result.ttft_s, result.itl_s = timed.ttft_s, timed.itl_s


def _finished(chunk: dict, finished: bool) -> bool:
    """Whether the stream has ended its choice, after this chunk."""
    for choice in chunk.get("choices") or ():
        finished = choice.get("finish_reason") is not None
    return finished


def _has_content(chunk: dict) -> bool:
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content"):
            return True
    return False
