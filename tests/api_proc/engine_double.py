"""TEST DOUBLE of an engine process: a real rpc server in its own process, no model.

`generate` echoes the prompt's text tokens back (special and image tokens left out), one
token per output, up to max_tokens (finish "length"), else the echo ends with the first eos
id (finish "stop"). Directives in the prompt text change its behaviour:

    [[slow]]   0.05 s between outputs         [[hang]]   first output, then wait for cancel
    [[error]]  raise after the first output   [[refuse]] refuse the request at once
    [[gated]]  no output until `open_gate` is called (a prefill that takes its time)

`test_log` returns what it saw: per request its id, prompt length, image shapes and grids,
and the ids whose streams were cancelled or aborted.

    python -m tests.api_proc.engine_double ADDRESS MODEL_DIR
"""

from __future__ import annotations

import asyncio
import sys

from tokenizers import Tokenizer

from rpc import Codec, RpcServer
from shared.messages import WIRE_TYPES, EngineStats, GenerateRequest, RequestOutput
from shared.model_config import load_model_config


class EngineDouble:
    def __init__(self, model_dir: str):
        self.tokenizer = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
        self.config = load_model_config(model_dir)
        self.special = set(self.tokenizer.get_added_tokens_decoder())
        self.log: list[dict] = []
        self.cancelled: list[str] = []
        self.aborted: list[str] = []
        self.running: set[str] = set()
        self.gate = asyncio.Event()

    async def generate(self, request: GenerateRequest):
        rid = request.request_id
        ids = request.prompt_token_ids
        self.log.append({"id": rid, "num_prompt_tokens": len(ids),
                         "shapes": [list(im.pixels.shape) for im in request.images],
                         "grids": [list(im.grid_thw) for im in request.images],
                         "max_tokens": request.sampling.max_tokens})
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        max_tokens = request.sampling.max_tokens
        request = None  # R1, as every wrapper should
        if "[[refuse]]" in text:
            raise RuntimeError("RequestRejected: refused by the test double")
        echo = [t for t in ids if t not in self.special][:max_tokens + 1]
        delay = 0.05 if "[[slow]]" in text else 0.0
        self.running.add(rid)
        done = False
        try:
            if "[[gated]]" in text:
                await self.gate.wait()
            for i, token in enumerate(echo[:max_tokens]):
                if delay:
                    await asyncio.sleep(delay)
                last = i == max_tokens - 1 or i == len(echo) - 1
                reason = None
                new = [token]
                if last:
                    reason = "length" if len(echo) > max_tokens else "stop"
                    if reason == "stop":
                        new.append(self.config.eos_token_ids[0])
                yield RequestOutput(rid, new, reason, len(ids), i + 1)
                if i == 0 and "[[error]]" in text:
                    raise RuntimeError("engine double failed on purpose")
                if i == 0 and "[[hang]]" in text:
                    await asyncio.Event().wait()
            done = True
        finally:
            self.running.discard(rid)
            if not done:
                self.cancelled.append(rid)

    async def open_gate(self) -> None:
        """Let every [[gated]] request waiting now go on; later ones wait for the next call."""
        gate, self.gate = self.gate, asyncio.Event()
        gate.set()

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True

    async def stats(self) -> EngineStats:
        return EngineStats(0, len(self.running), 0, 0, 0, len(self.log))

    async def health(self) -> dict:
        return {"status": "ok"}

    async def test_log(self) -> dict:
        return {"requests": self.log, "cancelled": self.cancelled, "aborted": self.aborted,
                "running": sorted(self.running)}


async def serve(address: str, model_dir: str) -> None:
    double = EngineDouble(model_dir)
    server = RpcServer(address, Codec(types=WIRE_TYPES))
    server.register_stream("generate", double.generate)
    for name in ("abort", "stats", "health", "test_log", "open_gate"):
        server.register_unary(name, getattr(double, name))
    await server.start()
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], sys.argv[2]))
