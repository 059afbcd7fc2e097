"""R1/R5: the multimodal payload is unreachable right after each hop hands it on.

A weakref is held to the payload at every hop (request body model, base64 string, encoded
image, decoded ImageInput and its pixel array, AddRequest) and each must be collected once
the request is sent to the engine, before the engine has answered anything ([[gated]]
requests): on the plain path, with n > 1, when the client disconnects, when the engine
fails, and on errors before the handoff, by reference counting alone (the garbage collector
is off). Only the pixel array may outlive the send briefly: zmq sends it without a copy and
drops it once its frame is out. The app-level tests also check with tracemalloc that no
large block allocated for the request survives.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
import tracemalloc
import weakref

import httpx
import numpy as np
import pytest

import api_proc.serving as serving_module
from api_proc.engine_client import EngineClient
from api_proc.errors import EngineFailed
from api_proc.media_loader import MediaLoader, MediaRef
from shared.messages import AddRequest, ImageInput
from shared.sampling_params import SamplingParams
from tests.api_proc.conftest import data_url, encode_image

pytestmark = pytest.mark.usefixtures("no_garbage_collector")


class WeakStr(str):
    """A str that can be weak-referenced (plain str cannot)."""


def describe_referrers(obj) -> str:
    lines = []
    for r in gc.get_referrers(obj)[:6]:
        kind = type(r).__name__
        if kind == "frame":
            lines.append(f"frame {r.f_code.co_name} ({r.f_code.co_filename}:{r.f_lineno})")
        elif kind == "dict":
            lines.append(f"dict with keys {list(r)[:8]}")
        else:
            lines.append(kind)
    return "; ".join(lines)


def wait_collected(refs, timeout: float = 3.0) -> None:
    """Wait until every weakref is dead; pyzmq drops zero-copy frames from its own thread
    once they are sent, so allow a short delay."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [(name, r()) for name, r in refs if r() is not None]
        if not alive:
            return
        if time.monotonic() > deadline:
            name, obj = alive[0]
            raise AssertionError(f"{[n for n, _ in alive]} still alive; {name} is held by: "
                                 f"{describe_referrers(obj)}")
        del alive
        time.sleep(0.05)


async def wait_collected_async(refs, timeout: float = 3.0) -> None:
    """wait_collected for coroutines: yields to the loop between tries (the loop's current
    handle references the future that woke this coroutine until it yields)."""
    deadline = time.monotonic() + timeout
    while True:
        if all(r() is None for _, r in refs):
            return
        if time.monotonic() > deadline:
            wait_collected(refs, 0)
        await asyncio.sleep(0.05)


# ------------------------------------------------------------------ hop: media loader


async def test_loader_drops_the_url_string_and_the_encoded_bytes(make_config, image_config):
    loader = MediaLoader(make_config(), image_config)
    try:
        url = WeakStr(data_url(encode_image(300, 200)))
        refs = [("base64 url", weakref.ref(url))]
        ref = MediaRef(url)
        del url
        encoded = await loader.fetch(ref)
        await wait_collected_async(refs)  # the string is gone once its bytes are decoded
        refs.append(("encoded image", weakref.ref(encoded)))
        image = await loader.decode(encoded)
        assert encoded.data is None
        del encoded
        refs += [("image input", weakref.ref(image)), ("pixels", weakref.ref(image.pixels))]
        del image
        await wait_collected_async(refs)  # the loader itself keeps nothing
    finally:
        await loader.aclose()


async def test_loader_errors_do_not_pin_the_payload(make_config, image_config):
    loader = MediaLoader(make_config(max_image_pixels=1000), image_config)
    try:
        url = WeakStr(data_url(encode_image(300, 200)))
        refs = [("base64 url", weakref.ref(url))]
        with pytest.raises(Exception, match="max_image_pixels"):
            await loader.fetch(MediaRef(url))
        del url
        await wait_collected_async(refs)
    finally:
        await loader.aclose()


# ------------------------------------------------------------------ hop: the engine client's send


