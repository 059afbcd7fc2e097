"""An API process's engine client, alone: `python -m tests.e2e.remote_client ADDRESS
[KEY_DIR]` connects to one engine (with CURVE keys when KEY_DIR is given), sends one text
request and prints one JSON line: {"ok": true, "tokens": [...]} when served, else
{"ok": false, "reason": ...} once the connection has said why not (or after a deadline)."""

from __future__ import annotations

import asyncio
import json
import sys
import time

from api_proc.engine_client import NOT_CONNECTED, EngineClient
from rpc.curve import load_client_keys
from shared.messages import AddRequest
from shared.sampling_params import SamplingParams


async def ask(address: str, key_dir: str | None, timeout_s: float) -> dict:
    keys = load_client_keys(key_dir) if key_dir else None
    engines = EngineClient.connect([address], keys=keys)
    engine = engines.engines[0]
    try:
        for e in engines.engines:
            e.open()
        deadline = time.monotonic() + timeout_s
        while not engine.available:
            if engine.lost_reason != NOT_CONNECTED or time.monotonic() > deadline:
                return {"ok": False, "reason": engine.lost_reason}
            await asyncio.sleep(0.05)
        stream = engines.submit(AddRequest("r0", [1, 2, 3, 4], SamplingParams(max_tokens=4)))
        tokens = [t async for output in stream for t in output.new_token_ids]
        return {"ok": True, "tokens": tokens}
    finally:
        await engines.close()


def main() -> int:
    address, key_dir = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    print(json.dumps(asyncio.run(ask(address, key_dir, timeout_s=20.0))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
