"""A small OpenAI-compatible server for the soak tests, run as its own process:

    python fake_server.py serve --port P [--engines N] [--leak-kb K] [--fail-every N]

It answers chat completions (streamed and not) after decoding the request's images, exposes
an in-flight multimodal gauge on /metrics, spawns idle children titled `flatserve: engine N`,
and with --leak-kb keeps K KiB per request forever: the leak the soak must catch.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import subprocess
import sys
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Gauge, generate_latest

ENGINE = "import setproctitle, time; setproctitle.setproctitle('flatserve: engine {}'); " \
         "time.sleep(3600)"
LEAKED: list[bytes] = []


def image_bytes(body: dict) -> int:
    total = 0
    for message in body.get("messages", []):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if part.get("type") == "image_url":
                total += len(base64.b64decode(part["image_url"]["url"].split(",", 1)[1]))
    return total


def chunk(text: str | None, finish: str | None = None) -> str:
    delta = {} if text is None else {"content": text}
    data = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": "fake-vl", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(data)}\n\n"


def make_app(args: argparse.Namespace) -> FastAPI:
    app = FastAPI()
    registry = CollectorRegistry()
    inflight = Gauge("fake_mm_inflight_bytes", "decoded image bytes in flight", registry=registry)
    budget = Gauge("fake_mm_inflight_budget_bytes", "in-flight budget", registry=registry)
    budget.set(args.budget_bytes)
    counter = {"n": 0}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-vl", "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(registry).decode())

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        counter["n"] += 1
        if args.fail_every and counter["n"] % args.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        nbytes = image_bytes(body)
        if args.leak_kb:
            LEAKED.append(b"\x01" * (args.leak_kb * 1024))
        max_tokens = int(body.get("max_tokens") or 8)
        inflight.inc(nbytes)
        if not body.get("stream"):
            try:
                await asyncio.sleep(args.token_delay * max_tokens)
            finally:
                inflight.dec(nbytes)
            return {"id": "chatcmpl-fake", "object": "chat.completion", "model": "fake-vl",
                    "choices": [{"index": 0, "finish_reason": "length",
                                 "message": {"role": "assistant", "content": "x" * max_tokens}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": max_tokens,
                              "total_tokens": max_tokens + 1}}

        async def events():
            try:
                yield chunk("")
                for _ in range(max_tokens):
                    await asyncio.sleep(args.token_delay)
                    yield chunk("x")
                yield chunk(None, "length")
                yield "data: [DONE]\n\n"
            finally:
                inflight.dec(nbytes)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engines", type=int, default=0)
    parser.add_argument("--leak-kb", type=int, default=0)
    parser.add_argument("--fail-every", type=int, default=0)
    parser.add_argument("--token-delay", type=float, default=0.002)
    parser.add_argument("--budget-bytes", type=int, default=64 << 20)
    args = parser.parse_args()
    import setproctitle

    setproctitle.setproctitle("flatserve: api")
    engines = [subprocess.Popen([sys.executable, "-c", ENGINE.format(i)])
               for i in range(args.engines)]
    try:
        uvicorn.run(make_app(args), host="127.0.0.1", port=args.port, log_level="warning")
    finally:
        for engine in engines:
            engine.terminate()
        for engine in engines:
            engine.wait()


if __name__ == "__main__":
    main()