def _request(tiny_model_path, text: str, side: int = 112) -> AddRequest:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    grid = (1, side // 14, side // 14)
    image_id = tok.token_to_id("<|image_pad|>")
    ids = tok.encode(text).ids + [image_id] * (grid[1] * grid[2] // 4)
    return AddRequest("req-" + str(time.monotonic_ns()), ids, SamplingParams(max_tokens=20),
                      [ImageInput(pixels, grid)])


def _payload_refs(request: AddRequest) -> list:
    return [("add request", weakref.ref(request)),
            ("image input", weakref.ref(request.images[0])),
            ("pixels", weakref.ref(request.images[0].pixels))]


async def _until(predicate, what: str, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


# 112x112 pixels are below pyzmq's copy threshold (copied at the send), 448x448 above it
# (sent zero-copy: zmq holds the array until its frame is out)
@pytest.mark.parametrize("side", [112, 448], ids=["copied-frame", "zero-copy-frame"])
async def test_engine_client_drops_the_payload_at_the_send(engine_double, tiny_model_path,
                                                           side):
    client = EngineClient.connect([engine_double.address])
    await client.start()
    try:
        request = _request(tiny_model_path, "[[gated]] engine client hop", side)
        rid = request.request_id
        request_refs, pixel_refs = _payload_refs(request)[:2], _payload_refs(request)[2:]
        stream = client.submit(request)
        del request
        await asyncio.sleep(0)
        wait_collected(request_refs, timeout=0)  # nothing but zmq may hold any of it now
        await wait_collected_async(pixel_refs, timeout=1.0)  # zmq lets go once it is sent
        # the engine has it and has answered nothing yet: gone at the send, not at an output
        await _until(lambda: rid in engine_double.log()["running"], "the engine to hold it")
        first = asyncio.ensure_future(stream.__anext__())
        done, _ = await asyncio.wait({first}, timeout=0.05)
        assert not done, "a [[gated]] request answered before its gate opened"
        assert client.num_in_flight == 1
        assert engine_double.open_gate() >= 1
        assert (await asyncio.wait_for(first, 3)).new_token_ids
        outputs = [out async for out in stream]
        assert outputs[-1].finish_reason == "stop"
        assert client.num_in_flight == 0
    finally:
        await client.close()


async def test_engine_client_error_path_drops_the_payload(engine_double, tiny_model_path):
    client = EngineClient.connect([engine_double.address])
    await client.start()
    try:
        request = _request(tiny_model_path, "[[error]] failing engine")
        refs = _payload_refs(request)
        stream = client.submit(request)
        del request
        with pytest.raises(EngineFailed) as e:
            async for _ in stream:
                pass
        assert e.value.__context__ is None and e.value.__cause__ is None
        del e
        await wait_collected_async(refs)
        assert client.num_in_flight == 0
    finally:
        await client.close()


# ------------------------------------------------------------------ app level: every hop at once


class RecordingLoader(MediaLoader):
    """Keeps weakrefs to what it produces; `gate` can hold decoding back."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.refs: list = []
        self.pixel_bytes: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    async def fetch(self, ref):
        encoded = await super().fetch(ref)
        self.refs.append(("encoded image", weakref.ref(encoded)))
        return encoded

    async def decode(self, image):
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        result = await super().decode(image)
        self.refs += [("image input", weakref.ref(result)), ("pixels", weakref.ref(result.pixels))]
        self.pixel_bytes.append(result.nbytes)
        return result


@pytest.fixture
def recorded(monkeypatch):
    """Weakrefs to each request body model and base64 string the pipeline sees."""
    refs: list = []
    real_parse = serving_module.parse_body

    def parse(model, body):
        req = real_parse(model, body)
        refs.append(("request model", weakref.ref(req)))
        return req

    class WeakRef(MediaRef):
        __slots__ = ()

        def __init__(self, url):
            url = WeakStr(url)  # the pipeline now holds a weak-referenceable copy
            refs.append(("base64 url", weakref.ref(url)))
            super().__init__(url)

    monkeypatch.setattr(serving_module, "parse_body", parse)
    monkeypatch.setattr(serving_module, "MediaRef", WeakRef)
    return refs


def _big_blocks(snapshot, min_size: int = 1 << 20) -> list:
    return [t for t in snapshot.traces if t.size >= min_size]


def _open_stream(server, content, **body):
    """Start a streaming chat request and read its first (role) chunk: sent once every
    choice is handed to the engine, before any engine output. The body is encoded up front
    (and by this test's own client) so it is not a traced allocation."""
    payload = json.dumps({"messages": [{"role": "user", "content": content}], "stream": True,
                          "max_tokens": 50, **body}).encode()
    return _open_stream_bytes(server, payload)


def _open_stream_bytes(server, payload: bytes):
    client = httpx.Client(timeout=30)
    cm = client.stream("POST", server.url + "/v1/chat/completions", content=payload,
                       headers={"content-type": "application/json"})
    response = cm.__enter__()
    assert response.status_code == 200
    lines = response.iter_lines()
    first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    return client, cm, lines, first


def _rest(lines) -> list[str]:
    return [line for line in lines if line.startswith("data: ")]


def big_image_content(text: str, n_images: int = 1):
    # noise does not compress: about 3 MB of PNG and 4 MB of base64 per image
    images = [encode_image(1024, 1024, seed=i) for i in range(n_images)]
    return [*({"type": "image_url", "image_url": {"url": data_url(im)}} for im in images),
            {"type": "text", "text": text}]


# sampling, log-probability and structured-output settings travel beside the images: they
# must not give the payload another holder
SETTINGS = {"logprobs": True, "top_logprobs": 2, "frequency_penalty": 0.5, "min_tokens": 1,
            "logit_bias": {"7": 1.0}, "response_format": {"type": "json_object"}}


@pytest.mark.parametrize("n, settings", [(1, {}), (3, {}), (2, SETTINGS)],
                         ids=["n1", "n3", "n2-settings"])
def test_streaming_request_holds_no_payload_after_handoff(start_app, engine_double, recorded, n,
                                                          settings):
    server = start_app(engine_double, loader_cls=RecordingLoader)
    loader = server.app.state.serving.loader
    admission = server.app.state.admission
    payload = json.dumps({"messages": [{"role": "user", "content": big_image_content(
        "[[gated]] keep streaming", n_images=2)}], "stream": True, "n": n,
        **settings}).encode()
    tracemalloc.start()
    try:
        client, cm, lines, first = _open_stream_bytes(server, payload)
        refs = recorded + loader.refs
        assert len([r for r in refs if r[0] == "pixels"]) == 2  # once per image, whatever n is
        wait_collected(refs, timeout=1.0)
        big = _big_blocks(tracemalloc.take_snapshot())
        assert big == [], [str(t.traceback) for t in big]
        # the engine holds every choice and has answered none: each still holds its share of
        # the budget, the bytes of the pixels the engine has not prefilled yet (R4)
        ids = {f"{first['id']}-{i}" for i in range(n)}
        assert ids <= set(engine_double.log()["running"])
        assert admission.in_flight_bytes == n * sum(loader.pixel_bytes) > 0
        assert engine_double.open_gate() >= n
        rest = _rest(lines)
        assert rest[-1] == "data: [DONE]"
        finished = [json.loads(line[6:])["choices"][0] for line in rest[:-1]]
        assert sorted(c["index"] for c in finished if c["finish_reason"] == "stop") == list(range(n))
        assert admission.in_flight_bytes == 0
    finally:
        tracemalloc.stop()
        cm.__exit__(None, None, None)
        client.close()


def test_client_disconnect_mid_stream(start_app, engine_double, recorded):
    server = start_app(engine_double, loader_cls=RecordingLoader)
    loader = server.app.state.serving.loader
    client, cm, lines, first = _open_stream(server, big_image_content("[[gated]] bye"))
    cm.__exit__(None, None, None)
    client.close()
    wait_collected(recorded + loader.refs, timeout=1.0)
    deadline = time.monotonic() + 5
    while f"{first['id']}-0" not in engine_double.log()["aborted"]:
        assert time.monotonic() < deadline, "engine request not aborted"
        time.sleep(0.05)
    assert f"{first['id']}-0" not in engine_double.log()["running"]
    assert server.app.state.engine_client.num_in_flight == 0
    assert server.app.state.admission.in_flight_bytes == 0


def test_engine_error_mid_stream(start_app, engine_double, recorded):
    server = start_app(engine_double, loader_cls=RecordingLoader)
    loader = server.app.state.serving.loader
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": big_image_content("[[error]] x")}],
            "stream": True}) as r:
        body = r.read().decode()
    assert "engine_error" in body and body.endswith("data: [DONE]\n\n")
    wait_collected(recorded + loader.refs)


def test_error_before_handoff_drops_the_payload(start_app, engine_double, recorded):
    server = start_app(engine_double, loader_cls=RecordingLoader)
    loader = server.app.state.serving.loader
    content = big_image_content("two images, one broken")
    content.insert(1, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400
    wait_collected(recorded + loader.refs)


def test_disconnect_while_waiting_for_admission(start_app, engine_double, recorded):
    image = encode_image(512, 512)
    server = start_app(engine_double, loader_cls=RecordingLoader, mm_inflight_budget=6_000_000)
    loader = server.app.state.serving.loader
    admission = server.app.state.admission
    loader.gate.clear()  # the first request decodes only when the gate opens

    def post(timeout):
        return httpx.post(server.url + "/v1/chat/completions", timeout=timeout, json={
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(image)}},
                {"type": "text", "text": "hello"}]}], "max_tokens": 2})

    first = threading.Thread(target=post, args=(30,))
    first.start()
    deadline = time.monotonic() + 10
    while admission.in_flight_bytes * 2 <= 6_000_000:  # its body's bytes, then its pixels'
        assert time.monotonic() < deadline
        time.sleep(0.01)
    held = admission.in_flight_bytes  # a second request's pixels have to wait
    with pytest.raises(httpx.ReadTimeout):
        post(timeout=1.0)  # waits in admission, then its client gives up
    deadline = time.monotonic() + 5
    while admission.num_waiting:
        assert time.monotonic() < deadline, "the disconnected waiter is still queued"
        time.sleep(0.01)
    second_refs = [r for r in recorded if r[0] != "request model"][-1:]
    wait_collected(second_refs)  # the waiter's payload is gone with it
    assert admission.in_flight_bytes == held
    loader.gate.set()
    first.join(30)
    wait_collected(recorded + loader.refs)
    assert admission.in_flight_bytes == 0


