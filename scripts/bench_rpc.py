"""Benchmark the rpc package against raw pyzmq, memcpy and pickle, in one run.

A server process (spawn) hosts an RpcServer (coalescing on), a second RpcServer with
coalescing off, and a raw pyzmq asyncio ROUTER; this process is the client. Both ends run
uvloop where it is installed. Prints one table of ratios; `--json PATH` writes the figures.

    .venv/bin/python scripts/bench_rpc.py [--transport ipc|tcp] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import pickle
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from rpc import Codec, IpcDir, RpcClient, RpcServer, new_event_loop

SMALL = {"request_id": "req-0001", "token_ids": [101, 2023, 2003, 1037], "finish": None}
SMALL_BYTES = b"x" * 64  # what raw pyzmq echoes: about the size of SMALL packed
MB = 1 << 20


# -- server process ---------------------------------------------------------------------------


def _serve(role: str, addresses: dict[str, str], ready: Any) -> None:
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    serve = _serve_rpc if role == "rpc" else _serve_raw
    loop.run_until_complete(serve(addresses, ready))


async def _serve_rpc(addresses: dict[str, str], ready: Any) -> None:
    import torch  # noqa: F401  (decoding tensors needs it; import before timing)

    async def echo(x: Any) -> Any:
        return x

    async def count(n: int) -> Any:
        for i in range(n):
            yield i

    async def take(t: Any) -> int:
        return int(t.numel())

    stop = asyncio.Event()

    async def quit() -> None:
        asyncio.get_running_loop().call_later(0.1, stop.set)

    servers = []
    for key, coalesce in (("rpc", True), ("rpc_nocoalesce", False)):
        server = RpcServer(addresses[key], Codec(), coalesce=coalesce)
        server.register_unary("echo", echo)
        server.register_stream("count", count)
        server.register_unary("take", take)
        server.register_unary("quit", quit)
        await server.start()
        servers.append(server)
    ready.set()
    await stop.wait()
    for server in servers:
        await server.close()


async def _serve_raw(addresses: dict[str, str], ready: Any) -> None:
    """The baseline: a plain pyzmq asyncio ROUTER, in its own process because its stream
    loop never yields to the event loop (every send completes at once)."""
    import torch  # noqa: F401

    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.ROUTER)
    raw.setsockopt(zmq.ROUTER_MANDATORY, 1)
    raw.setsockopt(zmq.SNDHWM, 0)
    raw.setsockopt(zmq.RCVHWM, 0)
    raw.bind(addresses["raw"])
    ready.set()
    while True:
        frames = await raw.recv_multipart(copy=False)
        ident, op = frames[0].bytes, frames[1].bytes
        if op == b"echo":
            await raw.send_multipart([ident, frames[2]])
        elif op == b"stream":
            n = int(frames[2].bytes)
            for _ in range(n):
                await raw.send_multipart([ident, SMALL_BYTES])
            await raw.send_multipart([ident, b"end"])
        elif op == b"blob":
            await raw.send_multipart([ident, str(frames[2].buffer.nbytes).encode()])
        elif op == b"pickle":
            t = pickle.loads(frames[2].buffer)
            await raw.send_multipart([ident, str(t.numel()).encode()])
            del t
        elif op == b"quit":
            break
    raw.close(linger=0)


# -- measurements -----------------------------------------------------------------------------


async def _timed(fn: Callable[[], Awaitable[Any]], repeats: int) -> float:
    """Median seconds of `repeats` runs of fn."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def _interleaved(
    a: Callable[[], Awaitable[Any]], b: Callable[[], Awaitable[Any]], rounds: int
) -> tuple[float, float, float]:
    """Run a and b alternately `rounds` times, so that load from other processes hits both
    alike. Returns (median seconds of a, of b, median of the per-round ratios a / b)."""
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(await _timed(a, 1))
        tb.append(await _timed(b, 1))
    ratio = statistics.median(x / y for x, y in zip(ta, tb, strict=True))
    return statistics.median(ta), statistics.median(tb), ratio


