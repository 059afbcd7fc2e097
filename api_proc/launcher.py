"""Spawns the engine processes, waits until each is ready, watches them, and stops them."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from api_proc.engine_client import EngineConnection
from shared.engine_config import EngineConfig
from shared.memory import ENGINE_MALLOC_ENV, glibc_tuning_enabled

logger = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    pass


@dataclass
class EngineHandle:
    config: EngineConfig
    process: subprocess.Popen

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    if glibc_tuning_enabled():
        for key, value in ENGINE_MALLOC_ENV.items():
            env.setdefault(key, value)
    return env


def spawn_engine(config: EngineConfig) -> EngineHandle:
    command = [sys.executable, "-m", "engine_proc.main", "--config-json", config.to_json(),
               "--die-with-parent"]
    process = subprocess.Popen(command, env=engine_env(), start_new_session=False)
    return EngineHandle(config, process)


async def _wait_ready(handle: EngineHandle, deadline: float) -> None:
    connection = EngineConnection(handle.config.address)
    connection.open()
    try:
        while time.monotonic() < deadline:
            if not handle.alive:
                raise EngineStartError(
                    f"engine {handle.config.rank} exited with code {handle.process.returncode} "
                    "while starting (see its log above)"
                )
            try:
                await connection.wait_ready(0.2)  # not bound yet, or still loading the model
                return
            except TimeoutError:
                pass
        raise EngineStartError(f"engine {handle.config.rank} not ready after its start timeout")
    finally:
        await connection.close()


def start_engines(configs: list[EngineConfig], timeout_s: float = 600.0) -> list[EngineHandle]:
    """Spawn every engine and wait until each answers `health`; on any failure stop them all."""
    handles = [spawn_engine(c) for c in configs]
    deadline = time.monotonic() + timeout_s

    async def wait_all() -> None:
        await asyncio.gather(*(_wait_ready(h, deadline) for h in handles))

    try:
        asyncio.run(wait_all())
    except BaseException:
        stop_engines(handles)
        raise
    return handles


def stop_engines(handles: list[EngineHandle], grace_s: float = 10.0) -> None:
    for handle in handles:
        if handle.alive:
            handle.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for handle in handles:
        try:
            handle.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("engine %d did not stop in %.0fs; killing it", handle.config.rank, grace_s)
            handle.process.kill()
            handle.process.wait()
