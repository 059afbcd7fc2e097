"""Stopping the server (what SIGTERM does: uvicorn's should_exit) drains the requests in
flight: no new connection is accepted, a request that finishes within shutdown_timeout_s
loses nothing, and one still running then ends with an error event and is aborted."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx


def open_stream(server, text: str):
    """A streaming chat request read on a thread; its SSE events once it ends."""
    events: list = []
    first = threading.Event()

    def run():
        body = {"messages": [{"role": "user", "content": text}], "stream": True,
                "max_tokens": 20}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    payload = line[len("data: "):]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
                    first.set()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, events, first


def refuses_connections(server) -> bool:
    try:
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
    except OSError:
        return True
    return False


def wait_until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_request_that_finishes_in_time_loses_nothing(start_app, fresh_engine_double):
    server = start_app(fresh_engine_double, shutdown_timeout_s=30)
    thread, events, _ = open_stream(server, "[[gated]] drain me")
    wait_until(lambda: server.app.state.engine_client.num_in_flight == 1, "never submitted")
    server.server.should_exit = True  # SIGTERM
    wait_until(lambda: refuses_connections(server), "still accepting connections")
    assert fresh_engine_double.open_gate() == 1
    thread.join(20)
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"  # all 20 tokens came
    server.thread.join(20)
    assert not server.thread.is_alive()


def test_a_request_still_running_at_the_timeout_ends_with_an_error(start_app,
                                                                   fresh_engine_double):
    server = start_app(fresh_engine_double, shutdown_timeout_s=0.3)
    thread, events, first = open_stream(server, "[[hang]] never ends")
    assert first.wait(10)
    rid = events[0]["id"] + "-0"
    server.server.should_exit = True  # SIGTERM
    thread.join(20)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "server_shutting_down" and "shutdown_timeout_s=0.3" in error["message"]
    wait_until(lambda: rid in fresh_engine_double.log()["aborted"], "not aborted in the engine")
    server.thread.join(20)
    assert not server.thread.is_alive()