async def _bench(addresses: dict[str, str], quick: bool) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    out: dict[str, float] = {}
    codec = Codec()
    client = RpcClient(addresses["rpc"], codec)
    client_nc = RpcClient(addresses["rpc_nocoalesce"], codec, coalesce=False)
    await client.wait_ready(30)
    await client_nc.wait_ready(30)
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.SNDHWM, 0)
    raw.setsockopt(zmq.RCVHWM, 0)
    raw.connect(addresses["raw"])

    # unary round trip
    n_calls = 300 if quick else 1000

    async def rpc_calls() -> None:
        for _ in range(n_calls):
            await client.call("echo", SMALL)

    async def raw_calls() -> None:
        for _ in range(n_calls):
            await raw.send_multipart([b"echo", SMALL_BYTES])
            await raw.recv_multipart()

    await rpc_calls()
    await raw_calls()
    t_rpc, t_raw, ratio = await _interleaved(rpc_calls, raw_calls, 7 if quick else 15)
    out["unary_rtt_us"] = t_rpc / n_calls * 1e6
    out["raw_unary_rtt_us"] = t_raw / n_calls * 1e6
    out["unary_rtt_vs_raw"] = ratio

    # server streaming
    n_items = 20_000 if quick else 100_000

    async def rpc_stream(c: RpcClient = client) -> None:
        async for _ in c.stream("count", n_items):
            pass

    async def rpc_stream_nc() -> None:
        await rpc_stream(client_nc)

    async def raw_stream() -> None:
        await raw.send_multipart([b"stream", str(n_items).encode()])
        while (await raw.recv_multipart())[0] != b"end":
            pass

    await rpc_stream()
    await raw_stream()
    t_rpc, t_raw, ratio = await _interleaved(rpc_stream, raw_stream, 3 if quick else 7)
    t_nc, _, ratio_nc = await _interleaved(rpc_stream_nc, raw_stream, 3 if quick else 5)
    out["stream_items_per_s"] = n_items / t_rpc
    out["stream_items_per_s_no_coalesce"] = n_items / t_nc
    out["raw_stream_items_per_s"] = n_items / t_raw
    out["stream_rate_vs_raw"] = 1 / ratio
    out["stream_rate_no_coalesce_vs_raw"] = 1 / ratio_nc

    # tensor handoff to the other process
    sizes = (4, 64) if quick else (4, 64, 256)
    for size_mb in sizes:
        t = torch.ones(size_mb * MB, dtype=torch.uint8)
        src = t.numpy()
        repeats = {4: 40, 64: 7, 256: 3}[size_mb]

        async def handoff(t: Any = t) -> None:
            await client.call("take", t)

        async def pickled(t: Any = t) -> None:
            await raw.send_multipart([b"pickle", pickle.dumps(t)], copy=True)
            await raw.recv_multipart()

        async def raw_zero_copy(src: np.ndarray = src) -> None:
            await raw.send_multipart([b"blob", src], copy=False)
            await raw.recv_multipart()

        async def memcpy_fresh(src: np.ndarray = src) -> None:
            np.copyto(np.empty_like(src), src)

        dst = np.empty_like(src)

        async def memcpy_warm(src: np.ndarray = src, dst: np.ndarray = dst) -> None:
            np.copyto(dst, src)

        await handoff()
        await pickled()
        t_rpc, t_pickle, ratio_pickle = await _interleaved(handoff, pickled, repeats)
        t_fresh, _, ratio_fresh = await _interleaved(memcpy_fresh, handoff, repeats)
        t_warm, _, ratio_warm = await _interleaved(memcpy_warm, handoff, repeats)
        t_raw, _, ratio_raw = await _interleaved(raw_zero_copy, handoff, repeats)
        key = f"handoff_{size_mb}mb"
        out[f"{key}_ms"] = t_rpc * 1e3
        out[f"{key}_pickle_ms"] = t_pickle * 1e3
        out[f"{key}_memcpy_ms"] = t_fresh * 1e3
        out[f"{key}_memcpy_warm_ms"] = t_warm * 1e3
        out[f"{key}_vs_memcpy"] = 1 / ratio_fresh
        out[f"{key}_vs_memcpy_warm"] = 1 / ratio_warm
        out[f"{key}_speedup_vs_pickle"] = 1 / ratio_pickle
        out[f"{key}_raw_zmq_ms"] = t_raw * 1e3
        out[f"{key}_vs_raw_zmq"] = 1 / ratio_raw
        del t, src, dst

    await raw.send_multipart([b"quit"])
    await client.call("quit")  # the server exits 0.1 s later: close before it does
    await client.close()
    await client_nc.close()
    raw.close(linger=100)
    return out


