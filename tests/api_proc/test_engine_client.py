from __future__ import annotations

import asyncio

import pytest

from api_proc.engine_client import EngineClient, EngineHandle
from api_proc.errors import BadRequestError, EngineError, EngineUnavailableError
from rpc import RemoteError
from shared.messages import GenerateRequest, RequestOutput
from shared.sampling_params import SamplingParams


class FakeRpcStream:
    def __init__(self, outputs):
        self.outputs = list(outputs)
        self.closed = False

    async def __anext__(self):
        await asyncio.sleep(0)
        if self.closed or not self.outputs:
            raise StopAsyncIteration
        item = self.outputs.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self):
        self.closed = True


class FakeRpc:
    """Routing-logic double: records calls, replays scripted outputs."""

    def __init__(self, available=True):
        self.available = available
        self.streams: list[tuple[str, FakeRpcStream]] = []
        self.calls: list[tuple] = []
        self.script = None

    def stream(self, method, request):
        rid = request.request_id
        outputs = self.script(rid) if self.script else [
            RequestOutput(rid, [1], None), RequestOutput(rid, [2], "length")]
        s = FakeRpcStream(outputs)
        self.streams.append((rid, s))
        return s

    async def call(self, method, *args, timeout=None):
        self.calls.append((method, *args))
        return {"status": "ok"}

    async def wait_ready(self, timeout=None):
        pass

    async def close(self):
        pass


class DeadProcess:
    returncode = -9

    def poll(self):
        return -9


def _req(rid: str, prompt_len: int = 10, max_tokens: int = 5) -> GenerateRequest:
    return GenerateRequest(rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens))


async def test_routes_to_the_least_outstanding_work():
    a, b = EngineHandle("a", FakeRpc()), EngineHandle("b", FakeRpc())
    client = EngineClient([a, b])
    big = client.submit(_req("big", prompt_len=1000))
    small = [client.submit(_req(f"s{i}", prompt_len=10)) for i in range(3)]
    assert big.engine is not small[0].engine
    assert all(s.engine is small[0].engine for s in small)  # 3 small ones < 1 big one
    assert client.num_in_flight == 4
    for s in (big, *small):
        async for _ in s:
            pass
    assert a.num_requests == b.num_requests == 0
    assert a.num_tokens == b.num_tokens == 0


async def test_ties_are_broken_round_robin():
    engines = [EngineHandle(str(i), FakeRpc()) for i in range(3)]
    client = EngineClient(engines)
    picked = []
    for i in range(6):
        s = client.submit(_req(f"r{i}"))
        picked.append(s.engine.address)
        await s.aclose()
    assert sorted(set(picked)) == ["0", "1", "2"]


async def test_dead_and_unavailable_engines_are_skipped():
    dead = EngineHandle("dead", FakeRpc(), process=DeadProcess())
    down = EngineHandle("down", FakeRpc(available=False))
    up = EngineHandle("up", FakeRpc())
    client = EngineClient([dead, down, up])
    assert all(client.submit(_req(f"r{i}")).engine is up for i in range(3))
    with pytest.raises(EngineUnavailableError, match="exited with code -9"):
        EngineClient([dead, down]).pick()
    with pytest.raises(EngineUnavailableError, match="no engine is configured"):
        EngineClient([]).pick()
    health = await EngineClient([dead, up]).health()
    assert [h["ok"] for h in health] == [False, True]


async def test_aclose_aborts_in_the_engine():
    rpc = FakeRpc()
    rpc.script = lambda rid: [RequestOutput(rid, [1], None)] * 5
    client = EngineClient([EngineHandle("a", rpc)])
    stream = client.submit(_req("x"))
    await stream.__anext__()
    await stream.aclose()
    await asyncio.sleep(0.01)
    assert rpc.streams[0][1].closed
    assert ("abort", "x") in rpc.calls
    assert client.num_in_flight == 0
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()


@pytest.mark.parametrize("failure, error, match", [
    (RemoteError("RuntimeError", "RequestRejected: prompt too long"), BadRequestError, "prompt too long"),
    (RemoteError("RuntimeError", "RequestRejected: engine queue is full (4 waiting)"),
     EngineUnavailableError, "queue is full"),
    (RemoteError("RuntimeError", "CUDA error"), EngineError, "CUDA error"),
])
async def test_remote_errors_map_to_api_errors(failure, error, match):
    rpc = FakeRpc()
    rpc.script = lambda rid: [failure]
    client = EngineClient([EngineHandle("a", rpc)])
    with pytest.raises(error, match=match) as e:
        async for _ in client.generate(_req("x")):
            pass
    assert e.value.__context__ is None  # rebuilt from text, nothing chained
    assert client.num_in_flight == 0


async def test_error_output_and_missing_finish():
    rpc = FakeRpc()
    rpc.script = lambda rid: [RequestOutput(rid, [], "error", error="boom")]
    client = EngineClient([EngineHandle("a", rpc)])
    with pytest.raises(EngineError, match="boom"):
        async for _ in client.submit(_req("x")):
            pass
    rpc.script = lambda rid: [RequestOutput(rid, [1], None)]
    with pytest.raises(EngineError, match="without a finish reason"):
        async for _ in client.submit(_req("y")):
            pass
    assert client.num_in_flight == 0


async def test_engine_process_death_fails_the_stream_with_503(fresh_engine_double, tiny_model_path):
    client = EngineClient.connect([fresh_engine_double.address])
    await client.start()
    try:
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(tiny_model_path / "tokenizer.json")).encode("[[hang]]").ids
        stream = client.submit(GenerateRequest("dies", ids, SamplingParams(max_tokens=10)))
        await stream.__anext__()
        fresh_engine_double.kill()
        with pytest.raises(EngineUnavailableError):
            await asyncio.wait_for(stream.__anext__(), 10)
        assert client.num_in_flight == 0
        health = await client.health()
        assert not health[0]["ok"] and health[0]["reason"]
        with pytest.raises(EngineUnavailableError):
            client.pick()
    finally:
        await client.close()


async def test_dropped_unconsumed_stream_settles_its_counters():
    rpc = FakeRpc()
    client = EngineClient([EngineHandle("a", rpc)])
    client.submit(_req("dropped"))  # never iterated, never closed
    import gc

    gc.collect()
    assert client.num_in_flight == 0 and client.engines[0].num_tokens == 0
    await asyncio.sleep(0.01)
    assert ("abort", "dropped") in rpc.calls
