"""Handlers the rpc tests serve, in-process or in a spawned server process.

Module name is unique on purpose: spawned children import it by name (tests/rpc is on the
parent's sys.path, which multiprocessing's spawn hands down).
"""

from __future__ import annotations

import asyncio
import os
import signal
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from rpc import Codec, LoopThread, RpcClient, RpcServer
from shared.messages import WIRE_TYPES


class AppError(Exception):
    """A custom exception type, to check that remote type names are qualified."""


@dataclass
class Observed:
    """What in-process handlers report back to the test."""

    closed: dict[Any, asyncio.Event] = field(default_factory=dict)  # stream tag -> finally ran
    cancelled: dict[Any, asyncio.Event] = field(default_factory=dict)
    produced: dict[Any, int] = field(default_factory=dict)
    refs: dict[Any, weakref.ref] = field(default_factory=dict)

    def closed_event(self, tag: Any) -> asyncio.Event:
        return self.closed.setdefault(tag, asyncio.Event())

    def cancelled_event(self, tag: Any) -> asyncio.Event:
        return self.cancelled.setdefault(tag, asyncio.Event())


def make_server(address: str, codec: Codec, obs: Observed | None = None, **kwargs: Any) -> RpcServer:
    obs = obs if obs is not None else Observed()
    server = RpcServer(address, codec, **kwargs)

    async def echo(*args: Any) -> Any:
        return args[0] if len(args) == 1 else args

    async def boom(message: str) -> None:
        raise ValueError(message)

    async def app_error() -> None:
        raise AppError("custom failure")

    async def unencodable() -> Any:
        return object()

    async def sleep(tag: Any, seconds: float) -> float:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            obs.cancelled_event(tag).set()
            raise
        return seconds

    async def describe(arr: Any) -> dict[str, Any]:
        """How the server received an array: zero-copy over a zmq frame or not."""
        base = arr
        while isinstance(base, np.ndarray):
            base = base.base
        return {
            "type": type(arr).__name__,
            "owndata": bool(arr.flags.owndata),
            "over_zmq_frame": isinstance(base, memoryview) and isinstance(base.obj, zmq.Frame),
            "sum": int(arr.sum()),
        }

    async def keep_ref(tag: Any, arr: Any) -> int:
        obs.refs[tag] = weakref.ref(arr)
        return int(arr.nbytes)

    async def count(tag: Any, n: int, delay: float = 0.0) -> AsyncIterator[int]:
        try:
            for i in range(n):
                if delay:
                    await asyncio.sleep(delay)
                obs.produced[tag] = i + 1
                yield i
        finally:
            obs.closed_event(tag).set()

    async def tagged(tag: Any, n: int) -> AsyncIterator[tuple[Any, int]]:
        for i in range(n):
            await asyncio.sleep(0)  # let the other streams interleave
            yield (tag, i)

    async def forever(tag: Any) -> AsyncIterator[int]:
        i = 0
        try:
            while True:
                obs.produced[tag] = i + 1
                yield i
                i += 1
                if i % 64 == 0:
                    await asyncio.sleep(0)
        finally:
            obs.closed_event(tag).set()

    async def fail_after(n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i
        raise RuntimeError(f"stream broke after {n} items")

    async def hold_payload(tag: Any, arr: Any) -> AsyncIterator[int]:
        """R1: drops its own reference after the first item; the test checks that nothing
        else (the server's call state, the task) kept one."""
        obs.refs[tag] = weakref.ref(arr)
        nbytes = int(arr.nbytes)
        arr = None  # noqa: F841
        try:
            yield nbytes
            while True:
                await asyncio.sleep(0.01)
                yield 0
        finally:
            obs.closed_event(tag).set()

    async def pid() -> int:
        return os.getpid()

    for fn in (echo, boom, app_error, unencodable, sleep, describe, keep_ref, pid):
        server.register_unary(fn.__name__, fn)
    for fn in (count, tagged, forever, fail_after, hold_payload):
        server.register_stream(fn.__name__, fn)
    return server


def serve_in_process(address: str, ready: Any) -> None:
    """Spawned child: serve the test app until killed."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with LoopThread() as lt:
        server = make_server(address, Codec(WIRE_TYPES), peer_timeout=2.0)
        lt.run(server.start())
        ready.set()
        signal.pause()


def stream_then_hang(address: str, ready: Any) -> None:
    """Spawned child: a client that starts a stream, reads one item, then stops reading
    (its window fills and the server generator suspends) until it is killed."""

    async def main() -> None:
        client = RpcClient(address, Codec(WIRE_TYPES), stream_window=4)
        it = client.stream("forever", "orphan")
        await it.__anext__()
        ready.set()
        await asyncio.sleep(3600)

    asyncio.run(main())


def stream_and_consume(address: str, ready: Any) -> None:
    """Spawned child: a client that keeps consuming a never-ending stream until killed."""

    async def main() -> None:
        client = RpcClient(address, Codec(WIRE_TYPES))
        first = True
        async for _ in client.stream("count", "consumer", 10**12, 0.002):
            if first:
                ready.set()
                first = False

    asyncio.run(main())


def payload(nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, size=nbytes, dtype=np.uint8)