def _table(r: dict[str, float], sizes: list[int]) -> str:
    rows = [
        ("unary round trip (small msg)", f"{r['unary_rtt_us']:.0f} us",
         f"raw pyzmq {r['raw_unary_rtt_us']:.0f} us", r["unary_rtt_vs_raw"], "<= 1.5x"),
        ("stream items/s (coalescing)", f"{r['stream_items_per_s']:,.0f}/s",
         f"raw pyzmq {r['raw_stream_items_per_s']:,.0f}/s", r["stream_rate_vs_raw"], "higher is better"),
        ("stream items/s (no coalescing)", f"{r['stream_items_per_s_no_coalesce']:,.0f}/s",
         f"raw pyzmq {r['raw_stream_items_per_s']:,.0f}/s", r["stream_rate_no_coalesce_vs_raw"], ""),
    ]
    for mb in sizes:
        k = f"handoff_{mb}mb"
        rows.append((f"{mb} MB tensor handoff vs memcpy", f"{r[k + '_ms']:.1f} ms",
                     f"memcpy {r[k + '_memcpy_ms']:.1f} ms", r[k + "_vs_memcpy"], "<= 3x"))
        rows.append((f"{mb} MB ... vs memcpy, warm dst", f"{r[k + '_ms']:.1f} ms",
                     f"memcpy {r[k + '_memcpy_warm_ms']:.1f} ms", r[k + "_vs_memcpy_warm"], ""))
        rows.append((f"{mb} MB ... vs raw pyzmq copy=False", f"{r[k + '_ms']:.1f} ms",
                     f"raw pyzmq {r[k + '_raw_zmq_ms']:.1f} ms", r[k + "_vs_raw_zmq"], ""))
        rows.append((f"{mb} MB ... speedup vs pickle+copy", f"{r[k + '_ms']:.1f} ms",
                     f"pickle {r[k + '_pickle_ms']:.1f} ms", r[k + "_speedup_vs_pickle"], ">= 2x"))
    head = ("measure", "flatserve rpc", "baseline", "ratio", "target")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *[(a, b, c, f"{d:.2f}x", e) for a, b, c, d, e in rows], strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for a, b, c, d, e in rows:
        cells = (a, b, c, f"{d:.2f}x", e)
        lines.append("  ".join(str(x).ljust(w) for x, w in zip(cells, widths, strict=True)))
    lines.append(
        "timings: medians; ratio: median of per-round ratios, each round running both sides "
        "back to back (robust to load drift), so it can differ from the ratio of the medians. "
        "handoff = call(tensor) to the other process until its reply; memcpy = np.copyto into "
        "fresh memory (a handoff lands in fresh memory too), warm dst = into a reused buffer."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, no 256 MB")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()

    ipc_dir = IpcDir(prefix="flatserve-bench-")
    if args.transport == "ipc":
        addresses = {k: ipc_dir.address(k) for k in ("rpc", "rpc_nocoalesce", "raw")}
    else:
        addresses = {k: f"tcp://127.0.0.1:{p}" for k, p in (("rpc", 47561), ("rpc_nocoalesce", 47562), ("raw", 47563))}
    ctx = mp.get_context("spawn")
    procs = []
    try:
        for role in ("rpc", "raw"):
            ready = ctx.Event()
            proc = ctx.Process(target=_serve, args=(role, addresses, ready), daemon=True)
            proc.start()
            procs.append(proc)
            if not ready.wait(60):
                sys.exit(f"bench: {role} server process did not start")
        loop = new_event_loop()
        results = loop.run_until_complete(_bench(addresses, args.quick))
        loop.close()
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        ipc_dir.close()
    sizes = [4, 64] if args.quick else [4, 64, 256]
    print(f"rpc benchmark, {args.transport}://, uvloop={'uvloop' in sys.modules}, "
          f"server in another process")
    print(_table(results, sizes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"transport": args.transport, **results}, f, indent=2, sort_keys=True)


if __name__ == "__main__":
    main()
