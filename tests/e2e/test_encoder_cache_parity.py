"""Through real HTTP and real processes: greedy answers are the same with the encoder cache
on and off, and with it on the second request with an image (or the same video) sends no
pixels: a video sent again is neither decoded nor encoded."""

from __future__ import annotations

import httpx
import pytest

from tests.api_proc.conftest import data_url, encode_image
from tests.e2e.server_process import ServerProcess
from tests.video.clips import data_url as video_data_url
from tests.video.clips import make_clip

COUNTERS = ("flatserve_image_bytes_skipped_total", "flatserve_encoder_cache_hits_total",
            "flatserve_image_resubmits_total", "flatserve_image_decodes_skipped_total")


def ask(url: str, png: bytes, text: str, kind: str = "image") -> str:
    media = data_url(png) if kind == "image" else video_data_url(png)
    body = {"messages": [{"role": "user", "content": [
        {"type": f"{kind}_url", f"{kind}_url": {"url": media}},
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
    clip = make_clip(7, 96, 64)  # 4 temporal groups
    plan = [(0, "what is this"), (0, "and again"), (1, "what is this"), (0, "once more")]
    results = {}
    for budget in ("0", "-1"):
        log = tmp_path_factory.mktemp("server") / f"cache{budget}.log"
        proc = ServerProcess("--encoder-cache-bytes", budget, log_path=log)
        try:
            proc.wait_ready()
            texts = [ask(proc.url, images[i], text) for i, text in plan]
            counts = {name: metric(proc.url, name) for name in COUNTERS}
            video = [ask(proc.url, clip, text, "video") for text in ("what happens", "again")]
            after = {name: metric(proc.url, name) - counts[name] for name in COUNTERS}
            results[budget] = texts, counts, video, after
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


def test_a_video_sent_again_is_neither_decoded_nor_encoded(answers):
    assert answers["0"][2] == answers["-1"][2]
    off, on = answers["0"][3], answers["-1"][3]
    assert off["flatserve_image_decodes_skipped_total"] == 0
    assert off["flatserve_encoder_cache_hits_total"] == 0
    assert on["flatserve_image_decodes_skipped_total"] == 1  # the second time
    assert on["flatserve_encoder_cache_hits_total"] == 4  # each of its 4 groups
    assert on["flatserve_image_bytes_skipped_total"] == 7 * 56 * 84 * 3
    assert on["flatserve_image_resubmits_total"] == 0
