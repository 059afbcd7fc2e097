"""Request bodies on real sockets: a declared length reserves nothing until bytes arrive, a
body must arrive within body_read_timeout_s, and at most max_unread_bodies are read at once."""

from __future__ import annotations

import json
import socket
import time

import httpx

from api_proc.request_body import BODY_ADMISSION_MIN_BYTES
from tests.api_proc.conftest import data_url, encode_image

HUGE = 209_714_176  # 200 MiB, the default max_body_bytes


def open_body(server, declared: int, first: bytes = b"") -> socket.socket:
    """A chat request whose headers declare `declared` body bytes, of which only `first`
    is sent."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nConnection: close\r\n"
                 b"Content-Length: %d\r\n\r\n" % declared + first)
    return sock


def read_status(sock: socket.socket) -> int:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return int(data.split(b" ", 2)[1]) if data else 0


def wait_until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def image_request() -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(encode_image(64, 64))}},
        {"type": "text", "text": "hello"}]}], "max_tokens": 2}


def test_declared_lengths_without_bodies_hold_no_budget(start_app, engine_double):
    # the six connections: 2 x 200 MiB each would have reserved the whole 2 GiB
    server = start_app(engine_double, admission_timeout_s=1.0)
    admission, bodies = server.app.state.admission, server.app.state.bodies
    socks = [open_body(server, HUGE) for _ in range(6)]
    wait_until(lambda: bodies.num_unread == 6, "the six bodies were never being read")
    assert admission.in_flight_bytes == 0
    r = httpx.post(server.url + "/v1/chat/completions", json=image_request(), timeout=30)
    assert r.status_code == 200, r.text
    # bytes that do arrive are held (twice, for parsing), in doubling steps
    more = open_body(server, HUGE, b"{" + b" " * (4 * BODY_ADMISSION_MIN_BYTES))
    wait_until(lambda: admission.in_flight_bytes >= 2 * 4 * BODY_ADMISSION_MIN_BYTES,
               "the arrived bytes were never reserved")
    assert admission.in_flight_bytes <= 4 * 4 * BODY_ADMISSION_MIN_BYTES
    for sock in [*socks, more]:
        sock.close()
    wait_until(lambda: bodies.num_unread == 0 and admission.in_flight_bytes == 0,
               "closed connections kept their bodies or budget")


def test_a_body_too_slow_to_arrive_is_408_and_closed(start_app, engine_double):
    server = start_app(engine_double, body_read_timeout_s=0.5)
    body = json.dumps({"messages": [{"role": "user", "content": "drip"}]}).encode()
    sock = open_body(server, len(body))
    sent = 0
    try:
        for byte in body:  # one byte every 50 ms: the body would take seconds
            sock.sendall(bytes([byte]))
            sent += 1
            time.sleep(0.05)
    except OSError:
        pass
    sock.settimeout(10)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    sock.close()
    assert sent < len(body)
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    error = json.loads(payload)["error"]
    assert error["code"] == "body_timeout" and "body_read_timeout_s=0.5" in error["message"]
    assert server.app.state.bodies.num_unread == 0


def test_at_most_max_unread_bodies_are_read_at_once(start_app, engine_double):
    server = start_app(engine_double, max_unread_bodies=2, body_read_timeout_s=0.5)
    bodies = server.app.state.bodies
    socks = [open_body(server, 1000) for _ in range(3)]
    wait_until(lambda: bodies.num_unread == 2 and bodies.num_waiting == 1,
               "the third body did not wait for a turn")
    statuses = sorted(read_status(sock) for sock in socks)
    assert statuses[:2] == [408, 408] and statuses[2] in (408, 429)
    assert bodies.num_unread == 0 and bodies.num_waiting == 0
    assert httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "after"}], "max_tokens": 2}).status_code == 200


def test_bodies_that_fill_the_budget_waiting_to_grow_all_complete(start_app, engine_double):
    # two bodies reserved as they arrive: b cannot grow beside a, and a then cannot grow
    # beside b's wait. Each waits holding nothing, for all it can need: both complete (they
    # once held their parts while waiting for more, and at load every request stalled)
    server = start_app(engine_double, mm_inflight_budget=1_000_000, admission_timeout_s=30)
    admission = server.app.state.admission
    body = json.dumps({"messages": [{"role": "user", "content": "grow"}], "max_tokens": 2})
    body = (b" " * (700_000 - len(body)) + body.encode())
    a = open_body(server, len(body), body[:200_000])
    wait_until(lambda: admission.in_flight_bytes >= 400_000, "a's bytes were not reserved")
    b = open_body(server, len(body), body[:320_000])
    wait_until(lambda: admission.num_waiting == 1, "b did not wait for budget")
    a.sendall(body[200_000:])
    b.sendall(body[320_000:])
    assert read_status(a) == 200
    assert read_status(b) == 200
    a.close()
    b.close()
    wait_until(lambda: admission.in_flight_bytes == 0, "budget not given back")
