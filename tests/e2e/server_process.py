"""A real `flatserve serve` in a subprocess, for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil

REPO = Path(__file__).resolve().parents[2]
SMALL_ENGINE_FLAGS = ("--max-num-seqs", "16", "--kv-cache-memory-bytes", str(64 << 20))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *flags: str, module: str = "flatserve.cli", log_path: Path | None = None,
                 env: dict[str, str] | None = None, tls_ca: ssl.SSLContext | None = None):
        """tls_ca: the server serves https (its --ssl-* flags among `flags`) with a
        certificate this context verifies."""
        self.port = free_port()
        self.verify = tls_ca or True
        self.url = f"{'https' if tls_ca else 'http'}://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        command = [sys.executable, "-m", module, "serve", "--port", str(self.port),
                   *SMALL_ENGINE_FLAGS, *flags]
        self.process = subprocess.Popen(command, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=dict(env or os.environ, PYTHONUNBUFFERED="1"))

    def log_tail(self, n: int = 3000) -> str:
        if not self.log_path:
            return ""
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0,
                             verify=self.verify).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"server not ready in {timeout}s:\n{self.log_tail()}")

    def engine_pids(self) -> list[int]:
        children = psutil.Process(self.process.pid).children()
        return [c.pid for c in children if "engine" in " ".join(c.cmdline())]

    def stop(self, sig: int = signal.SIGINT, timeout: float = 20.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return self.process.returncode


@contextlib.contextmanager
def served_openai(log_dir: Path, *flags: str) -> Iterator[openai.OpenAI]:
    """`flatserve serve` with `flags` (its log in `log_dir`), ready, as the official openai
    client; stopped when the block ends."""
    proc = ServerProcess(*flags, log_path=log_dir / "server.log")
    try:
        proc.wait_ready()
        yield openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
    finally:
        proc.stop()
