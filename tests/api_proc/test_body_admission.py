"""Request bodies count against the multimodal budget as they arrive (R4).

A crowd of clients uploading base64 images must not hold more than the budget in request
bodies: a large body waits for budget (429 after the timeout) while the rest of its bytes
stay in the socket, small bodies are not queued at all, and a body that has been read
exchanges its bytes for its images' pixel bytes.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from api_proc.media_loader import MediaLoader
from api_proc.request_body import BODY_ADMISSION_MIN_BYTES
from tests.api_proc.conftest import data_url, encode_image

BUDGET = 6_000_000


class GatedLoader(MediaLoader):
    """Decoding waits until `gate` is set."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.gate = threading.Event()

    async def decode(self, image):
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        return await super().decode(image)


def image_request(image: bytes) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": "hello"}]}], "max_tokens": 2}


def big_text_request(nbytes: int) -> dict:
    return {"messages": [{"role": "user", "content": "x " * (nbytes // 2)}], "max_tokens": 2}


def hold_budget_with_a_gated_image(server, loader) -> threading.Thread:
    """Start an image request whose pixel reservation holds more than half the budget."""
    first = threading.Thread(target=httpx.post, args=(server.url + "/v1/chat/completions",),
                             kwargs={"json": image_request(encode_image(512, 512)),
                                     "timeout": 30})
    first.start()
    deadline = time.monotonic() + 10
    while server.app.state.admission.in_flight_bytes * 2 <= BUDGET:
        assert time.monotonic() < deadline, "the first request never reserved its pixels"
        time.sleep(0.01)
    return first


def test_large_body_waits_for_budget_and_small_one_does_not(start_app, engine_double):
    server = start_app(engine_double, loader_cls=GatedLoader, mm_inflight_budget=BUDGET,
                       admission_timeout_s=0.5)
    loader = server.app.state.serving.loader
    admission = server.app.state.admission
    first = hold_budget_with_a_gated_image(server, loader)
    held = admission.in_flight_bytes

    small = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert small.status_code == 200  # text with a small body is never queued

    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json=big_text_request(2_000_000))  # reserves 2x its size: does not fit
    assert r.status_code == 429
    assert "multimodal budget" in r.json()["error"]["message"]
    assert admission.in_flight_bytes == held and admission.num_waiting == 0

    loader.gate.set()
    first.join(30)
    assert admission.in_flight_bytes == 0


def test_chunked_body_without_length_is_admitted_as_it_arrives(start_app, engine_double):
    server = start_app(engine_double, loader_cls=GatedLoader, mm_inflight_budget=BUDGET,
                       admission_timeout_s=0.5)
    loader = server.app.state.serving.loader
    admission = server.app.state.admission
    payload = httpx.Request("POST", "/", json=image_request(encode_image(256, 256))).content
    assert len(payload) > BODY_ADMISSION_MIN_BYTES

    def chunks():  # a generator body goes out chunked, with no Content-Length
        for i in range(0, len(payload), 16384):
            yield payload[i : i + 16384]

    first = hold_budget_with_a_gated_image(server, loader)
    held = admission.in_flight_bytes
    filler = b" " * (BUDGET - held)  # JSON whitespace: pushes the body past what is free

    def padded():
        yield from chunks()
        yield filler

    r = httpx.post(server.url + "/v1/chat/completions", content=padded(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 429
    assert admission.in_flight_bytes == held and admission.num_waiting == 0

    loader.gate.set()
    first.join(30)
    r = httpx.post(server.url + "/v1/chat/completions", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert admission.in_flight_bytes == 0


def test_bad_large_body_gives_its_budget_back(start_app, engine_double):
    server = start_app(engine_double, mm_inflight_budget=BUDGET)
    admission = server.app.state.admission
    bad = b'{"messages": [' + b" " * 500_000  # not JSON
    r = httpx.post(server.url + "/v1/chat/completions", content=bad, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    too_long = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                          json=big_text_request(1_000_000))  # past max_model_len
    assert too_long.status_code == 400
    assert admission.in_flight_bytes == 0 and admission.num_waiting == 0
