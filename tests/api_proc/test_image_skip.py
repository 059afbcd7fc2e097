"""The API leaves out the pixels of images the engine's encoder cache holds, and a stale
mirror (the engine evicted the image before the request arrived) still answers correctly:
the engine refuses with IMAGE_MISSING and the API resubmits with pixels, unseen by the
client. A real engine process (EngineProcess on a thread) behind the real app."""

from __future__ import annotations

import threading
import time
import weakref

import httpx
import pytest

from engine_proc.engine_process import EngineProcess
from rpc.sockets import IpcDir
from shared.engine_config import EngineConfig
from shared.image_key import encoded_key
from shared.messages import AddRequest
from tests.api_proc.conftest import data_url, encode_image


class _Engine:
    """An engine process on a thread; `adds` logs (request id, pixels sent per image)."""

    def __init__(self, model: str, address: str) -> None:
        config = EngineConfig(model=model, address=address, kv_cache_memory_bytes=32 << 20,
                              max_num_seqs=8)
        self.process = EngineProcess(config)
        self.address = address
        self.adds: list[tuple[str, list[bool]]] = []
        add_request = self.process.engine.add_request

        def observe(request: AddRequest) -> None:
            self.adds.append((request.request_id, [im.pixels is not None for im in request.images]))
            add_request(request)

        self.process.engine.add_request = observe
        self.thread = threading.Thread(target=self.process.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.process.stop()
        self.thread.join(timeout=10)


@pytest.fixture
def engine(tiny_model_path):
    with IpcDir() as ipc:
        engine = _Engine(str(tiny_model_path), ipc.address("engine"))
        engine.process_handle = None
        yield engine
        engine.stop()


class _Handle:
    def __init__(self, engine: _Engine) -> None:
        self.address = engine.address
        self.process = None


def ask(server, png: bytes) -> str:
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png)}},
        {"type": "text", "text": "describe"}]}], "max_tokens": 8, "temperature": 0}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_cached_image_crosses_without_pixels(start_app, engine):
    server = start_app(_Handle(engine))
    png = encode_image(64, 48, seed=3)
    first = ask(server, png)
    assert ask(server, png) == first
    assert [pixels for _, pixels in engine.adds] == [[True], [False]]
    assert metric(server, "flatserve_image_bytes_skipped_total") > 0
    assert metric(server, "flatserve_image_decodes_skipped_total") == 1
    assert metric(server, "flatserve_encoder_cache_hits_total") == 1
    assert metric(server, "flatserve_encoder_cache_queries_total") == 2
    assert metric(server, "flatserve_encoder_cache_entries") == 1
    assert metric(server, "flatserve_image_resubmits_total") == 0


def test_eviction_race_resubmits_with_pixels(start_app, engine, image_config):
    server = start_app(_Handle(engine))
    connection = server.app.state.engine_client.engines[0]
    cache = engine.process.engine.encoder_cache
    png_x, png_y = encode_image(64, 48, seed=3), encode_image(64, 48, seed=4)
    answer_x = ask(server, png_x)
    cache.max_bytes = cache.num_bytes  # room for one image: y evicts x
    ask(server, png_y)
    key_x = encoded_key(png_x, image_config)
    deadline = time.monotonic() + 5
    while connection.holds_image(key_x):  # the engine told the API: x is gone
        assert time.monotonic() < deadline
        time.sleep(0.01)
    connection.encoder_keys[key_x] = None  # ...but say that news is still on its way
    assert ask(server, png_x) == answer_x
    third = [pixels for rid, pixels in engine.adds[2:]]
    assert third == [[False], [True]], "expected a pixel-less add, then the resubmit"
    assert engine.adds[2][0] == engine.adds[3][0]
    assert metric(server, "flatserve_image_resubmits_total") == 1


@pytest.mark.usefixtures("no_garbage_collector")
def test_kept_encoded_bytes_go_at_the_first_output(start_app, engine):
    """R1: a request sent without pixels keeps its images' encoded bytes only until the
    engine's first output for it."""
    from api_proc.image_resubmit import KeptImages

    server = start_app(_Handle(engine))
    png = encode_image(64, 48, seed=5)
    ask(server, png)
    kept_refs: list[weakref.ref] = []
    init = KeptImages.__init__

    def spy(self, encoded, reservation):
        init(self, encoded, reservation)
        kept_refs.extend(weakref.ref(e) for e in encoded)
        kept_refs.append(weakref.ref(self))

    KeptImages.__init__ = spy
    try:
        ask(server, png)
    finally:
        KeptImages.__init__ = init
    assert kept_refs, "the second request was not sent without pixels"
    deadline = time.monotonic() + 3
    while any(r() is not None for r in kept_refs):
        assert time.monotonic() < deadline, "the encoded bytes outlived the first output"
        time.sleep(0.05)
    assert server.app.state.admission.in_flight_bytes == 0


def test_a_cached_image_needs_no_more_budget_than_a_new_one(start_app, engine):
    # the case: a budget a new image fits was too small for the same image cached
    import asyncio

    from api_proc.media_loader import MediaRef

    png, other = encode_image(256, 256, seed=6), encode_image(256, 256, seed=7)
    probe = start_app(_Handle(engine)).app.state.serving.loader
    need = max(asyncio.run(probe.fetch(MediaRef(data_url(p)))).need_bytes for p in (png, other))
    server = start_app(_Handle(engine), mm_inflight_budget=need)
    first = ask(server, png)  # a miss: decoded, within the budget
    for _ in range(3):
        assert ask(server, png) == first  # hits
    assert [pixels for _, pixels in engine.adds] == [[True], [False], [False], [False]]
    ask(server, other)  # a new image of the same size
    assert server.app.state.admission.in_flight_bytes == 0
