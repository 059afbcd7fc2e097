"""--sse-keep-alive-interval S (vLLM's): a streamed response that has written nothing for S
seconds (here: a request the engine double holds, as a long prefill) writes an SSE comment
line, which proxies see as traffic and clients skip; none while tokens flow, none by
default."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

KEEP_ALIVE = ": keep-alive"


def stream_lines(server, content: str) -> list[tuple[float, str]]:
    """The response's non-empty lines with the seconds since the request was sent."""
    start, lines = time.monotonic(), []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": content}], "stream": True,
            "max_tokens": 8}) as r:
        assert r.status_code == 200
        lines = [(time.monotonic() - start, line) for line in r.iter_lines() if line]
    return lines


def has_text(line: str) -> bool:
    if not line.startswith("data: {"):
        return False
    choices = json.loads(line[len("data: "):])["choices"]
    return bool(choices and choices[0]["delta"].get("content"))


class GateOpener:
    """`with GateOpener(double, delay):` from `delay` seconds on, opens the double's gate
    every 0.05 s until the block ends (a request that reaches it late goes on too)."""

    def __init__(self, engine_double, delay: float) -> None:
        self.double, self.delay = engine_double, delay
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        if self.stop.wait(self.delay):
            return
        while not self.stop.wait(0.05):
            self.double.open_gate()

    def __enter__(self) -> GateOpener:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


@pytest.fixture
def keeping_alive(start_app, engine_double):
    return start_app(engine_double, sse_keep_alive_interval=0.2)


def test_a_silent_stream_writes_comment_lines_until_its_tokens_come(keeping_alive,
                                                                    engine_double):
    with GateOpener(engine_double, 0.9):
        lines = stream_lines(keeping_alive, "[[gated]] hold me a while please")
    first_data = next(i for i, (_, line) in enumerate(lines) if has_text(line))
    kept = [t for t, line in lines[:first_data] if line == KEEP_ALIVE]
    assert len(kept) >= 2, lines[:first_data]  # ~0.2, 0.4, 0.6, 0.8 s
    assert all(b - a >= 0.15 for a, b in zip(kept, kept[1:], strict=False)), kept
    assert all(line != KEEP_ALIVE for _, line in lines[first_data:])  # tokens every 2 ms
    assert lines[-1][1] == "data: [DONE]"


def test_clients_read_the_same_answer_through_the_comments(keeping_alive, engine_double):
    client = openai.OpenAI(base_url=keeping_alive.url + "/v1", api_key="unused",
                           max_retries=0)
    messages = [{"role": "user", "content": "[[gated]] two three four"}]
    with GateOpener(engine_double, 0.6):
        chunks = list(client.chat.completions.create(model=None, messages=messages,
                                                     max_tokens=8, stream=True))
    with GateOpener(engine_double, 0.0):
        whole = client.chat.completions.create(model=None, messages=messages, max_tokens=8)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content != ""


def test_no_comment_lines_by_default(start_app, engine_double):
    server = start_app(engine_double)
    with GateOpener(engine_double, 0.6):
        lines = stream_lines(server, "[[gated]] hold me")
    assert all(line != KEEP_ALIVE for _, line in lines) and lines[-1][1] == "data: [DONE]"


def test_intervals_below_a_tenth_of_a_second_are_refused(make_config):
    for seconds in (-1.0, 0.01, float("nan")):
        with pytest.raises(ValueError, match="sse_keep_alive_interval must be 0 .off. or at "
                                             "least 0.1 seconds"):
            make_config(sse_keep_alive_interval=seconds)
