"""The wire form of every message: round trips, zero-copy pixels, and malformed input that
raises DecodeError and nothing else (fuzzed)."""

from __future__ import annotations

import pickle

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpc.codec import (
    EXT_ARRAY,
    EXT_STRUCT,
    DecodeError,
    EncodeError,
    decode,
    encode,
    peek_request_id,
)
from shared.memory_plan import MemoryPart, MemoryPlan
from shared.messages import (
    AbortRequests,
    AddRequest,
    EngineStats,
    ErrorCode,
    ImageInput,
    Ping,
    RequestOutput,
    StepOutputs,
)
from shared.sampling_params import SamplingParams


def add_request(pixels: np.ndarray | None = None) -> AddRequest:
    images = [] if pixels is None else [ImageInput(pixels, (1, 4, 6))]
    return AddRequest("req-1", [1, 2, 3], SamplingParams(max_tokens=5, stop_token_ids=(7,)), images)


def test_every_message_round_trips() -> None:
    pixels = np.arange(56 * 84 * 3, dtype=np.uint8).reshape(56, 84, 3)
    stats = EngineStats(1, 2, 100, 50, 3, 4, 200)
    for message in (
        add_request(pixels),
        AbortRequests(["a", "b"]),
        Ping(),
        StepOutputs([RequestOutput("a", [5], None, 3, 1),
                     RequestOutput("b", [], "error", 2, 0, "too long", ErrorCode.REJECTED)], stats),
        StepOutputs([], None),
        StepOutputs([], stats, memory_plan=MemoryPlan(
            "engine 0", (MemoryPart("weights", 25 << 20, "parameters"),
                         MemoryPart("kv cache", 1 << 28, "")))),
    ):
        back = decode(encode(message))
        assert type(back) is type(message)
        if isinstance(message, AddRequest):
            assert back.sampling == message.sampling and back.prompt_token_ids == [1, 2, 3]
            assert back.images[0].grid_thw == (1, 4, 6)
            assert np.array_equal(back.images[0].pixels, pixels)
        else:
            assert back == message


def test_pixels_travel_as_their_own_frame_and_arrive_without_a_copy() -> None:
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://codec-zero-copy")
    b.connect("inproc://codec-zero-copy")
    try:
        pixels = np.random.default_rng(0).integers(0, 255, (448, 448, 3), dtype=np.uint8)
        frames = encode(add_request(pixels))
        assert len(frames) == 2 and frames[1].nbytes == pixels.nbytes  # document + pixels
        assert np.shares_memory(frames[1], pixels)  # the sender does not copy either
        a.send_multipart(frames, copy=False)
        received = b.recv_multipart(copy=False)
        got = decode(received).images[0].pixels
        frame_address = np.frombuffer(received[1].buffer, dtype=np.uint8).ctypes.data
        assert got.ctypes.data == frame_address
        assert np.array_equal(got, pixels)
    finally:
        a.close()
        b.close()


def test_small_arrays_are_inline() -> None:
    frames = encode(add_request(np.zeros((4, 4, 3), dtype=np.uint8)))
    assert len(frames) == 1
    assert decode(frames).images[0].pixels.shape == (4, 4, 3)


@pytest.mark.parametrize("make, match", [
    (lambda: {"not": "a message"}, "not a wire message"),
    (lambda: AddRequest("x", [1], SamplingParams(),
                        [ImageInput(np.zeros((2, 2), np.float32), (1, 1, 1))]), "only uint8"),
    (lambda: AddRequest("x", [object()], SamplingParams()), "cannot cross"),
])
def test_what_cannot_cross_fails_on_the_sender(make, match) -> None:
    with pytest.raises(EncodeError, match=match):
        encode(make())


def test_nothing_is_unpickled() -> None:
    with pytest.raises(DecodeError):
        decode([pickle.dumps(add_request())])


def test_malformed_add_request_is_named() -> None:
    doc = msgpack.packb([msgpack.ExtType(EXT_STRUCT, bytes([2])), "req-9", "not a list"])
    with pytest.raises(DecodeError, match="AddRequest with 2 fields"):
        decode([doc])
    assert peek_request_id([doc]) == "req-9"
    assert peek_request_id([b"\xc1garbage"]) is None


@pytest.mark.parametrize("doc, buffers, match", [
    ([msgpack.ExtType(EXT_ARRAY, b""), [2, 2], 0], [b"abc"], "over 3 bytes"),
    ([msgpack.ExtType(EXT_ARRAY, b""), [2, 2], 5], [], "bad array buffer"),
    ([msgpack.ExtType(EXT_ARRAY, b""), [-1], b""], [], "bad array shape"),
    ([msgpack.ExtType(EXT_STRUCT, b"\x63")], [], "unknown msgpack extension"),
    ([1, msgpack.ExtType(EXT_STRUCT, b"\x04")], [], "not a wire message"),
])
def test_malformed_documents(doc, buffers, match) -> None:
    with pytest.raises(DecodeError, match=match):
        decode([msgpack.packb(doc), *buffers])


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                  st.text(max_size=8), st.binary(max_size=16))
_markers = st.builds(msgpack.ExtType, st.sampled_from([EXT_STRUCT, EXT_ARRAY, 0, 99]),
                     st.sampled_from([b"", b"\x00", b"\x02", b"\x07", b"\x08", b"\xff", b"xy"]))
_docs = st.recursive(
    _leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.builds(lambda m, rest: [m, *rest], _markers, st.lists(children, max_size=6)),
        _markers,
    ),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_docs, st.lists(st.binary(max_size=64), max_size=3))
def test_fuzz_documents_raise_decode_error_only(doc, buffers) -> None:
    try:
        decode([msgpack.packb(doc), *buffers])
    except DecodeError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_mutated_messages_raise_decode_error_only(data) -> None:
    doc = bytearray(encode(StepOutputs([RequestOutput("a", [1, 2], "stop", 3, 2)],
                                       EngineStats(0, 1, 2, 3, 4, 5, 6)))[0])
    for _ in range(data.draw(st.integers(1, 4))):
        doc[data.draw(st.integers(0, len(doc) - 1))] = data.draw(st.integers(0, 255))
    try:
        decode([bytes(doc)])
    except DecodeError:
        pass
