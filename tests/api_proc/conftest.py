"""Fixtures for the API process tests: configs, encoded test images, a local HTTP server."""

from __future__ import annotations

import base64
import io
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from api_proc.config import ApiConfig
from shared.model_config import load_model_config


def encode_image(width: int = 64, height: int = 48, fmt: str = "PNG", mode: str = "RGB",
                 seed: int = 0, exif_orientation: int | None = None,
                 compress_level: int | None = None) -> bytes:
    """Random pixels as an image file; compress_level 0 stores a PNG's noise uncompressed,
    about as large and 2.5x faster to write (PIL's default 6 gains nothing on noise)."""
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    img = Image.fromarray(arr[..., 0] if channels == 1 else arr, mode)
    buf = io.BytesIO()
    kwargs = {}
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        kwargs["exif"] = exif
    if compress_level is not None:
        kwargs["compress_level"] = compress_level
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="session")
def image_config(tiny_model_path):
    return load_model_config(tiny_model_path).image


@pytest.fixture
def make_config(tiny_model_path):
    def make(**kw) -> ApiConfig:
        return ApiConfig(model=str(tiny_model_path), **kw)
    return make


class _Handler(BaseHTTPRequestHandler):
    routes: dict = {}

    def log_message(self, *args):  # keep test output quiet
        pass

    def do_GET(self):  # noqa: N802
        path = self.path.split("?", 1)[0]
        route = self.routes.get(path)
        if route is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        route(self)


class LocalHTTPServer:
    """A threaded HTTP server on 127.0.0.1 with per-test routes."""

    def __init__(self):
        handler = type("Handler", (_Handler,), {"routes": {}})
        self.routes = handler.routes
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def serve_bytes(self, path: str, body: bytes, content_type: str = "image/png",
                    chunked: bool = False, headers: dict | None = None) -> str:
        def route(h):
            h.send_response(200)
            h.send_header("Content-Type", content_type)
            for k, v in (headers or {}).items():
                h.send_header(k, v)
            if chunked:
                h.send_header("Transfer-Encoding", "chunked")
                h.end_headers()
                for i in range(0, len(body), 65536):
                    part = body[i:i + 65536]
                    h.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                h.wfile.write(b"0\r\n\r\n")
            else:
                h.send_header("Content-Length", str(len(body)))
                h.end_headers()
                h.wfile.write(body)
        self.routes[path] = route
        return self.url(path)

    def redirect(self, path: str, location: str) -> str:
        def route(h):
            h.send_response(302)
            h.send_header("Location", location)
            h.send_header("Content-Length", "0")
            h.end_headers()
        self.routes[path] = route
        return self.url(path)

    def slow(self, path: str, delay_s: float) -> str:
        def route(h):
            time.sleep(delay_s)
            h.send_response(200)
            h.send_header("Content-Length", "0")
            h.end_headers()
        self.routes[path] = route
        return self.url(path)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def http_server():
    server = LocalHTTPServer()
    yield server
    server.close()


# ------------------------------------------------------------------ engine double + app server

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


class EngineDoubleProcess:
    """tests/api_proc/engine_double.py in a subprocess, serving a real engine socket; the
    test drives it with one line on its stdin, answered by one JSON line on its stdout."""

    def __init__(self, address: str, model_dir: str, max_requests: int = 64,
                 peer_timeout_s: float = 3.0):
        import subprocess
        import sys

        self.address = address
        self._lock = threading.Lock()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.api_proc.engine_double", address, model_dir,
             str(max_requests), str(peer_timeout_s)],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self._readline(30.0)
        if line.strip() != "ready":
            self.kill()
            raise RuntimeError(f"engine double did not start: {line!r}")

    def _readline(self, timeout: float) -> str:
        import select

        # one line answers each command, so nothing is left in the reader's buffer between
        # calls and select on the pipe says whether the next answer is there
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"engine double gave no answer in {timeout} s")
        return self.process.stdout.readline()

    def call(self, command: str, timeout: float = 5.0) -> dict:
        """Send one command line ("log", "open_gate"); its JSON answer."""
        import json

        with self._lock:
            if self.process.poll() is not None:
                raise RuntimeError(f"engine double exited with code {self.process.returncode}")
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
            line = self._readline(timeout)
        if not line:
            raise RuntimeError("engine double closed its stdout")
        return json.loads(line)

    def log(self) -> dict:
        """{"requests": [...], "aborted": [ids], "running": [ids]} (see engine_double.py)."""
        return self.call("log")

    def open_gate(self) -> int:
        """Let every [[gated]] request the double holds now go on; how many there were."""
        return self.call("open_gate")["opened"]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:  # stdin: a write the dead process never read
                pass


def _double_address(kind: str) -> str:
    from rpc.sockets import new_ipc_address

    return new_ipc_address(f"{kind}-{os.getpid()}-{time.monotonic_ns()}")


@pytest.fixture(scope="module")
def engine_double(tiny_model_path):
    double = EngineDoubleProcess(_double_address("double"), str(tiny_model_path))
    yield double
    double.kill()


@pytest.fixture
def fresh_engine_double(tiny_model_path):
    double = EngineDoubleProcess(_double_address("fresh"), str(tiny_model_path))
    yield double
    double.kill()


@pytest.fixture
def start_engine_double(tiny_model_path):
    """start_engine_double(max_requests=64, peer_timeout_s=3.0) -> EngineDoubleProcess,
    killed after the test."""
    doubles = []

    def start(**kw) -> EngineDoubleProcess:
        double = EngineDoubleProcess(_double_address("custom"), str(tiny_model_path), **kw)
        doubles.append(double)
        return double
    yield start
    for double in doubles:
        double.kill()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AppServer:
    """A built app served by uvicorn on a thread of this process (so tests can inspect the
    API process's memory directly)."""

    def __init__(self, app):
        import uvicorn

        from api_proc.drain import DrainingServer
        from api_proc.http_protocol import http_protocol

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        api_config = app.state.config
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="on", loop="asyncio", http=http_protocol(api_config))
        self.server = DrainingServer(config, app.state.engine_client.abort_all,
                                     api_config.shutdown_timeout_s)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@pytest.fixture
def start_app(make_config):
    """start_app(engine=double_or_None, loader_cls=None, **config) -> AppServer."""
    from api_proc.app import build_app

    servers = []

    def start(engine=None, loader_cls=None, **kw) -> AppServer:
        addresses = (engine.address,) if engine is not None else ()
        config = make_config(engine_addresses=addresses, **kw)
        loader = None
        if loader_cls is not None:
            loader = loader_cls(config, load_model_config(config.model).image)
        app = build_app(config, media_loader=loader,
                        engine_processes=[engine.process] if engine is not None else None)
        server = AppServer(app)
        servers.append(server)
        return server
    yield start
    for s in servers:
        s.stop()
