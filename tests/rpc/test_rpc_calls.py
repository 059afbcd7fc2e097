"""Unary and streaming calls over real sockets: results, typed remote errors, deadlines,
cancellation in every form, flow control, coalescing, no message loss at the high-water
mark, and payload references dropped after handoff (R1)."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from typing import Any

import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio
from rpc_test_app import Observed, make_server, payload

from rpc import (
    ClientClosed,
    Codec,
    DeadlineExceeded,
    EncodeError,
    IpcDir,
    RemoteError,
    RpcClient,
    RpcServer,
    ServerUnavailable,
)
from rpc import protocol as p
from rpc.outbox import Outbox
from rpc.sockets import SocketReader, make_socket
from shared.messages import GenerateRequest, ImageInput, RequestOutput
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("no_garbage_collector")


async def wait_until(predicate: Any, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.005)


async def wait_collected(ref: Any, timeout: float = 2.0) -> None:
    """zmq releases a zero-copy frame's buffer from its own thread once sent."""
    await wait_until(lambda: ref() is None, timeout)


# -- unary --------------------------------------------------------------------------------


async def test_unary_roundtrip_of_wire_types(client: RpcClient) -> None:
    pixels = payload(224 * 224 * 3).reshape(224, 224, 3)
    req = GenerateRequest("r", [1, 2], SamplingParams(stop_token_ids=(7,)), [ImageInput(pixels, (1, 16, 16))])
    got = await client.call("echo", req)
    assert type(got) is GenerateRequest and got.sampling == req.sampling
    assert np.array_equal(got.images[0].pixels, pixels)
    value = {"t": torch.randn(3, 5).to(torch.bfloat16), "x": (1, [2.5, None]), "b": b"\x00" * 9}
    got = await client.call("echo", value)
    assert torch.equal(got["t"], value["t"]) and got["x"] == (1, [2.5, None]) and got["b"] == value["b"]
    assert await client.call("echo", 1, "two", (3,)) == (1, "two", (3,))


async def test_server_receives_large_arrays_zero_copy(client: RpcClient) -> None:
    arr = payload(1 << 20)
    info = await client.call("describe", arr)
    assert info == {"type": "ndarray", "owndata": False, "over_zmq_frame": True, "sum": int(arr.sum())}


async def test_remote_errors_are_typed(client: RpcClient) -> None:
    with pytest.raises(RemoteError) as info:
        await client.call("boom", "bad input")
    err = info.value
    assert (err.type_name, err.message) == ("ValueError", "bad input")
    assert "in boom" in err.remote_traceback and "raise ValueError(message)" in err.remote_traceback
    with pytest.raises(RemoteError) as info:
        await client.call("app_error")
    assert info.value.type_name == "rpc_test_app.AppError"
    with pytest.raises(RemoteError) as info:
        await client.call("no_such_method")
    assert info.value.type_name == "UnknownMethod" and "no method 'no_such_method'" in info.value.message
    with pytest.raises(RemoteError, match="is a stream method"):
        await client.call("count", "x", 3)
    with pytest.raises(RemoteError) as info:
        await client.call("unencodable")  # the result cannot be encoded on the server
    assert info.value.type_name == "rpc.errors.EncodeError"
    assert await client.call("echo", "still serving") == "still serving"


async def test_unencodable_arguments_fail_locally(client: RpcClient) -> None:
    with pytest.raises(EncodeError, match="builtins.set"):
        await client.call("echo", {1, 2})
    assert await client.call("echo", 5) == 5


async def test_deadline_fails_the_call_and_cancels_the_handler(client: RpcClient, obs: Observed) -> None:
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await client.call("sleep", "slow", 30.0, timeout=0.2)
    assert 0.2 <= time.monotonic() - t0 < 1.5
    await asyncio.wait_for(obs.cancelled_event("slow").wait(), 2)
    assert await client.call("sleep", "fast", 0.01, timeout=2) == 0.01


