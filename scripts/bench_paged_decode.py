"""Decode attention over the paged KV cache, one layer: attention.py's eager path (the new
keys written, the blocks gathered, masked SDPA) against the same write and the Triton kernel
that reads the cache in place (engine_proc/layers/paged_decode_attention_triton.py), eager
and replayed in a CUDA graph, for batch sizes x context lengths x split counts. Prints a
table (microseconds per layer call, the KV bytes the kernel reads and its rate) and checks
each kernel result against the eager path's.

    python scripts/bench_paged_decode.py [--batch-sizes 1,32,128] [--context-lens 512,2048]
        [--splits 4,8,16] [--heads 16 --kv-heads 2 --head-dim 128] [--dtype bfloat16]
        [--json out.json]

Defaults: Qwen2.5-VL-3B's attention shapes, bf16, block size 16. `--device cpu` runs the
kernel in Triton's interpreter (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK_SIZE = 16


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=_ints, default=_ints("1,32,128"))
    parser.add_argument("--context-lens", type=_ints, default=_ints("512,2048"))
    parser.add_argument("--splits", type=_ints, default=_ints("4,8,16"))
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--json", default="")
    return parser.parse_args(argv)


def _timed(fn, iters: int, cuda: bool) -> float:
    """Microseconds per call, after one warm-up call."""
    import torch

    fn()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def _case(args, batch: int, context: int, device):
    """Caches holding `batch` sequences of `context` keys (the last one written by the
    measured call), blocks scattered; the Context of their decode step."""
    import torch

    from engine_proc.context import Context

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(batch * 7 + context)
    width = -(-context // BLOCK_SIZE)
    num_blocks = batch * width + 1
    tables = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width)
    shape = (num_blocks, BLOCK_SIZE, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    last = context - 1
    slots = tables[:, last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE
    ctx = Context(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        slot_mapping=slots.to(device), block_tables=tables.to(device, torch.int32),
        max_q_len=1, max_seq_len=context, all_decode=True, num_decodes=batch)
    q = torch.randn(batch, args.heads, args.head_dim, generator=gen).to(device, dtype)
    k = torch.randn(batch, args.kv_heads, args.head_dim, generator=gen).to(device, dtype)
    v = torch.randn(batch, args.kv_heads, args.head_dim, generator=gen).to(device, dtype)
    return k_cache, v_cache, ctx, q, k, v


def measure(args, batch: int, context: int, device) -> list[dict]:
    import torch

    from engine_proc.layers import paged_decode_attention_triton as kernel
    from engine_proc.layers.attention import Attention, build_attention_metadata

    cuda = device.type == "cuda"
    k_cache, v_cache, ctx, q, k, v = _case(args, batch, context, device)
    layer = Attention(args.heads, args.kv_heads, args.head_dim)
    layer.k_cache, layer.v_cache = k_cache, v_cache
    meta = build_attention_metadata(ctx, batch, BLOCK_SIZE, q.dtype)
    eager_us = _timed(lambda: layer(q, k, v, meta), args.iters, cuda)
    want = layer(q, k, v, meta).view(batch, args.heads, args.head_dim).float()
    flat = args.kv_heads * args.head_dim
    kv_bytes = 2 * batch * context * flat * q.element_size()
    rows = []
    for splits in args.splits:
        out = torch.empty_like(q)
        workspace = torch.empty(kernel.workspace_shape(batch, args.heads, args.head_dim, splits),
                                device=device)

        def step(splits=splits, out=out, workspace=workspace):
            for cache, new in ((k_cache, k), (v_cache, v)):
                cache.view(-1, flat).index_copy_(0, ctx.slot_mapping, new.reshape(batch, flat))
            kernel.paged_decode_attention(q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens,
                                          layer.scale, num_splits=splits, out=out,
                                          workspace=workspace)

        triton_us = _timed(step, args.iters, cuda)
        err = float((out.float() - want).abs().max())
        graph_us = None
        if cuda:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            graph_us = _timed(graph.replay, args.iters, cuda)
        rows.append({
            "batch": batch, "context": context, "splits": splits,
            "eager_sdpa_us": round(eager_us, 1), "triton_us": round(triton_us, 1),
            "triton_graph_us": None if graph_us is None else round(graph_us, 1),
            "kv_mib": round(kv_bytes / (1 << 20), 2),
            "triton_gbps": round(kv_bytes / ((graph_us or triton_us) * 1e3), 1),
            "max_abs_diff": err,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton defines the kernels
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_paged_decode: no CUDA device (--device cpu runs the interpreter)",
              file=sys.stderr)
        return 2
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    rows = []
    with torch.inference_mode():
        for batch in args.batch_sizes:
            for context in args.context_lens:
                rows += measure(args, batch, context, device)
    print(f"paged decode attention, one layer, {name}, {args.dtype}, heads {args.heads}/"
          f"{args.kv_heads}, head_dim {args.head_dim}, block {BLOCK_SIZE} (us per call)")
    header = list(rows[0])
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in header) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
