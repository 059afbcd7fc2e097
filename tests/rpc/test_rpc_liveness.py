"""Liveness with real processes: a killed or frozen server fails every pending call and
stream fast with ServerUnavailable, new calls fail fast until a server answers again, and a
killed client's streams are closed on the server."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

from rpc_test_app import (
    Observed,
    make_server,
    serve_in_process,
    stream_and_consume,
    stream_then_hang,
)

from rpc import Codec, IpcDir, RpcClient, ServerUnavailable


async def _fail_time(aw: Any) -> tuple[float, BaseException | None]:
    t0 = time.monotonic()
    try:
        await aw
    except BaseException as e:  # noqa: BLE001 - the test inspects it
        return time.monotonic() - t0, e
    return time.monotonic() - t0, None


async def _drain(it: Any) -> None:
    async for _ in it:
        pass


async def test_killed_server_fails_everything_fast_then_recovers(
    ipc_dir: IpcDir, codec: Codec, spawn: Any
) -> None:
    address = ipc_dir.address("killed")
    proc = spawn(serve_in_process, address)
    client = RpcClient(address, codec)
    try:
        await client.wait_ready(10)
        server_pid = await client.call("pid")
        assert server_pid == proc.pid
        it = client.stream("count", "s", 10**9, 0.005)
        assert await it.__anext__() == 0
        pending = [
            asyncio.ensure_future(_fail_time(_drain(it))),
            asyncio.ensure_future(_fail_time(client.call("sleep", "u", 60.0))),
            asyncio.ensure_future(_fail_time(_drain(client.stream("forever", "f")))),
        ]
        await asyncio.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*pending), 5)
        elapsed = time.monotonic() - t_kill
        for _, error in results:
            assert isinstance(error, ServerUnavailable), error
        assert elapsed < 1.5, f"took {elapsed:.2f} s to notice the dead server"
        assert not client.available

        # new calls fail fast while nobody serves
        took, error = await _fail_time(client.call("echo", 1))
        assert isinstance(error, ServerUnavailable) and took < 0.1

        # a new server on the same address: calls work again
        spawn(serve_in_process, address)
        await client.wait_ready(10)
        assert await client.call("echo", "back") == "back"
        assert [x async for x in client.stream("count", "again", 5)] == list(range(5))
    finally:
        await client.close()


async def test_frozen_server_is_caught_by_heartbeats(ipc_dir: IpcDir, codec: Codec, spawn: Any) -> None:
    """SIGSTOP keeps the connection open (no disconnect event): only heartbeats notice."""
    address = ipc_dir.address("frozen")
    proc = spawn(serve_in_process, address)
    client = RpcClient(address, codec, heartbeat_interval=0.1, heartbeat_timeout=0.5)
    try:
        await client.wait_ready(10)
        pending = asyncio.ensure_future(_fail_time(client.call("sleep", "u", 60.0)))
        await asyncio.sleep(0.1)
        os.kill(proc.pid, signal.SIGSTOP)
        took, error = await asyncio.wait_for(pending, 5)
        assert isinstance(error, ServerUnavailable) and "heartbeat" in str(error)
        assert took < 1.5
        os.kill(proc.pid, signal.SIGCONT)
        await client.wait_ready(10)
        assert await client.call("echo", 2) == 2
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        await client.close()


async def test_killed_client_streams_are_closed_on_the_server(
    ipc_dir: IpcDir, codec: Codec, spawn: Any
) -> None:
    obs = Observed()
    server = make_server(ipc_dir.address("orphans"), codec, obs, peer_timeout=0.8)
    await server.start()
    try:
        # The child reads one item and stops: its window fills, the generator suspends,
        # so only the silent-peer reaper (not a failed send) can notice the death.
        proc = await asyncio.to_thread(spawn, stream_then_hang, server.address)
        assert obs.produced["orphan"] <= 4 + 1
        assert not obs.closed_event("orphan").is_set()
        os.kill(proc.pid, signal.SIGKILL)
        await asyncio.wait_for(obs.closed_event("orphan").wait(), 3)
    finally:
        await server.close()


async def test_killed_consumer_is_noticed_at_the_next_send(ipc_dir: IpcDir, codec: Codec, spawn: Any) -> None:
    """ROUTER_MANDATORY: a send to a peer that is gone raises EHOSTUNREACH, which cancels
    that peer's streams at once (long before the silent-peer timeout)."""
    obs = Observed()
    server = make_server(ipc_dir.address("unreachable"), codec, obs, peer_timeout=30.0)
    await server.start()
    try:
        proc = await asyncio.to_thread(spawn, stream_and_consume, server.address)
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        await asyncio.wait_for(obs.closed_event("consumer").wait(), 3)
        assert time.monotonic() - t0 < 2.0  # the silent-peer timeout is 30 s
    finally:
        await server.close()


async def test_client_without_server_waits_then_fails(ipc_dir: IpcDir, codec: Codec) -> None:
    client = RpcClient(ipc_dir.address("nobody"), codec, connect_timeout=0.3)
    try:
        took, error = await _fail_time(client.call("echo", 1))
        assert isinstance(error, ServerUnavailable) and 0.3 <= took < 1.0
    finally:
        await client.close()
