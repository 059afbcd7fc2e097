"""The load: warm-up requests, then the measured ones, in a closed loop (a fixed number of
workers) or an open loop (Poisson arrivals, optionally capped in flight)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import aiohttp

from flatserve.bench.config import BenchConfig
from flatserve.bench.request import RequestResult, send_request
from flatserve.bench.schedule import arrival_offsets


class Load:
    """Sends pre-built bodies to `url` (…/v1/chat/completions) as `config` says."""

    def __init__(self, config: BenchConfig, url: str, headers: dict[str, str],
                 on_finish: Callable[[RequestResult], None] | None = None):
        self.config = config
        self.url = url
        self.headers = {"Content-Type": "application/json", **headers}
        self.on_finish = on_finish

    async def run(self, warmup: list[bytes], measured: list[bytes],
                  during: AbstractContextManager,
                  ) -> tuple[list[RequestResult], list[RequestResult]]:
        """(warm-up results, measured results); `during` is entered for the measured part."""
        config = self.config
        limit = config.concurrency
        connector = aiohttp.TCPConnector(limit=limit or 0)  # 0: no limit (open loop)
        # like httpx's: a limit on connecting and on each wait for bytes, not on the stream
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.request_timeout_s,
                                        sock_read=config.request_timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                         headers=self.headers, read_bufsize=1 << 20) as client:
            warm = await self._closed_loop(client, warmup, limit or len(warmup), count=False)
            with during:
                if config.request_rate is None:
                    results = await self._closed_loop(client, measured, limit or len(measured))
                else:
                    results = await self._open_loop(client, measured, config.request_rate)
        return warm, results

    async def _send(self, client: aiohttp.ClientSession, body: bytes, count: bool = True,
                    ) -> RequestResult:
        result = await send_request(client, self.url, body)
        if count and self.on_finish is not None:
            self.on_finish(result)
        return result

    async def _closed_loop(self, client: aiohttp.ClientSession, bodies: list[bytes],
                           workers: int, count: bool = True) -> list[RequestResult]:
        """`workers` tasks, each sending the next body when its previous request ends."""
        results: list[RequestResult | None] = [None] * len(bodies)
        queue = iter(range(len(bodies)))

        async def worker() -> None:
            for i in queue:
                results[i] = await self._send(client, bodies[i], count)

        await asyncio.gather(*(worker() for _ in range(min(workers, len(bodies)))))
        return results  # type: ignore[return-value]  # every slot is filled

    async def _open_loop(self, client: aiohttp.ClientSession, bodies: list[bytes],
                         rate: float) -> list[RequestResult]:
        """Each body sent at its Poisson arrival time; with a concurrency cap, a request whose
        time has come waits for a free slot and is timed from when it is sent."""
        cap = self.config.concurrency
        slots = asyncio.Semaphore(cap) if cap is not None else contextlib.nullcontext()

        async def send(body: bytes) -> RequestResult:
            async with slots:
                return await self._send(client, body)

        start = time.perf_counter()
        tasks = []
        for body, offset in zip(bodies, arrival_offsets(len(bodies), rate, self.config.seed),
                                strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(body)))
        return list(await asyncio.gather(*tasks))
