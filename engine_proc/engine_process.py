"""The engine worker process: a synchronous busy loop, its socket on a thread of its own.

Each turn takes the commands that arrived (add, abort), runs one engine step and posts the
step's outputs as one message (rpc/engine_server.py sends it).

With tensor parallelism a worker rank's death is this engine's death: the loop ends at its
next turn (or its step raises), fails every request it holds and the process exits
non-zero, so the API answers 503 and /health reports it. Should the loop be stuck in a
collective that waits on the dead rank (NCCL does), the process exits anyway after
RANK_DEATH_EXIT_S.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import psutil

from engine_proc.llm_engine import ImageMissing, LLMEngine
from engine_proc.scheduler import QueueFull, RequestRejected
from engine_proc.tensor_parallel import TensorParallelBroken
from rpc.curve import load_server_keys
from rpc.engine_server import EngineServer
from shared.engine_config import EngineConfig
from shared.memory import release_freed_memory
from shared.messages import AbortRequests, AddRequest, ErrorCode, RequestOutput

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
RANK_DEATH_EXIT_S = 1.0


class EngineProcess:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine = LLMEngine.from_config(config)
        keys = load_server_keys(config.curve_key_dir) if config.curve_key_dir else None
        self.server = EngineServer(config.address, self.engine.max_requests, keys=keys)
        self.server.memory_plan = self.engine.memory_plan(
            f"engine {config.rank}", config, psutil.Process().memory_info().rss)
        self.stopping = False
        self._process = psutil.Process()
        self._rss_at, self._rss_bytes = -1.0, 0

    def run(self) -> int:
        """Serve until stopped (0) or until a tensor-parallel rank dies (1)."""
        workers = self.engine.model_runner.workers
        if workers is not None:
            workers.on_failure = self._rank_died
        self.server.stats = self.engine.stats()
        self.server.start()
        logger.info("engine %d ready on %s", self.config.rank, self.server.address)
        held_mm = 0
        try:
            while not self.stopping:
                outputs = self._apply(self.server.take_commands())
                if self.engine.has_unfinished_requests():
                    try:
                        outputs.extend(self.engine.step())
                    except TensorParallelBroken:
                        break
                elif not outputs:
                    self.server.wait_for_commands(IDLE_WAIT_S)
                stats = self.server.stats = self.engine.stats()
                stats.rss_bytes = self._rss()
                if stats.mm_bytes_held < held_mm:
                    release_freed_memory()  # engines keep glibc's dynamic mmap threshold
                held_mm = stats.mm_bytes_held
                added, removed = self.engine.take_encoder_key_changes()
                if outputs or added or removed:
                    self.server.send_step(outputs, added, removed)
            self.server.send_step(self._fail_unfinished(self.engine.failure))
        finally:
            self.server.stop()
            self.engine.close()
        return 1 if self.engine.failure else 0

    def stop(self) -> None:
        self.stopping = True

    def _rank_died(self, reason: str) -> None:
        """A worker rank's watcher thread: end the loop, and the process if the loop does
        not end in time."""
        self.stopping = True
        timer = threading.Timer(RANK_DEATH_EXIT_S, os._exit, args=(1,))
        timer.daemon = True
        timer.start()

    def _rss(self) -> int:
        """This process's RSS, read at most once a second (a /proc read per step would
        show in the step time)."""
        now = time.monotonic()
        if now - self._rss_at >= 1.0:
            self._rss_at, self._rss_bytes = now, self._process.memory_info().rss
        return self._rss_bytes

    def _apply(self, commands: list[AddRequest | AbortRequests]) -> list[RequestOutput]:
        refused = []
        for command in commands:
            if type(command) is AbortRequests:
                for request_id in command.request_ids:
                    self.engine.abort_request(request_id)
                continue
            request_id = command.request_id
            try:
                self.engine.add_request(command)
            except Exception as exc:  # a bad request fails alone, loudly
                code = (ErrorCode.BUSY if isinstance(exc, QueueFull)
                        else ErrorCode.IMAGE_MISSING if isinstance(exc, ImageMissing)
                        else ErrorCode.REJECTED if isinstance(exc, RequestRejected)
                        else ErrorCode.INTERNAL)
                logger.warning("request %s refused: %s", request_id, exc)
                refused.append(RequestOutput(request_id, [], "error", error=str(exc),
                                             error_code=code))
        return refused

    def _fail_unfinished(self, failure: str | None = None) -> list[RequestOutput]:
        error = f"the engine stopped: {failure}" if failure else "the engine is stopping"
        outputs = []
        for request_id in list(self.engine.seqs):
            self.engine.abort_request(request_id)
            outputs.append(RequestOutput(request_id, [], "error", error=error,
                                         error_code=ErrorCode.STOPPING))
        return outputs
