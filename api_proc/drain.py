"""Stopping without losing what can finish: uvicorn's server, with a drain in its shutdown.

On SIGTERM or SIGINT uvicorn stops accepting connections, closes idle ones and waits for the
requests in flight. Those that finish within `shutdown_timeout_s` lose nothing (a rolling
restart). Then every request still running is failed with a 503 `server_shutting_down`
error (an error event on a stream) and aborted in its engine; uvicorn cancels what is left
FLUSH_S later, the time those errors take to reach their clients.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

import uvicorn

logger = logging.getLogger(__name__)

FLUSH_S = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, abort_in_flight: Callable[[str], int],
                 shutdown_timeout_s: float) -> None:
        config.timeout_graceful_shutdown = shutdown_timeout_s + FLUSH_S
        super().__init__(config)
        self.abort_in_flight = abort_in_flight
        self.shutdown_timeout_s = shutdown_timeout_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        logger.info("draining: up to %g s (--shutdown-timeout) for the requests in flight",
                    self.shutdown_timeout_s)
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout_s, self._abort)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _abort(self) -> None:
        reason = (f"the server is shutting down and the request did not finish within "
                  f"shutdown_timeout_s={self.shutdown_timeout_s:g}")
        num_aborted = self.abort_in_flight(reason)
        if num_aborted:
            logger.warning("shutdown: %d requests still running after %g s aborted",
                           num_aborted, self.shutdown_timeout_s)
