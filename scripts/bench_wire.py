"""CPU per streamed token of the API <-> engine wire, on both sides, with no model.

A real engine process (engine_proc/engine_process.py: busy loop, socket thread) runs with a
stand-in for the model: each step sleeps `--step-ms` (a forward pass, GIL released) and gives
every running request one token. This process is the API side: the real engine client, a
closed loop of `--concurrency` requests of `--output-len` tokens, every stream read to the
end the way the server reads it (RequestStream.deliver; `--iterate`: by async iteration).
CPU seconds of each process over the run, divided by the tokens streamed, is what the wire
costs per token. Printed beside it, as the limit: the same steps sent by raw pyzmq +
msgpack (one message per step, no requests, no routing, no liveness), which is what waking a
process once per step costs on this machine, and the stand-in's own work measured alone.

    .venv/bin/python scripts/bench_wire.py [--requests 512] [--concurrency 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import time
from types import SimpleNamespace
from typing import Any

import psutil

from shared.messages import AddRequest, EngineStats, RequestOutput
from shared.sampling_params import SamplingParams


class StandInEngine:
    """What the engine process needs of LLMEngine, with one token per request per step."""

    step_s = 0.0
    max_requests = 1 << 20
    failure = None
    model_runner = SimpleNamespace(workers=None)  # no tensor-parallel ranks

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.seqs: dict[str, list[int]] = {}  # id -> [tokens left, tokens made, prompt length]

    @classmethod
    def from_config(cls, config: Any) -> StandInEngine:
        return cls()

    def add_request(self, request: AddRequest) -> None:
        self.seqs[request.request_id] = [request.sampling.max_tokens, 0,
                                         len(request.prompt_token_ids)]

    def abort_request(self, request_id: str) -> bool:
        return self.seqs.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.seqs)

    def step(self) -> list[RequestOutput]:
        if self.step_s:
            time.sleep(self.step_s)
        outputs = []
        for request_id, seq in list(self.seqs.items()):
            seq[0] -= 1
            seq[1] += 1
            finish = None
            if seq[0] == 0:
                finish = "length"
                del self.seqs[request_id]
            outputs.append(RequestOutput(request_id, [seq[1] % 1000], finish, seq[2], seq[1]))
        return outputs

    def take_encoder_key_changes(self) -> tuple[list[bytes], list[bytes]]:
        return [], []

    def memory_plan(self, *args: Any) -> None:
        return None  # holds no model: no plan to state

    def close(self) -> None:
        pass

    def stats(self) -> EngineStats:
        return EngineStats(num_waiting=0, num_running=len(self.seqs), num_kv_blocks_total=0,
                           num_kv_blocks_free=0, mm_bytes_held=0)


def _engine_main(address: str, step_s: float) -> None:
    import engine_proc.engine_process as engine_process
    from shared.engine_config import EngineConfig

    StandInEngine.step_s = step_s
    engine_process.LLMEngine = StandInEngine
    process = engine_process.EngineProcess(EngineConfig(model="stand-in", address=address))
    signal.signal(signal.SIGTERM, lambda *_: process.stop())
    process.run()


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


async def _api_side(address: str, pid: int, args: argparse.Namespace) -> dict[str, float]:
    from api_proc.engine_client import EngineClient

    client = EngineClient.connect([address])
    await client.start(timeout_s=30)
    engine, me = psutil.Process(pid), psutil.Process()
    sampling = SamplingParams(max_tokens=args.output_len)
    prompt = list(range(1, args.prompt_len + 1))
    tokens = 0
    ids = iter(range(args.requests))

    loop = asyncio.get_running_loop()

    async def delivered(request: AddRequest) -> None:
        """As responses.py reads a stream: outputs handed on in the reader's callback."""
        nonlocal tokens
        done = loop.create_future()

        def on_output(output: RequestOutput) -> None:
            nonlocal tokens
            tokens += len(output.new_token_ids)
            if output.finish_reason is not None:
                done.set_result(None)

        stream = client.submit(request)
        stream.deliver(on_output, done.set_exception)
        await done

    async def iterated(request: AddRequest) -> None:
        nonlocal tokens
        async for output in client.submit(request):
            tokens += len(output.new_token_ids)

    one = iterated if args.iterate else delivered

    async def worker() -> None:
        for i in ids:
            await one(AddRequest(f"r{i}", prompt, sampling))

    await asyncio.sleep(0.5)  # let start-up work settle before the clock starts
    engine0, me0, t0 = _cpu_s(engine), _cpu_s(me), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    wall = time.perf_counter() - t0
    engine_cpu, api_cpu = _cpu_s(engine) - engine0, _cpu_s(me) - me0
    await client.close()
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "engine_us_per_token": engine_cpu / tokens * 1e6,
            "api_us_per_token": api_cpu / tokens * 1e6}


