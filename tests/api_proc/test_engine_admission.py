"""Image bytes queued in the engines count against the multimodal budget (R4).

A request's resized pixels keep their share of the budget after the handoff, until the
engine's first output for that request: by then the engine has encoded the images and freed
their pixels and embeddings (R3). So `--mm-inflight-budget` bounds the pixels an engine
holds for requests it has not prefilled yet, however many clients send images at once.
"""

from __future__ import annotations

import json
import threading
import time

import httpx

from api_proc.media_loader import probe_image
from tests.api_proc.conftest import encode_image
from tests.api_proc.test_app import assert_error, chat, image_content

IMAGE = encode_image(512, 512)


def image_bytes(image_config) -> tuple[int, int]:
    """(bytes admission reserves to decode IMAGE, bytes of its resized pixels)."""
    encoded = probe_image(IMAGE, 40_000_000, image_config)
    return encoded.need_bytes, encoded.resized_bytes


def post_in_background(server, **body) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def post():
        result["response"] = chat(server, image_content(IMAGE, text="[[gated]] look"), **body)

    thread = threading.Thread(target=post)
    thread.start()
    return thread, result


def open_gate(double, thread: threading.Thread, result: dict) -> httpx.Response:
    """Let the gated request's engine answer; its response, which must be a 200."""
    assert double.open_gate() >= 1
    thread.join(30)
    assert result["response"].status_code == 200, result["response"].text
    return result["response"]


def wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_pixels_hold_the_budget_until_the_engine_has_prefilled_them(
        start_app, fresh_engine_double, image_config):
    server = start_app(fresh_engine_double)
    admission = server.app.state.admission
    _, resized = image_bytes(image_config)
    thread, result = post_in_background(server)
    wait_for(lambda: fresh_engine_double.log()["requests"], "the handoff")
    # decoding is over and the engine has the request, but has not answered yet
    wait_for(lambda: admission.in_flight_bytes == resized, "the pixel bytes alone to be held")
    open_gate(fresh_engine_double, thread, result)
    assert admission.in_flight_bytes == 0


def test_each_choice_holds_its_own_copy_until_its_first_output(
        start_app, fresh_engine_double, image_config):
    server = start_app(fresh_engine_double)
    admission = server.app.state.admission
    _, resized = image_bytes(image_config)
    thread, result = post_in_background(server, n=3)
    wait_for(lambda: len(fresh_engine_double.log()["requests"]) == 3, "three engine requests")
    assert admission.in_flight_bytes == 3 * resized  # the engines hold three copies
    assert len(open_gate(fresh_engine_double, thread, result).json()["choices"]) == 3
    assert admission.in_flight_bytes == 0


def test_images_queued_in_an_engine_keep_new_image_requests_waiting(
        start_app, fresh_engine_double, image_config):
    need, resized = image_bytes(image_config)
    budget = need + resized // 2  # room for one request, not for a second next to its pixels
    server = start_app(fresh_engine_double, mm_inflight_budget=budget, admission_timeout_s=0.5)
    admission = server.app.state.admission
    thread, result = post_in_background(server)
    wait_for(lambda: admission.in_flight_bytes == resized, "the first request's handoff")

    assert chat(server, "text needs no budget").status_code == 200
    r = chat(server, image_content(IMAGE))
    assert_error(r, 429, match="multimodal budget")
    assert admission.in_flight_bytes == resized and admission.num_waiting == 0
    assert len(fresh_engine_double.log()["requests"]) == 2  # the gated one and the text one

    open_gate(fresh_engine_double, thread, result)
    assert chat(server, image_content(IMAGE)).status_code == 200
    assert admission.in_flight_bytes == 0


def test_a_client_leaving_before_the_prefill_gives_the_budget_back(
        start_app, fresh_engine_double, image_config):
    server = start_app(fresh_engine_double)
    admission = server.app.state.admission
    _, resized = image_bytes(image_config)
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": image_content(IMAGE, text="[[gated]]")}],
            "stream": True, "max_tokens": 4}) as r:
        lines = r.iter_lines()  # kept: a dropped line iterator closes the connection
        first = json.loads(next(lines)[len("data: "):])  # the role chunk
        wait_for(lambda: admission.in_flight_bytes == resized, "the handoff")
    rid = first["id"] + "-0"

    def stopped() -> bool:
        log = fresh_engine_double.log()
        return rid in log["aborted"] and rid not in log["running"]

    wait_for(stopped, "the engine to stop it")
    wait_for(lambda: admission.in_flight_bytes == 0, "the budget to come back")
    assert server.app.state.engine_client.num_in_flight == 0
