"""A streaming response whose writes suspend (the transport paused: the client reads slower
than the server writes): the chunks written meanwhile wait behind the suspended write
(sync_send.py), past a limit the streams pause until the backlog is out, and the client
still receives the whole response, in order, as a client whose writes never wait does. Real app on uvicorn, real sockets, the engine double; a
middleware makes some writes wait as a paused transport does."""

from __future__ import annotations

import asyncio
import json

import httpx

from api_proc import responses, sync_send
from api_proc.app import build_app
from api_proc.engine_client import RequestStream
from tests.api_proc.conftest import AppServer

WORDS = " ".join(f"word{i}" for i in range(150))


class SlowWrites:
    """ASGI middleware: every 7th body write of a response waits 50 ms before it goes."""

    def __init__(self, app, switch: dict) -> None:
        self.app = app
        self.switch = switch

    async def __call__(self, scope, receive, send):
        count = 0

        async def slow_send(message):
            nonlocal count
            if self.switch["on"] and message["type"] == "http.response.body":
                count += 1
                if count % 7 == 0:
                    await asyncio.sleep(0.05)
            await send(message)

        await self.app(scope, receive, slow_send)


def _texts(response: httpx.Response) -> dict[int, str]:
    texts: dict[int, str] = {}
    lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for choice in json.loads(line[6:])["choices"]:
            delta = choice["delta"].get("content") or ""
            texts[choice["index"]] = texts.get(choice["index"], "") + delta
    return texts


def test_chunks_written_behind_a_waiting_write_arrive_whole_and_in_order(
        make_config, engine_double, monkeypatch):
    suspended = []
    finish = sync_send.SyncSend._finish
    monkeypatch.setattr(sync_send.SyncSend, "_finish",
                        lambda self, *a: (suspended.append(1), finish(self, *a))[1])
    app = build_app(make_config(engine_addresses=(engine_double.address,)),
                    engine_processes=[engine_double.process])
    switch = {"on": False}
    app.add_middleware(SlowWrites, switch=switch)
    server = AppServer(app)
    try:
        url = server.url + "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": WORDS}], "max_tokens": 1000,
                "stream": True, "n": 3}
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            expected = _texts(r)
        assert sorted(expected) == [0, 1, 2] and all(len(t) > 500 for t in expected.values())
        assert not suspended

        switch["on"] = True
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            got = _texts(r)
        assert suspended, "no write waited: the test tested nothing"
        assert got == expected
        assert app.state.engine_client.num_in_flight == 0

        # past the backlog limit the streams pause (tokens merge in the engine client) and
        # go on once the backlog is out: still the same text, in order
        monkeypatch.setattr(responses, "MAX_BACKLOG_BYTES", 0)
        pauses = []
        pause = RequestStream.pause
        monkeypatch.setattr(RequestStream, "pause", lambda self: (pauses.append(1), pause(self)))
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            got = _texts(r)
        assert pauses, "no stream paused: the test tested nothing"
        assert got == expected
        assert app.state.engine_client.num_in_flight == 0
    finally:
        server.stop()