def test_over_budget_is_429_and_drops_the_payload(start_app, engine_double, recorded):
    image = encode_image(512, 512)
    server = start_app(engine_double, loader_cls=RecordingLoader, mm_inflight_budget=6_000_000,
                       admission_timeout_s=0.3)
    loader = server.app.state.serving.loader
    loader.gate.clear()
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": "hello"}]}], "max_tokens": 2}
    first = threading.Thread(target=httpx.post, args=(server.url + "/v1/chat/completions",),
                             kwargs={"json": body, "timeout": 30})
    first.start()
    while server.app.state.admission.in_flight_bytes * 2 <= 6_000_000:  # its pixels
        time.sleep(0.01)
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 429
    error = r.json()["error"]
    assert error["type"] == "rate_limit_error" and "multimodal budget" in error["message"]
    loader.gate.set()
    first.join(30)
    wait_collected(recorded + loader.refs)
    assert server.app.state.admission.in_flight_bytes == 0
    text = httpx.get(server.url + "/metrics").text
    assert 'flatserve_requests_total{endpoint="chat",status="429"} 1.0' in text


def test_engine_death_mid_stream(start_app, fresh_engine_double, recorded):
    server = start_app(fresh_engine_double, loader_cls=RecordingLoader)
    loader = server.app.state.serving.loader
    client, cm, lines, first = _open_stream(server, big_image_content("[[gated]] then die"))
    try:
        wait_collected(recorded + loader.refs, timeout=1.0)
        fresh_engine_double.kill()
        rest = _rest(lines)
    finally:
        cm.__exit__(None, None, None)
        client.close()
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: "):])["error"]["type"] == "service_unavailable"
    wait_collected(recorded + loader.refs)
    assert server.app.state.engine_client.num_in_flight == 0
    assert server.app.state.admission.in_flight_bytes == 0
