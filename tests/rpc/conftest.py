from __future__ import annotations

import multiprocessing as mp
import os
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

# Spawned server processes import the test app by module name; spawn hands sys.path down.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rpc_test_app import Observed, make_server  # noqa: E402

from rpc import Codec, IpcDir, RpcClient, RpcServer
from shared.messages import WIRE_TYPES


@pytest.fixture
def ipc_dir() -> Iterator[IpcDir]:
    with IpcDir(prefix="rpc-test-") as d:
        yield d


@pytest.fixture
def codec() -> Codec:
    return Codec(WIRE_TYPES)


@pytest.fixture
def obs() -> Observed:
    return Observed()


@pytest.fixture
async def server(ipc_dir: IpcDir, codec: Codec, obs: Observed) -> AsyncIterator[RpcServer]:
    server = make_server(ipc_dir.address("app"), codec, obs)
    await server.start()
    yield server
    await server.close()


@pytest.fixture
async def client(server: RpcServer, codec: Codec) -> AsyncIterator[RpcClient]:
    client = RpcClient(server.address, codec)
    await client.wait_ready(5)
    yield client
    await client.close()


@pytest.fixture
def spawn() -> Iterator[Any]:
    """Start `target(*args, ready_event)` in a spawned process; waits for ready; kills all
    such processes at teardown."""
    ctx = mp.get_context("spawn")
    procs: list[Any] = []

    def start(target: Any, *args: Any, timeout: float = 30.0) -> Any:
        ready = ctx.Event()
        proc = ctx.Process(target=target, args=(*args, ready), daemon=True)
        proc.start()
        procs.append(proc)
        assert ready.wait(timeout), f"{target.__name__} did not get ready"
        return proc

    yield start
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
