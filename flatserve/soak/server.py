"""A server started for one soak run: free port, wait for /health, stop with SIGINT, always."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections import deque
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx
import psutil

from flatserve.soak.config import passthrough_value

T = TypeVar("T")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM stops a run as Ctrl-C does, and so stops the server it started (which runs in
    its own session, so no signal reaches it otherwise)."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_interruptible(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main), where SIGTERM cancels `main` as Ctrl-C does and then raises
    KeyboardInterrupt. A KeyboardInterrupt raised from a signal handler inside the event
    loop can land in its internals and leave asyncio.run hanging; cancelling cannot."""
    previous = signal.getsignal(signal.SIGTERM)

    async def cancel_on_sigterm() -> T:
        task = asyncio.current_task()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await main

    try:
        return asyncio.run(cancel_on_sigterm())
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None
    finally:
        signal.signal(signal.SIGTERM, previous)  # the loop's removal left SIG_DFL


class NoModelId(RuntimeError):
    """GET /v1/models did not name a model."""


def first_model(url: str, headers: dict[str, str]) -> str:
    """The first model id a server lists at /v1/models; NoModelId when there is none."""
    try:
        response = httpx.get(url + "/v1/models", headers=headers, timeout=10.0)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as err:
        raise NoModelId(f"could not read a model id from {url}/v1/models ({err!r}); "
                        "pass --model") from None


class ServerStartError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except OSError:
        return ""


class ServerSettings(Protocol):
    """What ManagedServer reads off a run's config (SoakConfig, BenchConfig)."""

    server_args: tuple[str, ...]
    server_env: dict[str, str] | None
    server_timeout_s: float
    stop_timeout_s: float

    def start_command(self, port: int | None) -> list[str]: ...


class ManagedServer:
    """`with ManagedServer(config, log_path) as server:` starts the server and waits until it
    is healthy; leaving the block stops it (SIGINT, then SIGKILL to its whole process group)."""

    def __init__(self, config: ServerSettings, log_path: Path):
        self.config = config
        self.log_path = log_path
        port = passthrough_value(config.server_args, "--port")
        self.port = int(port) if port is not None else free_port()
        host = passthrough_value(config.server_args, "--host")
        self.host = host if host not in (None, "0.0.0.0", "::") else "127.0.0.1"
        self.url = f"http://{self.host}:{self.port}"
        # when the passthrough names the port itself, it is not given twice
        self.command = config.start_command(None if port is not None else self.port)
        self.process: subprocess.Popen | None = None
        self._descendants: list[psutil.Process] = []
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def __enter__(self) -> ManagedServer:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.config.server_env or {})}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # Own session: the terminal's Ctrl-C reaches only us, and we stop the server in order.
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env,
                                            start_new_session=True)

    def exit_reason(self) -> str | None:
        """Why the server is gone, or None while it runs."""
        if self.process is None or self.process.poll() is None:
            return None
        return f"the server exited with code {self.process.returncode}"

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.server_timeout_s
        last_error = "no answer yet"
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if (reason := self.exit_reason()) is not None:
                    raise self._start_error(f"{reason} before answering /health")
                try:
                    response = client.get(self.url + "/health")
                    if response.status_code == 200:
                        self._descendants = self.children()
                        return
                    last_error = f"HTTP {response.status_code}"
                except httpx.HTTPError as err:
                    last_error = repr(err)
                time.sleep(0.2)
        raise self._start_error(
            f"no 200 from {self.url}/health within {self.config.server_timeout_s:g} s "
            f"(last: {last_error})")

    def _start_error(self, message: str) -> ServerStartError:
        return ServerStartError(
            f"{message}\ncommand: {' '.join(self.command)}\n"
            f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> int | None:
        """SIGINT, wait `stop_timeout_s`, then SIGKILL the process group; also ends any
        descendant seen at start that outlived it. Returns the exit code."""
        if self.process is None:
            return None
        process = self.process
        try:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(self.config.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    self._kill_group()
        except KeyboardInterrupt:  # a second Ctrl-C while stopping: no more waiting
            self._kill_group()
        process.wait()
        self.returncode = process.returncode
        self._end_leftovers()
        return self.returncode

    def _kill_group(self) -> None:
        assert self.process is not None
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.process.kill()

    def _end_leftovers(self) -> None:
        alive = [p for p in self._descendants if p.is_running()]
        for p in alive:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, still = psutil.wait_procs(alive, timeout=3)
        for p in still:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
