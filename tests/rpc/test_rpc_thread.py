"""The engine's arrangement: RpcServer on a LoopThread, fed by a synchronous busy loop in the
main thread through `call_soon`, with a client on another thread."""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from rpc import Codec, IpcDir, LoopThread, RpcClient, RpcServer
from shared.messages import RequestOutput


def test_server_on_a_loop_thread_fed_by_a_busy_loop(ipc_dir: IpcDir, codec: Codec) -> None:
    inbox: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
    streams: dict[str, asyncio.Queue[RequestOutput]] = {}

    async def generate(request_id: str, max_tokens: int) -> AsyncIterator[RequestOutput]:
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        streams[request_id] = outputs
        inbox.put((request_id, max_tokens))
        try:
            while True:
                output = await outputs.get()
                yield output
                if output.finish_reason is not None:
                    return
        finally:
            streams.pop(request_id, None)

    def dispatch(outputs: list[RequestOutput]) -> None:  # runs on the server's loop
        for output in outputs:
            streams[output.request_id].put_nowait(output)

    with LoopThread(name="engine-io") as io:
        server = RpcServer(ipc_dir.address("engine"), codec)
        server.register_stream("generate", generate)
        io.run(server.start())
        with LoopThread(name="api") as api:
            client = RpcClient(server.address, codec)

            async def consume(request_id: str, n: int) -> list[int]:
                return [out.new_token_ids[0] async for out in client.stream("generate", request_id, n)]

            futures = [api.submit(consume(f"r{i}", 10 + i)) for i in range(16)]
            running: dict[str, list[int]] = {}
            deadline = time.monotonic() + 20
            while not all(f.done() for f in futures):  # the engine's busy loop
                assert time.monotonic() < deadline, "busy loop did not finish"
                while not inbox.empty():
                    request_id, n = inbox.get()
                    running[request_id] = [0, n]
                step_outputs = []
                for request_id, state in list(running.items()):
                    state[0] += 1
                    done = state[0] == state[1]
                    step_outputs.append(RequestOutput(request_id, [state[0]], "length" if done else None))
                    if done:
                        del running[request_id]
                if step_outputs:
                    server.call_soon_threadsafe(dispatch, step_outputs)  # one step, one callback
                time.sleep(0.002)  # the model step
            for i, future in enumerate(futures):
                assert future.result() == list(range(1, 11 + i))
            api.run(client.close())
        io.run(server.close())


def test_loop_thread_run_and_call_soon() -> None:
    with LoopThread() as lt:
        assert lt.run(asyncio.sleep(0, "x")) == "x"
        seen: list[Any] = []
        lt.call_soon(seen.append, 1)
        lt.run(asyncio.sleep(0.01))
        assert seen == [1]

        async def nested() -> None:
            lt.run(asyncio.sleep(0))

        with pytest.raises(RuntimeError, match="deadlock"):
            lt.run(nested())
