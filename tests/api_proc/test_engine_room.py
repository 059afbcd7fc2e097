"""Flow control on the API side: an engine holds at most stats.max_requests; past that,
requests wait in the API (holding their admission bytes) until one ends, or get a 503."""

from __future__ import annotations

import asyncio

import pytest

from api_proc.engine_client import EngineClient, EngineConnection, RequestStream
from api_proc.errors import EngineUnavailable
from shared.messages import EngineStats, RequestOutput


def engine(name: str, max_requests: int) -> EngineConnection:
    connection = EngineConnection(f"ipc:///tmp/{name}.sock")
    connection.lost_reason = None  # answering, as far as routing is concerned
    connection.stats = EngineStats(0, 0, 1, 1, 0, 0, max_requests)
    return connection


async def test_a_full_engine_is_skipped_while_another_has_room() -> None:
    full, free = engine("full", 1), engine("free", 1)
    client = EngineClient([full, free])
    held = RequestStream(full, "r0", 10, 10, None)
    assert client.pick() is free
    await client.wait_for_room(0.1)  # returns at once: `free` has room
    assert held.request_id in full.streams


async def test_requests_wait_for_room_then_go_on() -> None:
    only = engine("only", 1)
    client = EngineClient([only])
    held = RequestStream(only, "r0", 10, 10, None)
    waiter = asyncio.ensure_future(client.wait_for_room(5))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    held._push(RequestOutput("r0", [1], "stop"))  # the engine finished it
    await asyncio.wait_for(waiter, 1)
    assert client.pick().has_room


async def test_waiting_for_room_times_out_with_a_503() -> None:
    only = engine("busy", 1)
    client = EngineClient([only])
    held = RequestStream(only, "r0", 10, 10, None)
    with pytest.raises(EngineUnavailable) as e:
        await client.wait_for_room(0.1)
    assert e.value.status == 503 and e.value.code == "engine_busy"
    assert held.request_id in only.streams
