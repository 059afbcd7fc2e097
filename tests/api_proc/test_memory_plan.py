"""The API process's memory plan holds under a burst of image bytes larger than its budget:
admission makes the burst wait, and RSS stays inside the plan computed from the budgets."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import tracemalloc

import httpx
import psutil

from api_proc.memory_plan import REQUEST_OBJECTS_BYTES, EngineCapacity, api_plan
from shared.memory import API_MALLOC_ENV, apply_malloc_settings
from tests.api_proc.conftest import data_url, encode_image

BUDGET = 16 << 20
NUM_REQUESTS = 48
IMAGE_SIZE = 1024  # noise: a 3 MB PNG, a 4 MB body, 3 MB decoded and 3 MB resized


class PeakSampler:
    """This process's RSS, read every few milliseconds on a thread; the peak seen."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        process = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, process.memory_info().rss)
            self._stop.wait(0.003)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def body(seed: int) -> bytes:
    image = encode_image(IMAGE_SIZE, IMAGE_SIZE, seed=seed, compress_level=0)
    return json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": "what is it?"}]}], "max_tokens": 2}).encode()


def test_a_burst_larger_than_the_budget_stays_inside_the_plan(start_app, engine_double):
    server = start_app(engine_double, mm_inflight_budget=BUDGET, admission_timeout_s=120,
                       max_model_len=8192)
    config, admission = server.app.state.config, server.app.state.admission
    url = server.url + "/v1/chat/completions"
    headers = {"content-type": "application/json"}
    # the bodies exist before the plan is measured: they are the clients', sent without a copy
    bodies = [body(seed) for seed in range(NUM_REQUESTS)]
    apply_malloc_settings(API_MALLOC_ENV)  # as the API process runs (flatserve/launcher.py)
    assert sum(map(len, bodies)) > 10 * BUDGET
    assert httpx.post(url, content=body(99), headers=headers, timeout=60).status_code == 200
    plan = api_plan(config, [EngineCapacity(64, 64)], psutil.Process().memory_info().rss)

    def send(data: bytes) -> int:
        return client.post(url, content=data, headers=headers).status_code

    peak_in_flight = 0
    limits = httpx.Limits(max_connections=NUM_REQUESTS)
    with httpx.Client(timeout=120, limits=limits) as client, PeakSampler() as rss, \
            concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as pool:
        statuses = pool.map(send, bodies)
        done = threading.Event()
        results: list[int] = []

        def collect() -> None:
            results.extend(statuses)
            done.set()

        watcher = threading.Thread(target=collect)
        watcher.start()
        while not done.wait(0.003):
            peak_in_flight = max(peak_in_flight, admission.in_flight_bytes)
        watcher.join()
    assert results == [200] * NUM_REQUESTS
    assert BUDGET // 2 < peak_in_flight <= BUDGET  # the burst waited for its budget
    assert rss.peak <= plan.total, (rss.peak >> 20, plan.total >> 20)


# what the test's own clients allocate in this process: not the server's
CLIENT_CODE = ("*/httpx/*", "*/httpcore/*", "*/h11/*", "*/threading.py", "*/concurrent/futures/*")


def server_bytes(snapshot: tracemalloc.Snapshot) -> int:
    kept = snapshot.filter_traces([tracemalloc.Filter(False, f) for f in CLIENT_CODE])
    return sum(stat.size for stat in kept.statistics("filename"))


def test_a_request_an_engine_holds_costs_the_api_less_than_its_plan_counts(
        start_app, fresh_engine_double):
    """REQUEST_OBJECTS_BYTES against what Python allocates in the server for requests held
    at the engine: their connection, task, stream and response writer (the test's clients
    run in this process; their allocations are left out by file)."""
    server = start_app(fresh_engine_double)
    url = server.url + "/v1/chat/completions"
    held = 48
    request = {"messages": [{"role": "user", "content": "[[gated]] hello"}], "max_tokens": 4,
               "stream": True}
    with httpx.Client(timeout=60, limits=httpx.Limits(max_connections=held)) as client:
        warm = {"messages": [{"role": "user", "content": "warm"}], "max_tokens": 4}
        assert client.post(url, json=warm).status_code == 200
        tracemalloc.start()
        try:
            before = server_bytes(tracemalloc.take_snapshot())
            with concurrent.futures.ThreadPoolExecutor(held) as pool:
                replies = [pool.submit(lambda: client.post(url, json=request)) for _ in range(held)]
                deadline = time.monotonic() + 60
                while len(fresh_engine_double.log()["running"]) < held:
                    assert time.monotonic() < deadline, "the requests never reached the engine"
                    time.sleep(0.05)
                per_request = (server_bytes(tracemalloc.take_snapshot()) - before) / held
                fresh_engine_double.open_gate()
                assert [r.result().status_code for r in replies] == [200] * held
        finally:
            tracemalloc.stop()
    assert 0 < per_request < REQUEST_OBJECTS_BYTES, per_request
