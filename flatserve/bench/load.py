"""The load: warm-up units, then the measured ones, in a closed loop (a fixed number of
workers) or an open loop (Poisson arrivals, optionally capped in flight). A unit is one
request, or a conversation whose turns go one after another (bench/workload.py)."""

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

    async def run(self, warmup: list[list[bytes]], measured: list[list[bytes]],
                  during: AbstractContextManager,
                  ) -> tuple[list[RequestResult], list[RequestResult]]:
        """(warm-up results, measured results), unit after unit, each unit's in turn order;
        `during` is entered for the measured part."""
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

    async def _send_unit(self, client: aiohttp.ClientSession, unit: list[bytes],
                         count: bool = True) -> list[RequestResult]:
        """The unit's requests one after another, each sent when the one before has ended."""
        results = []
        for turn, body in enumerate(unit):
            result = await send_request(client, self.url, body)
            result.turn = turn
            if count and self.on_finish is not None:
                self.on_finish(result)
            results.append(result)
        return results

    async def _closed_loop(self, client: aiohttp.ClientSession, units: list[list[bytes]],
                           workers: int, count: bool = True) -> list[RequestResult]:
        """`workers` tasks, each sending the next unit when its previous one ends."""
        results: list[list[RequestResult]] = [[] for _ in units]
        queue = iter(range(len(units)))

        async def worker() -> None:
            for i in queue:
                results[i] = await self._send_unit(client, units[i], count)

        await asyncio.gather(*(worker() for _ in range(min(workers, len(units)))))
        return [r for unit in results for r in unit]

    async def _open_loop(self, client: aiohttp.ClientSession, units: list[list[bytes]],
                         rate: float) -> list[RequestResult]:
        """Each unit started at its Poisson arrival time; with a concurrency cap, a unit whose
        time has come waits for a free slot, and each request is timed from when it is sent."""
        cap = self.config.concurrency
        slots = asyncio.Semaphore(cap) if cap is not None else contextlib.nullcontext()

        async def send(unit: list[bytes]) -> list[RequestResult]:
            async with slots:
                return await self._send_unit(client, unit)

        start = time.perf_counter()
        tasks = []
        for unit, offset in zip(units, arrival_offsets(len(units), rate, self.config.seed),
                                strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(unit)))
        return [r for unit in await asyncio.gather(*tasks) for r in unit]
