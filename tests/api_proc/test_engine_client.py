"""The API's side of the engines: routing, per-request streams, error codes, engine loss.

Routing and stream logic run on EngineConnections with no socket (WireRecorder), fed engine
steps directly; aborts, engine death and dropped streams run against the engine test double
(tests/api_proc/engine_double.py, a real engine socket in another process).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from tokenizers import Tokenizer

from api_proc.admission import AdmissionController
from api_proc.engine_client import EngineClient, EngineConnection
from api_proc.errors import BadRequest, EngineFailed, EngineUnavailable
from shared.messages import (
    AbortRequests,
    AddRequest,
    EngineStats,
    ErrorCode,
    RequestOutput,
    StepOutputs,
)
from shared.sampling_params import SamplingParams


def _stats(max_requests: int = 8) -> EngineStats:
    return EngineStats(0, 0, 0, 0, 0, 0, max_requests)


class WireRecorder(EngineConnection):
    """An EngineConnection without a socket: records what it sends (ids only) and is fed
    engine steps with `answer`."""

    def __init__(self, name: str, process=None, max_requests: int = 8, answered: bool = True):
        super().__init__(f"ipc:///tmp/unit-{name}.sock", process)
        self.sent: list[tuple] = []
        self.max_requests = max_requests
        if answered:
            self.answer()

    def send(self, message) -> bool:
        if type(message) is AddRequest:
            self.sent.append(("add", message.request_id))
        elif type(message) is AbortRequests:
            self.sent.append(("abort", *message.request_ids))
        return True

    def answer(self, *outputs: RequestOutput) -> None:
        self._on_step(StepOutputs(list(outputs), _stats(self.max_requests)))


class DeadProcess:
    returncode = -9

    def poll(self):
        return -9


def _req(rid: str, prompt_len: int = 10, max_tokens: int = 5) -> AddRequest:
    return AddRequest(rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens))


async def _drain(stream) -> list[RequestOutput]:
    return [out async for out in stream]


# ------------------------------------------------------------------ routing


async def test_routes_to_the_least_outstanding_work():
    a, b = WireRecorder("a"), WireRecorder("b")
    client = EngineClient([a, b])
    big = client.submit(_req("big", prompt_len=1000, max_tokens=5))
    small = [client.submit(_req(f"s{i}", prompt_len=10)) for i in range(3)]
    assert big.engine is not small[0].engine
    assert all(s.engine is small[0].engine for s in small)  # 3 small ones < 1 big one
    assert client.num_in_flight == 4
    assert ("add", "big") in big.engine.sent and ("add", "s2") in small[0].engine.sent

    # once its prompt is prefilled, the big request's engine holds the least work left
    big.engine.answer(RequestOutput("big", [7], None))
    assert (await big.__anext__()).new_token_ids == [7]
    assert big.engine.num_tokens == 4  # the 4 tokens it may still make
    nxt = client.submit(_req("next"))
    assert nxt.engine is big.engine

    for s in (big, *small, nxt):
        s.engine.answer(RequestOutput(s.request_id, [1, 2], "stop"))
        assert [o.finish_reason for o in await _drain(s)] == ["stop"]
    assert client.num_in_flight == 0
    assert a.num_tokens == b.num_tokens == 0


async def test_ties_are_broken_round_robin():
    engines = [WireRecorder(str(i)) for i in range(3)]
    client = EngineClient(engines)
    picked = []
    for i in range(6):
        s = client.submit(_req(f"r{i}"))
        picked.append(s.engine)
        await s.aclose()
        assert s.engine.sent[-2:] == [("add", f"r{i}"), ("abort", f"r{i}")]
    assert all(picked.count(e) == 2 for e in engines), [e.address for e in picked]


async def test_dead_and_unavailable_engines_are_skipped():
    dead = WireRecorder("dead", process=DeadProcess())
    down = WireRecorder("down", answered=False)  # has never answered a ping
    up = WireRecorder("up")
    client = EngineClient([dead, down, up])
    assert all(client.submit(_req(f"r{i}")).engine is up for i in range(3))
    assert dead.sent == down.sent == []
    with pytest.raises(EngineUnavailable, match="exited with code -9") as e:
        EngineClient([dead, down]).pick()
    assert e.value.status == 503
    with pytest.raises(EngineUnavailable, match="no engine is configured"):
        EngineClient([]).pick()
    health = await EngineClient([dead, down, up]).health()
    assert [h["ok"] for h in health] == [False, False, True]
    assert "exited" in health[0]["reason"] and health[1]["reason"] and health[2]["reason"] is None


async def test_a_full_engine_is_avoided_and_waited_for():
    a, b = WireRecorder("a", max_requests=1), WireRecorder("b", max_requests=1)
    client = EngineClient([a, b])
    first = client.submit(_req("first", prompt_len=1))
    second = client.submit(_req("second", prompt_len=1000))  # more work, but the one with room
    assert {first.engine, second.engine} == {a, b}
    with pytest.raises(EngineUnavailable) as e:
        await client.wait_for_room(0.05)
    assert e.value.status == 503 and e.value.code == "engine_busy"

    waiter = asyncio.ensure_future(client.wait_for_room(5))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    first.engine.answer(RequestOutput("first", [1], "stop"))  # its engine has room again
    await asyncio.wait_for(waiter, 1)
    assert client.pick() is first.engine
    await _drain(first)
    await second.aclose()


# ------------------------------------------------------------------ streams


async def test_outputs_arriving_while_the_consumer_is_busy_are_merged():
    engine = WireRecorder("a")
    client = EngineClient([engine])
    stream = client.submit(_req("x", prompt_len=3, max_tokens=10))
    engine.answer(RequestOutput("x", [1], None, 3, 1))
    assert (await stream.__anext__()).new_token_ids == [1]
    # three steps come in while the consumer is elsewhere: one output carries them all
    engine.answer(RequestOutput("x", [2], None, 3, 2))
    engine.answer(RequestOutput("x", [3], None, 3, 3), RequestOutput("other", [9], None))
    engine.answer(RequestOutput("x", [4, 5], "stop", 3, 5))
    assert not stream.finished  # ended in the engine, but not all delivered
    out = await stream.__anext__()
    assert out.new_token_ids == [2, 3, 4, 5]
    assert out.finish_reason == "stop" and out.num_completion_tokens == 5
    assert stream.finished
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    assert client.num_in_flight == 0 and engine.num_tokens == 0


async def test_a_waiting_consumer_wakes_for_each_output():
    engine = WireRecorder("a")
    stream = EngineClient([engine]).submit(_req("x"))
    consumer = asyncio.ensure_future(_drain(stream))
    for i, reason in enumerate([None, None, "length"]):
        await asyncio.sleep(0.005)
        engine.answer(RequestOutput("x", [i], reason))
    outs = await asyncio.wait_for(consumer, 1)
    assert [o.new_token_ids for o in outs] == [[0], [1], [2]]


@pytest.mark.parametrize("code, error, status, api_code", [
    (ErrorCode.REJECTED, BadRequest, 400, "engine_rejected"),
    (ErrorCode.BUSY, EngineUnavailable, 503, "engine_busy"),
    (ErrorCode.STOPPING, EngineUnavailable, 503, "engine_stopping"),
    (ErrorCode.INTERNAL, EngineFailed, 500, "engine_error"),
])
async def test_error_codes_map_to_api_errors(code, error, status, api_code):
    engine = WireRecorder("a")
    client = EngineClient([engine])
    stream = client.submit(_req("x"))
    engine.answer(RequestOutput("x", [], "error", error="what the engine said", error_code=code))
    with pytest.raises(error) as e:
        await stream.__anext__()
    assert type(e.value) is error
    assert e.value.status == status and e.value.code == api_code
    assert "what the engine said" in e.value.message
    assert e.value.__context__ is None and e.value.__cause__ is None
    assert client.num_in_flight == 0 and engine.num_tokens == 0
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()


# ------------------------------------------------------------------ against the engine double


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))


@pytest.fixture
def prompt(tokenizer):
    def make(rid: str, text: str, max_tokens: int = 10) -> AddRequest:
        return AddRequest(rid, tokenizer.encode(text).ids, SamplingParams(max_tokens=max_tokens))
    return make


async def _wait_for(predicate, what: str, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_aclose_aborts_in_the_engine(engine_double, prompt):
    client = EngineClient.connect([engine_double.address])
    await client.start()
    try:
        stream = client.submit(prompt("closed-early", "[[hang]] then stop me"))
        assert (await stream.__anext__()).new_token_ids
        assert "closed-early" in engine_double.log()["running"]
        await stream.aclose()
        assert client.num_in_flight == 0 and client.engines[0].num_tokens == 0
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        await _wait_for(lambda: "closed-early" in engine_double.log()["aborted"], "the abort")
        assert "closed-early" not in engine_double.log()["running"]
    finally:
        await client.close()


async def test_the_double_s_failures_arrive_as_api_errors(engine_double, prompt):
    client = EngineClient.connect([engine_double.address])
    await client.start()
    try:
        with pytest.raises(BadRequest, match="refused by the test double") as e:
            await _drain(client.submit(prompt("refused", "[[refuse]] no")))
        assert e.value.code == "engine_rejected"
        stream = client.submit(prompt("fails", "[[error]] after one token"))
        assert (await stream.__anext__()).new_token_ids
        with pytest.raises(EngineFailed, match="failed on purpose") as e:
            await stream.__anext__()
        assert e.value.status == 500 and e.value.__context__ is None
        outs = await _drain(client.submit(prompt("fine", "all good here", max_tokens=2)))
        # two tokens, in one output or two (outputs that arrive while the reader is behind
        # are merged)
        assert sum(len(o.new_token_ids) for o in outs) == 2
        assert outs[-1].finish_reason == "length"
        assert client.num_in_flight == 0
    finally:
        await client.close()


async def test_an_engine_past_its_capacity_answers_busy(start_engine_double, prompt):
    double = start_engine_double(max_requests=1)
    client = EngineClient.connect([double.address])
    await client.start()
    try:
        held = client.submit(prompt("held", "[[gated]] one"))
        await _wait_for(lambda: "held" in double.log()["running"], "the first request")
        refused = client.submit(prompt("refused", "two"))  # submit itself does not wait
        with pytest.raises(EngineUnavailable) as e:
            await asyncio.wait_for(refused.__anext__(), 3)
        assert e.value.status == 503 and e.value.code == "engine_busy"
        assert double.open_gate() == 1
        assert (await asyncio.wait_for(_drain(held), 3))[-1].finish_reason == "stop"
    finally:
        await client.close()


@pytest.mark.parametrize("watch_process, within_s", [(True, 1.0), (False, 2.0)],
                         ids=["process-exit", "unanswered-pings"])
async def test_engine_process_death_fails_the_stream_with_503(start_engine_double, prompt,
                                                              watch_process, within_s):
    double = start_engine_double()
    client = EngineClient.connect([double.address], [double.process] if watch_process else None)
    await client.start()
    try:
        stream = client.submit(prompt("dies", "[[hang]] until the end"))
        await stream.__anext__()
        double.kill()
        died = time.monotonic()
        with pytest.raises(EngineUnavailable) as e:
            await asyncio.wait_for(stream.__anext__(), 5)
        assert time.monotonic() - died < within_s
        assert e.value.status == 503
        assert client.num_in_flight == 0 and client.engines[0].num_tokens == 0
        health = await client.health()
        assert not health[0]["ok"] and health[0]["reason"]
        with pytest.raises(EngineUnavailable):
            client.pick()
    finally:
        await client.close()


async def test_dropped_unconsumed_stream_settles_and_is_aborted(engine_double, prompt):
    client = EngineClient.connect([engine_double.address])
    await client.start()
    admission = AdmissionController(1000, 1.0)
    try:
        reservation = await admission.acquire(600)
        client.submit(prompt("dropped", "[[hang]] nobody reads me"), mm_reservation=reservation)
        del reservation
        # never iterated, never closed: its client left before the response started
        assert client.num_in_flight == 0
        await asyncio.sleep(0)  # the finalizer settles on the loop
        assert client.engines[0].num_tokens == 0
        assert admission.in_flight_bytes == 0
        await _wait_for(lambda: "dropped" in engine_double.log()["aborted"], "the abort")
        assert "dropped" not in engine_double.log()["running"]
    finally:
        await client.close()


async def test_a_silent_api_process_s_requests_are_aborted(start_engine_double, prompt):
    double = start_engine_double(peer_timeout_s=0.5)
    client = EngineClient.connect([double.address])
    await client.start()
    stream = client.submit(prompt("orphan", "[[hang]] left behind"))
    await stream.__anext__()
    await client.close()  # gone without a word, as a crashed API process would be
    await _wait_for(lambda: "orphan" in double.log()["aborted"], "the engine to abort it")
    assert double.log()["running"] == []


async def test_merged_outputs_keep_one_logprob_entry_per_token():
    engine = WireRecorder("a")
    stream = EngineClient([engine]).submit(_req("x", prompt_len=3, max_tokens=10))
    engine.answer(RequestOutput("x", [1], None, 3, 1, logprobs=[[-0.1, [1], [-0.1]]]))
    assert (await stream.__anext__()).logprobs == [[-0.1, [1], [-0.1]]]
    engine.answer(RequestOutput("x", [2], None, 3, 2, logprobs=[[-0.2, [2], [-0.2]]]))
    engine.answer(RequestOutput("x", [3], "length", 3, 3, logprobs=[[-0.3, [3], [-0.3]]]))
    out = await stream.__anext__()
    assert out.new_token_ids == [2, 3]
    assert out.logprobs == [[-0.2, [2], [-0.2]], [-0.3, [3], [-0.3]]]


# ------------------------------------------------------------------ delivered in the reader


class _Sink:
    def __init__(self, stream, fail_on: int | None = None):
        self.outputs: list[RequestOutput] = []
        self.errors: list[Exception] = []
        self.fail_on = fail_on
        self.stream = stream  # a stream nobody holds is dropped, and aborted
        stream.deliver(self.output, self.errors.append)

    def output(self, out: RequestOutput) -> None:
        if out.new_token_ids == [self.fail_on]:
            raise ValueError("a bug in a response")
        self.outputs.append(out)


async def test_delivered_outputs_are_handed_on_inside_the_step_callback():
    """Every request of an engine step gets its output within that step's callback: no task
    wakes per request."""
    engine = WireRecorder("a")
    client = EngineClient([engine])
    streams = [client.submit(_req(f"r{i}", prompt_len=3, max_tokens=10)) for i in range(3)]
    engine.answer(RequestOutput("r0", [7], None, 3, 1))  # arrives before anyone delivers
    sinks = [_Sink(s) for s in streams]
    assert [o.new_token_ids for o in sinks[0].outputs] == [[7]]
    engine.answer(*(RequestOutput(f"r{i}", [i], None, 3, 1) for i in range(3)))
    assert [[o.new_token_ids for o in s.outputs] for s in sinks] == [[[7], [0]], [[1]], [[2]]]
    assert engine.num_tokens == 3 * 13 - 3 * 3 - 4  # prompts prefilled, 4 tokens made
    engine.answer(*(RequestOutput(f"r{i}", [9], "length", 3, 2) for i in range(3)))
    assert all(s.outputs[-1].finish_reason == "length" and not s.errors for s in sinks)
    assert all(s.finished for s in streams)
    assert client.num_in_flight == 0 and engine.num_tokens == 0


async def test_a_delivered_error_comes_after_its_tokens():
    engine = WireRecorder("a")
    client = EngineClient([engine])
    sink = _Sink(client.submit(_req("x")))
    engine.answer(RequestOutput("x", [1, 2], "error", error="failed on purpose",
                                error_code=ErrorCode.INTERNAL))
    assert [o.new_token_ids for o in sink.outputs] == [[1, 2]]
    assert sink.outputs[0].finish_reason is None
    assert [type(e) for e in sink.errors] == [EngineFailed]
    assert "failed on purpose" in sink.errors[0].message
    assert client.num_in_flight == 0 and engine.num_tokens == 0


async def test_a_lost_engine_fails_delivered_streams():
    engine = WireRecorder("a")
    client = EngineClient([engine])
    sinks = [_Sink(client.submit(_req(f"r{i}"))) for i in range(2)]
    engine._fail_all(EngineUnavailable("engine unavailable: gone"))
    assert [[type(e) for e in s.errors] for s in sinks] == [[EngineUnavailable]] * 2
    assert client.num_in_flight == 0


async def test_a_failing_consumer_fails_its_request_alone():
    """A bug in one response's handling: that request is aborted in the engine and fails
    with a 500; the other requests of the same step are handed on as usual."""
    engine = WireRecorder("a")
    client = EngineClient([engine])
    bad = _Sink(client.submit(_req("bad")), fail_on=5)
    good = _Sink(client.submit(_req("good")))
    engine.answer(RequestOutput("bad", [5], None), RequestOutput("good", [6], None))
    assert [type(e) for e in bad.errors] == [EngineFailed] and bad.errors[0].status == 500
    assert ("abort", "bad") in engine.sent
    assert [o.new_token_ids for o in good.outputs] == [[6]] and not good.errors
    engine.answer(RequestOutput("bad", [1], None), RequestOutput("good", [2], "stop"))
    assert not bad.outputs and len(bad.errors) == 1
    assert [o.new_token_ids for o in good.outputs] == [[6], [2]]
    assert client.num_in_flight == 0


async def test_abort_stops_delivery_and_aborts_in_the_engine():
    engine = WireRecorder("a")
    client = EngineClient([engine])
    stream = client.submit(_req("x"))
    sink = _Sink(stream)
    engine.answer(RequestOutput("x", [1], None))
    stream.abort()
    engine.answer(RequestOutput("x", [2], None))
    assert [o.new_token_ids for o in sink.outputs] == [[1]] and not sink.errors
    assert ("abort", "x") in engine.sent and client.num_in_flight == 0


async def test_outputs_and_an_engine_loss_before_delivery_are_both_handed_on():
    """Tokens and then the engine's loss arrive before the response starts delivering:
    both reach it, the tokens first (the loss must not be dropped, or the response would
    wait forever)."""
    engine = WireRecorder("a")
    client = EngineClient([engine])
    stream = client.submit(_req("x"))
    engine.answer(RequestOutput("x", [1], None))
    engine._fail_all(EngineUnavailable("engine unavailable: gone"))
    sink = _Sink(stream)
    assert [o.new_token_ids for o in sink.outputs] == [[1]]
    assert [type(e) for e in sink.errors] == [EngineUnavailable]


async def test_a_consumer_that_stops_on_a_token_gets_no_error_after_it():
    engine = WireRecorder("a")
    client = EngineClient([engine])
    stream = client.submit(_req("x"))
    outputs, errors = [], []

    def stop_here(out):
        outputs.append(out)
        stream.abort()  # a stop string found in this output's text

    stream.deliver(stop_here, errors.append)
    engine.answer(RequestOutput("x", [1, 2], "error", error="late", error_code=ErrorCode.INTERNAL))
    assert [o.new_token_ids for o in outputs] == [[1, 2]] and errors == []


async def test_a_paused_stream_merges_and_hands_on_when_delivered_again():
    engine = WireRecorder("a")
    client = EngineClient([engine])
    stream = client.submit(_req("x", prompt_len=3, max_tokens=10))
    sink = _Sink(stream)
    engine.answer(RequestOutput("x", [1], None, 3, 1))
    stream.pause()
    engine.answer(RequestOutput("x", [2], None, 3, 2))
    engine.answer(RequestOutput("x", [3], "stop", 3, 3))
    assert [o.new_token_ids for o in sink.outputs] == [[1]]
    stream.deliver(sink.output, sink.errors.append)
    assert [o.new_token_ids for o in sink.outputs] == [[1], [2, 3]]
    assert sink.outputs[-1].finish_reason == "stop" and stream.finished
