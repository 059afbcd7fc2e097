"""The engine worker process: a synchronous busy loop with its RPC server on an I/O thread.

The main thread owns the LLMEngine and runs schedule -> forward -> sample steps. An asyncio
loop on a second thread owns the socket (rpc server) so (de)serialization and sends overlap
with model execution. The two threads talk through one inbox (thread-safe queue) in one
direction and `call_soon_threadsafe` in the other; all outputs of one step are posted in one
callback so the rpc server sends them together.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine_proc.llm_engine import LLMEngine
from rpc import Codec, RpcServer
from shared.engine_config import EngineConfig
from shared.memory import release_freed_memory
from shared.messages import WIRE_TYPES, EngineStats, GenerateRequest, RequestOutput

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05


@dataclass
class _Inbox:
    """Commands from the I/O thread to the busy loop."""

    commands: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    wakeup: threading.Event = field(default_factory=threading.Event)

    def put(self, command: tuple) -> None:
        self.commands.put(command)
        self.wakeup.set()


class EngineProcess:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine = LLMEngine(
            config.model,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_encoder_patches=config.max_num_encoder_patches,
            max_model_len=config.max_model_len or None,
            num_kv_blocks=config.num_kv_blocks or None,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes or None,
            block_size=config.block_size,
            max_waiting=config.max_waiting,
            device=config.device,
            dtype=config.dtype,
        )
        self.inbox = _Inbox()
        self.streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self.stats: EngineStats = self.engine.stats()
        self.stopping = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: RpcServer | None = None
        self.mm_bytes_released = 0

    # ---- I/O thread -----------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        request_id = request.request_id
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already running")
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.streams[request_id] = outputs
        self.inbox.put(("add", request))
        request = None  # R1: the busy loop owns the payload now
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                finished = output.finish_reason is not None
                if output.finish_reason == "error":
                    raise RuntimeError(output.error or "engine error")
                yield output
        finally:
            self.streams.pop(request_id, None)
            if not finished:
                self.inbox.put(("abort", request_id))

    async def abort(self, request_id: str) -> bool:
        self.inbox.put(("abort", request_id))
        return True

    async def get_stats(self) -> EngineStats:
        return self.stats

    async def health(self) -> dict:
        return {"status": "ok", "rank": self.config.rank, "model": self.config.model}

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self.streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)

    async def _serve(self, ready: threading.Event) -> None:
        self.loop = asyncio.get_running_loop()
        self.server = RpcServer(self.config.address, Codec(types=WIRE_TYPES))
        self.server.register_stream("generate", self.generate)
        self.server.register_unary("abort", self.abort)
        self.server.register_unary("stats", self.get_stats)
        self.server.register_unary("health", self.health)
        await self.server.start()
        ready.set()
        try:
            while not self.stopping.is_set():
                await asyncio.sleep(0.1)
        finally:
            await self.server.close()

    def _io_thread_main(self, ready: threading.Event) -> None:
        try:
            import uvloop

            uvloop.run(self._serve(ready))
        except ImportError:
            asyncio.run(self._serve(ready))
        finally:
            self.stopping.set()
            ready.set()

    # ---- busy loop (main thread) ----------------------------------------------------

    def _drain_inbox(self) -> list[RequestOutput]:
        rejected: list[RequestOutput] = []
        while True:
            try:
                kind, arg = self.inbox.commands.get_nowait()
            except queue.Empty:
                return rejected
            if kind == "add":
                request_id = arg.request_id
                try:
                    self.engine.add_request(arg)
                except Exception as exc:  # a bad request fails alone, loudly
                    logger.warning("request %s refused: %s", request_id, exc)
                    rejected.append(RequestOutput(request_id, [], "error", error=f"{type(exc).__name__}: {exc}"))
                arg = None
            elif kind == "abort":
                self.engine.abort_request(arg)

    def run(self) -> None:
        ready = threading.Event()
        io_thread = threading.Thread(target=self._io_thread_main, args=(ready,), name="engine-io", daemon=True)
        io_thread.start()
        ready.wait()
        if self.stopping.is_set():
            raise RuntimeError(f"engine rpc server failed to start on {self.config.address}")
        logger.info("engine %d ready on %s", self.config.rank, self.config.address)
        held_mm = 0
        while not self.stopping.is_set():
            outputs = self._drain_inbox()
            if self.engine.has_unfinished_requests():
                outputs.extend(self.engine.step())
            else:
                self.inbox.wakeup.wait(IDLE_WAIT_S)
                self.inbox.wakeup.clear()
            self.stats = self.engine.stats()
            if self.stats.mm_bytes_held < held_mm:
                release_freed_memory()  # engines keep glibc's dynamic mmap threshold
            held_mm = self.stats.mm_bytes_held
            if outputs:
                self.loop.call_soon_threadsafe(self._dispatch, outputs)
            outputs = None
        io_thread.join(timeout=5)

    def stop(self) -> None:
        self.stopping.set()
        self.inbox.wakeup.set()
