"""Repro of the ways one client could stall or bloat the API server (issue 28, points 1, 3
and 4), against a running server: each scenario opens its connections, then times GET
/health and one small image request while they are held, and prints what the server did
with them. Usage:

    python scripts/chaos/slow_clients.py --url http://127.0.0.1:8000 [--hold-s 15]

Scenarios: header-only bodies declaring 200 MiB (budget held by bodies that never come),
slowloris heads (a header byte every second), one unfinished 8 MiB header, a body sent a
byte a second, and a 10 MB text prompt.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
from PIL import Image

CHAT = "/v1/chat/completions"


def raw(host: str, port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=60)
    try:
        sock.sendall(data)
    except OSError:  # the server refused it before it was all sent
        pass
    return sock


def head(declared: int) -> bytes:
    return (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared}\r\n\r\n").encode()


def status_of(sock: socket.socket) -> str:
    """The status line the server sent, or what happened to the connection."""
    sock.settimeout(0.2)
    try:
        data = sock.recv(256)
    except TimeoutError:
        return "still open"
    except OSError as e:
        return type(e).__name__
    return data.split(b"\r\n", 1)[0].decode(errors="replace") if data else "closed"


def image_request() -> dict:
    buf = io.BytesIO()
    Image.new("RGB", (448, 448), "orange").save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}],
        "max_tokens": 4}


def probe(url: str) -> str:
    started = time.monotonic()
    health = httpx.get(url + "/health", timeout=60).status_code
    health_ms = (time.monotonic() - started) * 1000
    started = time.monotonic()
    try:
        chat = httpx.post(url + CHAT, json=image_request(), timeout=60).status_code
    except httpx.HTTPError as e:
        chat = type(e).__name__
    chat_ms = (time.monotonic() - started) * 1000
    return f"/health {health} in {health_ms:.0f} ms, image request {chat} in {chat_ms:.0f} ms"


def drip(sock: socket.socket, data: bytes, stop: threading.Event) -> None:
    for byte in data:
        if stop.wait(1.0):
            return
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return


def scenarios(host: str, port: int):
    yield "6 header-only bodies of 200 MiB", [raw(host, port, head(209_714_176))
                                              for _ in range(6)], b""
    yield "50 slowloris heads", [raw(host, port, b"GET /health HTTP/1.1\r\nHost: x\r\n")
                                 for _ in range(50)], b"X-Slow: " + b"a" * 100
    yield "an unfinished 8 MiB header", [raw(host, port, b"GET /health HTTP/1.1\r\nX-Big: "
                                         + b"a" * (8 << 20))], b""
    body = json.dumps({"messages": [{"role": "user", "content": "drip"}]}).encode()
    yield "a body at 1 byte/s", [raw(host, port, head(len(body)))], body


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--hold-s", type=float, default=15.0,
                        help="how long each scenario holds its connections before looking")
    args = parser.parse_args()
    parts = urlsplit(args.url)
    print(f"idle: {probe(args.url)}")
    for name, socks, dripped in scenarios(parts.hostname, parts.port or 80):
        stop = threading.Event()
        threads = [threading.Thread(target=drip, args=(s, dripped, stop), daemon=True)
                   for s in socks if dripped]
        for t in threads:
            t.start()
        during = probe(args.url)
        time.sleep(args.hold_s)
        stop.set()
        states = [status_of(s) for s in socks]
        summary = ", ".join(f"{states.count(s)} {s}" for s in sorted(set(states)))
        print(f"{name}: {during}; after {args.hold_s:g} s: {summary}")
        for s in socks:
            s.close()
    text = "word " * 2_000_000
    started = time.monotonic()
    r = httpx.post(args.url + CHAT, json={"messages": [{"role": "user", "content": text}]},
                   timeout=120)
    print(f"a 10 MB text prompt: {r.status_code} in {(time.monotonic() - started) * 1000:.0f} ms")
    print(f"after: {probe(args.url)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
