"""A peer that sends malformed frames gets an error reply (when its call can be identified)
or is ignored with a log line; everyone else keeps being served. Same on the client side
for a misbehaving server."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from rpc import Codec, DecodeError, IpcDir, ProtocolError, RpcClient, RpcServer
from rpc import protocol as p
from rpc.codec import EXT_NDARRAY


def frames_of(*envelope_docs: bytes, buffers: tuple[int, ...] | None = None, extra: list[bytes] | None = None) -> list[bytes]:
    """A batch built by hand from raw envelope documents."""
    counts = buffers or (0,) * len(envelope_docs)
    items = [(doc, [b"?"] * n) for doc, n in zip(envelope_docs, counts, strict=True)]
    frames = p.batch_frames(items)
    return [frames[0]] + (extra if extra is not None else frames[1:])


def ndarray_ext(dtype: str, shape: list[int], data: Any) -> list[Any]:
    return [msgpack.ExtType(EXT_NDARRAY, b""), dtype, shape, data, None]


def call_doc(call_id: int, *args: Any, kind: int = p.CALL, window: int | None = None) -> bytes:
    env: list[Any] = [kind, call_id, "echo" if kind == p.CALL else "count", list(args), None]
    if kind == p.STREAM:
        env.append(window)
    return msgpack.packb(env, use_bin_type=True)


async def test_malformed_requests_do_not_take_the_server_down(
    server: RpcServer, client: RpcClient, codec: Codec, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rpc.server")
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    raw.connect(server.address)
    try:
        bad_messages: list[list[bytes]] = [
            [b"\x00garbage"],  # bad header
            [b""],  # empty body
            [b"\x01\xff\xff\xff\xff"],  # announces 2**32 - 1 envelopes
            [p.batch_frames([(b"\xc1", [])])[0]],  # 0xc1 is never valid msgpack
            [p.batch_frames([(msgpack.packb("not a list"), [])])[0]],
            [p.batch_frames([(msgpack.packb([99, 1]), [])])[0]],  # unknown kind
            [p.batch_frames([(msgpack.packb([p.CREDIT, 1, -5]), [])])[0]],
            frames_of(call_doc(20, 1), buffers=(1,), extra=[]),  # a buffer frame missing
            frames_of(call_doc(21, 1), extra=[b"surplus"]),  # one frame too many
            # identifiable calls with bad payloads: each gets an error reply
            frames_of(call_doc(10, ndarray_ext("uint8", [4096], 3))),  # buffer index out of range
            frames_of(call_doc(11, ndarray_ext("uint8", [4096], 0)), buffers=(1,), extra=[b"x" * 100]),  # truncated
            frames_of(call_doc(12, ndarray_ext("float128x", [2], b"\x00" * 32))),  # unknown dtype
            frames_of(call_doc(13, msgpack.ExtType(42, b""))),  # unknown extension type
            frames_of(call_doc(14, kind=p.STREAM, window=0)),  # no credit at all
            frames_of(msgpack.packb([p.CALL, 15, 7, [], None])),  # method is not a string
        ]
        for frames in bad_messages:
            await raw.send_multipart(frames)
            assert await client.call("echo", "alive") == "alive"
        replies: dict[int, list[Any]] = {}
        while len(replies) < 6:
            frames = await asyncio.wait_for(raw.recv_multipart(), 2)
            for doc, bufs in p.split_batch(frames):
                env = p.unpack_envelope(codec, doc, bufs)
                replies[env[1]] = env
        assert sorted(replies) == [10, 11, 12, 13, 14, 15]
        for env in replies.values():
            assert env[0] == p.ERROR and env[2] == p.ERR_BAD_REQUEST and env[3] == "DecodeError"
        assert "buffer index" in replies[10][4]
        assert "need 4096" in replies[11][4]
        assert "float128x" in replies[12][4]
        assert not await raw.poll(200)  # nothing else was answered
        assert len([r for r in caplog.records if r.name == "rpc.server"]) >= len(bad_messages)
        assert [x async for x in client.stream("count", "ok", 3)] == [0, 1, 2]
    finally:
        raw.close(0)


async def _fake_server(sock: zmq.asyncio.Socket, codec: Codec, answer: Any) -> None:
    """A misbehaving server: pongs pings, answers calls with whatever `answer` returns."""
    while True:
        frames = await sock.recv_multipart()
        peer = frames[0]
        for doc, bufs in p.split_batch(frames[1:]):
            env = p.unpack_envelope(codec, doc, bufs)
            if env[0] == p.PING:
                await sock.send_multipart([peer, *p.batch_frames([p.pack_envelope(codec, [p.PONG, 0])])])
            elif env[0] in (p.CALL, p.STREAM):
                for reply in answer(env):
                    await sock.send_multipart([peer, *reply])


async def test_malformed_replies_fail_only_their_call(ipc_dir: IpcDir, codec: Codec) -> None:
    def answer(env: list[Any]) -> list[list[bytes]]:
        call_id, arg = env[1], env[3][0]
        if env[0] == p.STREAM:  # ignores flow control: 10 items against a window of 4
            items = [p.pack_envelope(codec, [p.ITEM, call_id, i]) for i in range(10)]
            return [p.batch_frames(items)]
        if arg == "garbage":
            return [[b"\x00garbage"], [b"\x01\x01\x00\x00\x00"]]
        if arg == "bad buffer":
            doc = msgpack.packb([p.RESULT, call_id, ndarray_ext("uint8", [4096], 0)])
            return [p.batch_frames([(doc, [b"short"])])]
        return [p.batch_frames([p.pack_envelope(codec, [p.RESULT, call_id, arg])])]

    sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    address = ipc_dir.address("liar")
    sock.bind(address)
    fake = asyncio.ensure_future(_fake_server(sock, codec, answer))
    client = RpcClient(address, codec, stream_window=4)
    try:
        await client.wait_ready(5)
        with pytest.raises(DecodeError, match="need 4096"):
            await client.call("echo", "bad buffer")
        slow = asyncio.ensure_future(client.call("echo", "garbage"))  # never answered properly
        assert await client.call("echo", "fine") == "fine"
        with pytest.raises(ProtocolError, match="window of 4"):
            async for _ in client.stream("count", "x"):
                await asyncio.sleep(0.05)
        assert not slow.done()
        slow.cancel()
    finally:
        fake.cancel()
        await client.close()
        sock.close(0)