async def test_server_enforces_the_deadline_itself(server: RpcServer, codec: Codec, obs: Observed) -> None:
    """Even when the client never sends its CANCEL, the server stops the work and answers."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.connect(server.address)
    try:
        env = p.pack_envelope(codec, [p.CALL, 1, "sleep", ["srv", 30.0], 0.2])
        await sock.send_multipart(p.batch_frames([env]))
        frames = await asyncio.wait_for(sock.recv_multipart(), 3)
        [(doc, bufs)] = p.split_batch(frames)
        reply = p.unpack_envelope(codec, doc, bufs)
        assert reply[0] == p.ERROR and reply[2] == p.ERR_DEADLINE
        assert isinstance(p.exception_from_error(reply), DeadlineExceeded)
        await asyncio.wait_for(obs.cancelled_event("srv").wait(), 2)
    finally:
        sock.close(0)


async def test_call_cancelled_in_the_same_batch_leaves_nothing_behind(server: RpcServer, codec: Codec) -> None:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.connect(server.address)
    try:
        batch = [
            p.pack_envelope(codec, [p.CALL, 1, "sleep", ["never", 30.0], None]),
            p.pack_envelope(codec, [p.STREAM, 2, "forever", ["never"], None, 8]),
            p.pack_envelope(codec, [p.CANCEL, 1]),
            p.pack_envelope(codec, [p.CANCEL, 2]),
        ]
        await sock.send_multipart(p.batch_frames(batch))
        await wait_until(lambda: server._peers and not any(peer.calls for peer in server._peers.values()))
    finally:
        sock.close(0)


async def test_payload_of_a_call_cancelled_before_it_ran_is_freed_without_the_collector(
    server: RpcServer, codec: Codec, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A client that disconnects at once sends the call and its cancel together: the task is
    # cancelled before its first step. Its CancelledError then holds the task's frame in a
    # reference cycle; under load the engine kept one image per such call until a full
    # collection ran (host RSS in 12 MB steps on an H100).
    received: list[weakref.ref] = []
    unpack = p.unpack_envelope

    def observe(codec: Codec, doc: Any, buffers: Any) -> list[Any]:
        envelope = unpack(codec, doc, buffers)
        if envelope[0] in (p.CALL, p.STREAM):
            received.extend(weakref.ref(a) for a in envelope[3] if isinstance(a, np.ndarray))
        return envelope

    monkeypatch.setattr(p, "unpack_envelope", observe)
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.connect(server.address)
    try:
        batch = [
            p.pack_envelope(codec, [p.STREAM, 1, "hold_payload", ["early-stream", payload(1 << 20)], None, 8]),
            p.pack_envelope(codec, [p.CALL, 2, "keep_ref", ["early-call", payload(1 << 20)], None]),
            p.pack_envelope(codec, [p.CANCEL, 1]),
            p.pack_envelope(codec, [p.CANCEL, 2]),
        ]
        await sock.send_multipart(p.batch_frames(batch))
        batch = None
        await wait_until(lambda: len(received) == 2)
        await wait_until(lambda: server._peers and not any(peer.calls for peer in server._peers.values()))
        await wait_until(lambda: all(ref() is None for ref in received))
    finally:
        sock.close(0)


async def test_cancelling_the_caller_cancels_the_handler(client: RpcClient, obs: Observed) -> None:
    task = asyncio.ensure_future(client.call("sleep", "cancel-me", 30.0))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(obs.cancelled_event("cancel-me").wait(), 2)


async def test_closed_client_and_closing_server(server: RpcServer, codec: Codec) -> None:
    client = RpcClient(server.address, codec)
    pending = asyncio.ensure_future(client.call("sleep", "x", 30.0))
    await asyncio.sleep(0.1)
    t0 = time.monotonic()
    await server.close()  # tells its callers, instead of letting them wait for heartbeats
    with pytest.raises(ServerUnavailable):
        await pending
    assert time.monotonic() - t0 < 1.0
    await client.close()
    with pytest.raises(ClientClosed):
        await client.call("echo", 1)


async def test_pipelined_calls_survive_the_high_water_mark(ipc_dir: IpcDir, codec: Codec) -> None:
    """Far more calls in flight than the HWM on either side: all answered, none lost (a
    ROUTER without ROUTER_MANDATORY drops at its HWM and this would hang)."""
    server = make_server(ipc_dir.address("hwm"), codec, hwm=20)
    await server.start()
    client = RpcClient(server.address, codec, hwm=20, max_queued_sends=500)
    try:
        results = await asyncio.gather(*(client.call("echo", i) for i in range(3000)))
        assert results == list(range(3000))
    finally:
        await client.close()
        await server.close()


async def test_tcp_transport(codec: Codec) -> None:
    server = make_server("tcp://127.0.0.1:*", codec)
    await server.start()
    assert server.address.startswith("tcp://127.0.0.1:") and not server.address.endswith("*")
    client = RpcClient(server.address, codec)
    try:
        arr = payload(3 << 20)
        assert np.array_equal(await client.call("echo", arr), arr)
        assert [x async for x in client.stream("count", "tcp", 100)] == list(range(100))
    finally:
        await client.close()
        await server.close()


# -- streams ------------------------------------------------------------------------------


async def test_stream_items_in_order(client: RpcClient) -> None:
    assert [x async for x in client.stream("count", "a", 1000)] == list(range(1000))
    assert [x async for x in client.stream("count", "empty", 0)] == []


async def test_stream_ends_with_a_remote_error(client: RpcClient) -> None:
    got = []
    with pytest.raises(RemoteError) as info:
        async for x in client.stream("fail_after", 3):
            got.append(x)
    assert got == [0, 1, 2]
    assert info.value.type_name == "RuntimeError" and "after 3 items" in info.value.message


async def test_thousand_concurrent_streams_interleave(client: RpcClient) -> None:
    async def consume(tag: int) -> list[Any]:
        return [x async for x in client.stream("tagged", tag, 12)]

    results = await asyncio.gather(*(consume(tag) for tag in range(1000)))
    for tag, items in enumerate(results):
        assert items == [(tag, i) for i in range(12)]


async def _first_items(it: Any, n: int) -> None:
    for _ in range(n):
        await it.__anext__()


async def test_aclose_closes_the_server_generator(client: RpcClient, obs: Observed) -> None:
    it = client.stream("forever", "aclose")
    await _first_items(it, 3)
    await it.aclose()
    await asyncio.wait_for(obs.closed_event("aclose").wait(), 2)
    with pytest.raises(StopAsyncIteration):
        await it.__anext__()


async def test_break_and_drop_closes_the_server_generator(client: RpcClient, obs: Observed) -> None:
    async for x in client.stream("forever", "break"):
        if x == 5:
            break  # the iterator is dropped here: its finalizer cancels the call
    await asyncio.wait_for(obs.closed_event("break").wait(), 2)


async def test_garbage_collected_stream_closes_the_server_generator(client: RpcClient, obs: Observed) -> None:
    it = client.stream("forever", "gc")
    await _first_items(it, 1)
    cycle = [it]
    cycle.append(cycle)  # only the cycle collector can free it
    del it, cycle
    gc.collect()
    await asyncio.wait_for(obs.closed_event("gc").wait(), 2)


async def test_cancelled_consumer_task_closes_the_server_generator(client: RpcClient, obs: Observed) -> None:
    async def consume() -> None:
        async for _ in client.stream("count", "task", 10**9, 0.01):
            pass

    task = asyncio.ensure_future(consume())
    await wait_until(lambda: obs.produced.get("task", 0) >= 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(obs.closed_event("task").wait(), 2)


async def test_stream_deadline(client: RpcClient, obs: Observed) -> None:
    got = 0
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        async for _ in client.stream("count", "deadline", 10**9, 0.01, timeout=0.3):
            got += 1
    assert got > 0 and time.monotonic() - t0 < 1.5
    await asyncio.wait_for(obs.closed_event("deadline").wait(), 2)


async def test_flow_control_bounds_the_client_queue(server: RpcServer, codec: Codec, obs: Observed) -> None:
    window = 8
    client = RpcClient(server.address, codec, stream_window=window)
    try:
        it = client.stream("forever", "flow")
        await _first_items(it, 1)
        await asyncio.sleep(0.3)  # a slow consumer: the producer must stop at the window
        assert obs.produced["flow"] <= window + 1
        assert len(it._state.items) <= window
        await _first_items(it, 200)  # consuming grants credit: production resumes
        assert obs.produced["flow"] >= 201
        await asyncio.sleep(0.2)
        assert obs.produced["flow"] <= 201 + window + 1
        await it.aclose()
    finally:
        await client.close()


# -- coalescing ---------------------------------------------------------------------------


async def test_outputs_posted_in_one_tick_share_one_send(ipc_dir: IpcDir, codec: Codec) -> None:
    loop = asyncio.get_running_loop()
    ctx = zmq.Context.instance()
    router = make_socket(ctx, zmq.ROUTER)
    dealer = make_socket(ctx, zmq.DEALER)
    address = ipc_dir.address("coalesce")
    router.bind(address)
    dealer.connect(address)
    try:
        await asyncio.sleep(0.05)
        dealer.send_multipart(p.batch_frames([p.pack_envelope(codec, [p.PING, 0])]))
        assert router.poll(2000)
        peer = router.recv_multipart()[0]
        outbox = Outbox(loop, router, SocketReader(loop, router, lambda f: None), routed=True)
        for i in range(100):  # what one engine step does: every stream's output at once
            outbox.post(peer, p.pack_envelope(codec, [p.ITEM, i, RequestOutput(f"r{i}", [i])]))
        await asyncio.sleep(0.05)
        messages = []
        while dealer.poll(100):
            messages.append(dealer.recv_multipart(copy=False))
        # the first goes out at once (no added latency), the other 99 together
        assert [len(p.split_batch(m)) for m in messages] == [1, 99]
        items = [p.unpack_envelope(codec, d, b) for m in messages for d, b in p.split_batch(m)]
        assert [env[2].new_token_ids for env in items] == [[i] for i in range(100)]
    finally:
        router.close(0)
        dealer.close(0)


# -- R1: nobody in the rpc layer keeps a payload after handing it off ------------------------


async def test_client_drops_call_payload_after_send(client: RpcClient) -> None:

    arr = payload(8 << 20)
    ref = weakref.ref(arr)
    call = asyncio.ensure_future(client.call("sleep", "r1", 0.5))  # keep the peer busy
    assert await client.call("keep_ref", "r1-call", arr) == 8 << 20
    del arr
    await wait_collected(ref)
    await call


async def test_stream_payload_released_on_both_sides_while_stream_runs(client: RpcClient, obs: Observed) -> None:

    arr = payload(8 << 20)
    client_ref = weakref.ref(arr)
    it = client.stream("hold_payload", "r1-stream", arr)
    del arr
    assert await it.__anext__() == 8 << 20
    await wait_collected(client_ref)  # the RpcStream dropped its args, zmq its frame
    await wait_collected(obs.refs["r1-stream"])  # the server's call state and task did too
    assert await it.__anext__() == 0  # and the stream is still running
    await it.aclose()


async def test_server_releases_unary_payload_when_handler_returns(client: RpcClient, obs: Observed) -> None:
    await client.call("keep_ref", "r1-server", payload(4 << 20))
    await wait_collected(obs.refs["r1-server"])
