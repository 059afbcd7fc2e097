"""The engine's end of the wire, driven by raw DEALER peers over a real ipc socket: one
message per step, pings answered with stats, refusals with typed codes, aborts both ways,
malformed frames refused while the server keeps serving."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
import zmq

from rpc.codec import EXT_STRUCT, decode, encode
from rpc.engine_server import EngineServer
from rpc.sockets import IpcDir
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

STATS = EngineStats(0, 0, 10, 10, 0, 0, 3)


@pytest.fixture
def server():
    with IpcDir() as d:
        srv = EngineServer(d.address("engine"), max_requests=3, peer_timeout_s=5.0)
        srv.stats = STATS
        srv.start()
        yield srv
        srv.stop()


class Peer:
    """An API process, reduced to a DEALER socket."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, message) -> None:
        self.sock.send_multipart(encode(message), copy=False)

    def recv(self, timeout_s: float = 2.0) -> StepOutputs:
        assert self.sock.poll(int(timeout_s * 1000)), "no message from the engine"
        return decode(self.sock.recv_multipart(copy=False))

    def silent(self, timeout_s: float = 0.2) -> bool:
        return not self.sock.poll(int(timeout_s * 1000))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def peer(server):
    p = Peer(server.address)
    yield p
    p.close()


def add(request_id: str, pixels: np.ndarray | None = None) -> AddRequest:
    images = [] if pixels is None else [ImageInput(pixels, (1, 2, 2))]
    return AddRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=4), images)


def commands(server: EngineServer, count: int, timeout_s: float = 2.0) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        server.wait_for_commands(0.05)
        got += server.take_commands()
    return got


def test_requests_reach_the_loop_and_a_step_is_one_message(server, peer) -> None:
    pixels = np.full((28, 28, 3), 7, dtype=np.uint8)
    peer.send(add("a", pixels))
    peer.send(add("b"))
    got = commands(server, 2)
    assert [c.request_id for c in got] == ["a", "b"]
    assert np.array_equal(got[0].images[0].pixels, pixels)
    server.send_step([RequestOutput("a", [11]), RequestOutput("b", [12], "stop")])
    step = peer.recv()
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in step.outputs] == [
        ("a", [11], None), ("b", [12], "stop")]
    assert step.stats == STATS
    assert peer.silent()  # both outputs came in that one message


def test_ping_is_answered_with_the_latest_stats(server, peer) -> None:
    server.stats = EngineStats(1, 2, 10, 5, 99, 7, 3)
    peer.send(Ping())
    step = peer.recv()
    assert step.outputs == [] and step.stats.mm_bytes_held == 99


def test_duplicates_and_requests_past_capacity_are_refused_at_once(server, peer) -> None:
    for rid in ("a", "b", "c"):
        peer.send(add(rid))
    peer.send(add("a"))
    refused = peer.recv().outputs[0]
    assert (refused.request_id, refused.finish_reason, refused.error_code) == (
        "a", "error", ErrorCode.REJECTED)
    assert "already running" in refused.error
    peer.send(add("d", np.zeros((56, 56, 3), dtype=np.uint8)))
    busy = peer.recv().outputs[0]
    assert (busy.request_id, busy.error_code) == ("d", ErrorCode.BUSY)
    assert [c.request_id for c in commands(server, 4, timeout_s=0.5)] == ["a", "b", "c"]
    # a finished request makes room again
    server.send_step([RequestOutput("a", [1], "length")])
    peer.recv()
    peer.send(add("d"))
    assert [c.request_id for c in commands(server, 1)] == ["d"]


def test_abort_reaches_the_loop_and_silences_the_request(server, peer) -> None:
    peer.send(add("a"))
    peer.send(add("b"))
    commands(server, 2)
    peer.send(AbortRequests(["a", "unknown"]))
    aborts = commands(server, 1)
    assert aborts == [AbortRequests(["a"])]
    server.send_step([RequestOutput("a", [1]), RequestOutput("b", [2])])
    assert [o.request_id for o in peer.recv().outputs] == ["b"]


