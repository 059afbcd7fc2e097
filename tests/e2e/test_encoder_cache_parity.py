"""Through real HTTP and real processes: greedy answers are the same with the encoder cache
on and off, and with it on the second request with an image sends no pixels."""

from __future__ import annotations

import httpx
import pytest

from tests.api_proc.conftest import data_url, encode_image
from tests.e2e.server_process import ServerProcess


def ask(url: str, png: bytes, text: str) -> str:
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png)}},
        {"type": "text", "text": text}]}], "max_tokens": 10, "temperature": 0}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def answers(tmp_path_factory, tiny_model_path):
    images = [encode_image(96, 64, seed=1), encode_image(96, 64, seed=2)]
    plan = [(0, "what is this"), (0, "and again"), (1, "what is this"), (0, "once more")]
    results = {}
    for budget in ("0", "-1"):
        log = tmp_path_factory.mktemp("server") / f"cache{budget}.log"
        proc = ServerProcess("--encoder-cache-bytes", budget, log_path=log)
        try:
            proc.wait_ready()
            texts = [ask(proc.url, images[i], text) for i, text in plan]
            counts = {name: metric(proc.url, name) for name in (
                "flatserve_image_bytes_skipped_total", "flatserve_encoder_cache_hits_total",
                "flatserve_image_resubmits_total")}
            results[budget] = texts, counts
        finally:
            proc.stop()
    return results


def test_greedy_answers_equal_with_the_cache_on_and_off(answers):
    assert answers["0"][0] == answers["-1"][0]


def test_only_the_cache_on_skips_pixels(answers):
    off, on = answers["0"][1], answers["-1"][1]
    assert off["flatserve_image_bytes_skipped_total"] == 0
    assert off["flatserve_encoder_cache_hits_total"] == 0
    assert on["flatserve_image_bytes_skipped_total"] > 0
    assert on["flatserve_encoder_cache_hits_total"] == 2  # image 0, second and fourth time
    assert on["flatserve_image_resubmits_total"] == 0
