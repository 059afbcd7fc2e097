"""A request's head (request line and headers) is bounded in bytes (431) and in time (408),
on real sockets against the app served by uvicorn with the project's protocol."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """Status, headers and body of the one response the server sends before closing."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


@pytest.fixture
def server(start_app, engine_double):
    return start_app(engine_double, max_header_bytes=16384, header_read_timeout_s=0.5)


def test_a_head_past_max_header_bytes_is_431(server):
    sock = connect(server)
    # no end of headers: the parser must stop at the cap, not wait for one
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 20_000)
    status, headers, body = read_response(sock)
    sock.close()
    assert status == 431 and headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["code"] == "headers_too_large" and "max_header_bytes=16384" in error["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_head_under_the_cap_is_served(server):
    r = httpx.get(server.url + "/health", headers={"X-Pad": "a" * 15_000})
    assert r.status_code == 200


def test_the_cap_applies_to_every_request_of_a_connection(server):
    # pipelined: the second head is cut too (within twice the cap, see http_protocol.py)
    sock = connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                 b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 40_000)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    assert data.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 431" in data


def test_an_unfinished_head_times_out_with_408(server):
    sock = connect(server)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    status, _, body = read_response(sock)
    sock.close()
    assert status == 408
    assert "header_read_timeout_s=0.5" in json.loads(body)["error"]["message"]


def test_a_silent_connection_is_closed(server):
    sock = connect(server)
    status, _, _ = read_response(sock)  # nothing sent at all
    sock.close()
    assert status == 408


def test_a_slowloris_head_is_cut(server):
    # one byte every 50 ms: the head would take 5 s; the server stops it at 0.5 s
    sock = connect(server)
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100 + b"\r\n\r\n"
    sent = 0
    try:
        for byte in head:
            sock.sendall(bytes([byte]))
            sent += 1
            time.sleep(0.05)
    except OSError:  # the server closed the connection
        pass
    sock.settimeout(10)
    try:
        data = sock.recv(65536)
    except OSError:
        data = b""
    sock.close()
    assert sent < len(head)
    assert data == b"" or data.startswith(b"HTTP/1.1 408")