def test_outputs_go_to_the_process_that_sent_the_request(server, peer) -> None:
    other = Peer(server.address)
    try:
        peer.send(add("mine"))
        other.send(add("theirs"))
        commands(server, 2)
        server.send_step([RequestOutput("mine", [1]), RequestOutput("theirs", [2])])
        assert [o.request_id for o in peer.recv().outputs] == ["mine"]
        assert [o.request_id for o in other.recv().outputs] == ["theirs"]
    finally:
        other.close()


def test_malformed_frames_are_refused_and_the_server_keeps_serving(server, peer) -> None:
    peer.sock.send(b"\xc1 not msgpack")
    peer.sock.send_multipart([msgpack.packb([1, 2, 3]), b"stray frame"])
    bad_add = msgpack.packb([msgpack.ExtType(EXT_STRUCT, bytes([2])), "bad-1", "x"])
    peer.sock.send(bad_add)
    refused = peer.recv().outputs[0]
    assert (refused.request_id, refused.error_code) == ("bad-1", ErrorCode.REJECTED)
    assert "malformed" in refused.error
    peer.send(Ping())
    assert peer.recv().stats == STATS
    peer.send(add("good"))
    assert [c.request_id for c in commands(server, 1)] == ["good"]


def test_a_silent_api_process_has_its_requests_aborted(server, peer) -> None:
    server.peer_timeout_s = 0.3
    peer.send(add("a"))
    peer.send(add("b"))
    commands(server, 2)
    peer.close()  # no pings from here on
    aborts = commands(server, 1, timeout_s=3.0)
    assert aborts and sorted(aborts[0].request_ids) == ["a", "b"]


def test_an_api_process_back_from_silence_hears_its_requests_ended(server) -> None:
    """Paused past the timeout (SIGSTOP, a starved event loop), the API process still counts
    its requests as running: the engine ends each with DROPPED when it speaks again."""
    server.peer_timeout_s = 0.3
    paused = Peer(server.address)
    try:
        paused.send(add("a"))
        paused.send(add("b"))
        commands(server, 2)
        aborts = commands(server, 1, timeout_s=3.0)  # silent past the timeout: aborted
        assert sorted(aborts[0].request_ids) == ["a", "b"]
        paused.send(Ping())  # back
        ended = paused.recv()
        assert sorted((o.request_id, o.finish_reason, o.error_code) for o in ended.outputs) == [
            ("a", "error", ErrorCode.DROPPED), ("b", "error", ErrorCode.DROPPED)]
        assert "silent" in ended.outputs[0].error
        assert paused.recv().outputs == []  # then the ping's answer, and nothing more
        paused.send(Ping())
        assert paused.recv().outputs == []
    finally:
        paused.close()


def test_a_step_posted_before_stop_is_delivered() -> None:
    with IpcDir() as d:
        server = EngineServer(d.address("engine"), max_requests=3)
        server.start()
        peer = Peer(server.address)
        try:
            peer.send(add("a"))
            commands(server, 1)
            server.send_step([RequestOutput("a", [], "error", error="stopping",
                                            error_code=ErrorCode.STOPPING)])
            server.stop()
            assert peer.recv().outputs[0].error_code == ErrorCode.STOPPING
        finally:
            peer.close()


def test_every_api_process_hears_the_encoder_cache_keys(server):
    """Key changes reach every peer with its next message (a ping reply at the latest); a
    peer that connects later first gets every key held now."""
    a = Peer(server.address)
    a.send(Ping())
    first = a.recv()
    assert first.encoder_keys is not None and first.encoder_keys.reset
    server.send_step([], [b"k1", b"k2"], [])
    time.sleep(0.1)
    server.send_step([], [b"k3"], [b"k1"])
    time.sleep(0.1)  # routed by the I/O thread before the ping below arrives
    a.send(Ping())
    news = a.recv().encoder_keys
    assert not news.reset and news.added == [b"k2", b"k3"] and news.removed == [b"k1"]
    a.send(Ping())
    assert a.recv().encoder_keys is None  # nothing new
    b = Peer(server.address)
    b.send(Ping())
    news = b.recv().encoder_keys
    assert news.reset and sorted(news.added) == [b"k2", b"k3"] and news.removed == []
    a.close()
    b.close()
