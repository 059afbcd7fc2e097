"""Restarting engines that die while the server runs.

A thread beside the API's event loop watches the engine processes the launcher spawned.
When one exits, its API connection has already failed the requests it held, once, and
dropped its stats (api_proc/engine_client.py); the supervisor spawns it again on the same
address after a backoff that doubles with each failed try, and the connection picks the new
process up when it answers. After `max_restarts` failed tries in a row it gives up and
calls `give_up`, so the server exits non-zero where a process supervisor sees it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from api_proc.engine_client import EngineConnection
    from flatserve.launcher import SpawnedEngine

logger = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
POLL_S = 0.2


class EngineSupervisor:
    def __init__(self, handles: list[SpawnedEngine], connections: list[EngineConnection],
                 restart: Callable[[SpawnedEngine], SpawnedEngine], max_restarts: int,
                 on_restart: Callable[[], None], is_stopping: Callable[[], bool],
                 give_up: Callable[[str], None]) -> None:
        """`restart(dead)`: a new engine with the dead one's settings, ready (it raises
        when the new one exits or is not ready in time); `handles` is updated in place.
        `is_stopping`: the server is shutting down (engines that exit then stay down)."""
        self.handles = handles
        self.connections = connections
        self.restart = restart
        self.max_restarts = max_restarts
        self.on_restart = on_restart
        self.is_stopping = is_stopping
        self.give_up = give_up
        self.gave_up: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="flatserve-engine-supervisor",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S) and self.gave_up is None:
            for rank, handle in enumerate(self.handles):
                if not handle.alive and not self.is_stopping():
                    self._bring_back(rank)

    def _bring_back(self, rank: int) -> None:
        dead = self.handles[rank]
        logger.error("engine %d exited with code %s; restarting it", rank,
                     dead.process.returncode)
        for attempt in range(self.max_restarts):
            if self._stop.wait(min(FIRST_BACKOFF_S * 2 ** attempt, MAX_BACKOFF_S)) \
                    or self.is_stopping():
                return
            try:
                handle = self.restart(dead)
            except Exception as e:  # noqa: BLE001 - any failure to start counts as one try
                logger.error("engine %d: restart %d of %d failed: %s", rank, attempt + 1,
                             self.max_restarts, e)
                continue
            self.handles[rank] = handle
            self.connections[rank].process = handle.process
            self.on_restart()
            logger.info("engine %d restarted", rank)
            return
        self.gave_up = (f"engine {rank} died and {self.max_restarts} restarts in a row "
                        "failed")
        logger.error("%s: stopping the server", self.gave_up)
        self.give_up(self.gave_up)