def _raw_engine(address: str, steps: int, step_s: float, rows_per_step: int) -> None:
    import msgpack
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(address)
    peer = sock.recv_multipart()[0]
    rows = [[f"r{i}", [i], None, 200, 1, None, 0] for i in range(rows_per_step)]
    for _ in range(steps):
        time.sleep(step_s)
        sock.send_multipart([peer, msgpack.packb(rows)])
    sock.send_multipart([peer, b""])
    sock.recv_multipart()  # the reader is done measuring


async def _raw_api(address: str, pid: int, steps: int) -> dict[str, float]:
    import msgpack
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(address)
    sock.send(b"start")
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    tokens = 0

    def drain() -> None:
        nonlocal tokens
        while not done.done() and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frame = sock.recv(copy=False)
            if not frame.bytes:
                done.set_result(None)
                return
            tokens += len(msgpack.unpackb(frame.buffer))

    loop.add_reader(sock.getsockopt(zmq.FD), drain)
    loop.call_soon(drain)
    engine, me = psutil.Process(pid), psutil.Process()
    engine0, me0 = _cpu_s(engine), _cpu_s(me)
    await done
    engine_cpu, api_cpu = _cpu_s(engine) - engine0, _cpu_s(me) - me0
    sock.send(b"stop")
    loop.remove_reader(sock.getsockopt(zmq.FD))
    sock.close(linger=1000)
    return {"engine_us_per_token": engine_cpu / tokens * 1e6,
            "api_us_per_token": api_cpu / tokens * 1e6}


def _run_pair(engine_target: Any, engine_args: tuple, api: Any) -> dict[str, float]:
    engine = mp.get_context("spawn").Process(target=engine_target, args=engine_args)
    engine.start()
    try:
        try:
            import uvloop

            return uvloop.run(api(engine.pid))
        except ImportError:
            return asyncio.run(api(engine.pid))
    finally:
        os.kill(engine.pid, signal.SIGTERM)
        engine.join(10)


def _stand_in_alone(args: argparse.Namespace, step_s: float, result: Any) -> None:
    """CPU per token of the stand-in's own steps, sleeps included, with no wire: what the
    engine process costs before it sends or receives anything (the floor of its column)."""
    engine = StandInEngine()
    StandInEngine.step_s = step_s
    sampling = SamplingParams(max_tokens=args.output_len)
    prompt = list(range(1, args.prompt_len + 1))
    me = psutil.Process()
    start, tokens, next_id = _cpu_s(me), 0, 0
    while next_id < args.requests or engine.seqs:
        while len(engine.seqs) < args.concurrency and next_id < args.requests:
            engine.add_request(AddRequest(f"r{next_id}", prompt, sampling))
            next_id += 1
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    result.put((_cpu_s(me) - start) / tokens * 1e6)


def _floor(args: argparse.Namespace, step_s: float) -> float:
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    process = ctx.Process(target=_stand_in_alone, args=(args, step_s, result))
    process.start()
    try:
        return result.get(timeout=600)
    finally:
        process.join(10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=5.0, help="model time per step")
    parser.add_argument("--iterate", action="store_true",
                        help="read each stream by iterating it (a task wake per output) "
                        "instead of as the server does (handed on in the reader)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    from rpc.sockets import IpcDir

    step_s = args.step_ms / 1000
    steps = args.requests * args.output_len // args.concurrency
    with IpcDir() as ipc:
        address = ipc.address("engine")
        result = _run_pair(_engine_main, (address, step_s),
                           lambda pid: _api_side(address, pid, args))
        raw = _run_pair(_raw_engine, (ipc.address("raw"), steps, step_s, args.concurrency),
                        lambda pid: _raw_api(ipc.address("raw"), pid, steps))
    result["raw_engine_us_per_token"] = raw["engine_us_per_token"]
    result["raw_api_us_per_token"] = raw["api_us_per_token"]
    result["stand_in_us_per_token"] = floor = _floor(args, step_s)
    result["engine_wire_us_per_token"] = result["engine_us_per_token"] - floor
    result["raw_engine_wire_us_per_token"] = result["raw_engine_us_per_token"] - floor
    print(f"{args.requests} requests x {args.output_len} tokens, {args.concurrency} in flight, "
          f"{args.step_ms} ms per step; CPU us per streamed token")
    print(f"{'':<24}{'flatserve':>11}{'raw pyzmq':>11}{'ratio':>8}")
    for label, key in (("engine process", "engine"), ("engine, less its steps", "engine_wire"),
                       ("api process", "api")):
        ours, limit = result[f"{key}_us_per_token"], result[f"raw_{key}_us_per_token"]
        ratio = ours / limit if limit > 0 else float("nan")  # a run too short to time
        print(f"{label:<24}{ours:>11.2f}{limit:>11.2f}{ratio:>8.2f}")
    print(f"the stand-in's steps alone (sleeps included, no wire): {floor:.2f} us per token; "
          f"{result['tokens_per_s']:.0f} tokens/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
