"""The engine's paths against this machine's kernel floor.

Times three paths of a checkpoint through the real engine, and beside each the time the same
work takes at this machine's measured speeds: its matmul FLOPs (the model's linear layers
and attention, counted from the loaded modules) at the best float32/bfloat16 matmul speed
measured here on the model's own shapes, or the bytes it must read (weights, KV cache) at
the measured memory bandwidth, whichever is longer. `floor / measured` says how close each
path is (1.0: nothing but the kernels at full speed).

- prefill: one request of --prompt-len tokens, its whole prompt in one step (and its first
  token's LM head row);
- decode: a decode-only step of --decode-batch sequences at --prompt-len tokens of context;
- vision: one --image-size image through the vision tower (patch embedding to merger).

    python scripts/bench_floor.py --model DIR [--prompt-len 512] [--decode-batch 8]
        [--image-size 448] [--dtype float32] [--pack-weights] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

REPEATS = 3


def best_time(fn, repeats: int = REPEATS) -> float:
    repeats = max(1, repeats)
    fn()  # first-call costs (allocation, kernel selection) stay out
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_speed(shapes: list[tuple[int, int, int]], dtype: torch.dtype) -> float:
    """The best FLOP/s over (M, K, N) products x[M, K] @ w[N, K]^T of this dtype."""
    best = 0.0
    for m, k, n in shapes:
        x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        seconds = best_time(lambda x=x, w=w: torch.nn.functional.linear(x, w))
        best = max(best, 2 * m * k * n / seconds)
    return best


def memory_bandwidth(num_bytes: int = 1 << 29) -> float:
    """Bytes/s of a large copy (read + write)."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    return 2 * num_bytes / best_time(lambda: dst.copy_(src))


def linear_weights(module: nn.Module, skip: tuple[nn.Module, ...] = ()) -> list[torch.Tensor]:
    """The weight matrices a token's forward multiplies by (2-D or convolution weights,
    oneDNN-packed ones included; embeddings and norms left out)."""
    skipped = {id(p) for s in skip for p in s.parameters()}
    packed = [(n, b) for n, b in module.named_buffers() if n.endswith("packed_weight")]
    out = []
    for name, param in [*module.named_parameters(), *packed]:
        if id(param) in skipped or param.dim() < 2 or "embed_tokens" in name:
            continue
        out.append(param)
    return out


def numel(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def random_prompt(rng: np.random.Generator, length: int, vocab: int) -> list[int]:
    return rng.integers(100, min(vocab, 4000), length).tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint folder")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the "
                                                       "checkpoint's)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help="timed runs of each path after a first one (the best is kept)")
    parser.add_argument("--pack-weights", action=argparse.BooleanOptionalAction, default=False,
                        help="run the engine with its linear layers packed for oneDNN "
                             "(flatserve serve --pack-weights)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from engine_proc.llm_engine import LLMEngine
    from shared.messages import AddRequest
    from shared.sampling_params import SamplingParams

    p, b = args.prompt_len, args.decode_batch
    engine = LLMEngine(args.model, dtype=args.dtype, max_num_seqs=max(b, 1),
                       max_num_batched_tokens=max(p * b, 8192), enable_prefix_caching=False,
                       encoder_cache_bytes=0, max_model_len=p + 64,
                       pack_weights=args.pack_weights)
    model = engine.model_runner.model
    cfg = engine.config
    text = cfg.text
    dtype = next(model.parameters()).dtype
    size = dtype.itemsize
    head_dim = text.head_dim or text.hidden_size // text.num_attention_heads
    lm_head = linear_weights(model.lm_head)
    decoder = linear_weights(model.model, skip=())
    vision = linear_weights(model.visual)
    num_layers = text.num_hidden_layers
    rng = np.random.default_rng(0)

    # --- the machine
    gemm = matmul_speed([(p, text.hidden_size, text.intermediate_size),
                         (p, text.intermediate_size, text.hidden_size),
                         (2048, text.hidden_size, 2 * text.intermediate_size)], dtype)
    bandwidth = memory_bandwidth()
    print(f"machine: {gemm / 1e9:.1f} GFLOP/s ({dtype}, the model's shapes), "
          f"{bandwidth / 1e9:.1f} GB/s copy; {torch.get_num_threads()} threads", flush=True)

    def sampling(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    rows = []

    # --- prefill: one whole prompt in one step
    def prefill() -> None:
        engine.add_request(AddRequest(f"p{rng.integers(1 << 30)}",
                                      random_prompt(rng, p, text.vocab_size), sampling(1), []))
        while engine.has_unfinished_requests():
            engine.step()

    measured = best_time(prefill, args.repeats)
    flops = 2 * p * numel(decoder) + 2 * p * p * text.num_attention_heads * head_dim * num_layers
    flops += 2 * numel(lm_head)  # the last row's logits
    memory = (numel(decoder) + numel(lm_head)) * size
    rows.append(("prefill", f"{p} tokens", measured, flops, memory))

    # --- decode: a decode-only step of b sequences at p tokens of context
    for i in range(b):
        engine.add_request(AddRequest(f"d{i}", random_prompt(rng, p, text.vocab_size),
                                      sampling(64), []))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    steps = []
    for _ in range(max(1, args.repeats) + 1):
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    measured = min(steps[1:])
    kv_bytes = b * (p + 2) * 2 * text.num_key_value_heads * head_dim * size * num_layers
    flops = 2 * b * (numel(decoder) + numel(lm_head))
    flops += 4 * b * (p + 2) * text.num_attention_heads * head_dim * num_layers
    memory = (numel(decoder) + numel(lm_head)) * size + kv_bytes
    rows.append(("decode", f"{b} seqs x {p} context", measured, flops, memory))
    for seq in list(engine.scheduler.running):
        engine.abort_request(seq.request_id)
    while engine.has_unfinished_requests():
        engine.step()

    # --- vision: one image through the tower
    side = args.image_size // 28 * 28
    grid = (1, side // 14, side // 14)
    pixels = torch.from_numpy(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))

    def encode() -> None:
        with torch.inference_mode():
            model.encode_images([pixels], [grid])

    measured = best_time(encode, args.repeats)
    patches = grid[1] * grid[2]
    vcfg = cfg.vision
    full = set(vcfg.fullatt_block_indexes)
    window = (vcfg.window_size // vcfg.patch_size) ** 2 if vcfg.window_size else patches
    attention = sum(4 * patches * (patches if i in full else min(window, patches))
                    * vcfg.hidden_size for i in range(vcfg.depth))
    flops = 2 * patches * numel(vision) + attention  # the merger's rows counted per patch
    rows.append(("vision", f"{side}px, {patches} patches", measured, flops, numel(vision) * size))

    print(f"\n{'path':<9}{'shape':<24}{'measured ms':>12}{'compute ms':>12}{'memory ms':>11}"
          f"{'floor ms':>10}{'floor/measured':>16}")
    out = []
    for name, shape, seconds, flops, memory in rows:
        compute_s, memory_s = flops / gemm, memory / bandwidth
        floor = max(compute_s, memory_s)
        print(f"{name:<9}{shape:<24}{seconds * 1e3:12.1f}{compute_s * 1e3:12.1f}"
              f"{memory_s * 1e3:11.1f}{floor * 1e3:10.1f}{floor / seconds:16.2f}")
        out.append({"path": name, "shape": shape, "measured_ms": seconds * 1e3,
                    "compute_floor_ms": compute_s * 1e3, "memory_floor_ms": memory_s * 1e3,
                    "floor_over_measured": floor / seconds, "gflop": flops / 1e9})
    if args.json:
        args.json.write_text(json.dumps({"gemm_flops": gemm, "bandwidth": bandwidth,
                                         "dtype": str(dtype), "rows": out,
                                         "median_decode_step_ms": statistics.median(steps) * 1e3},
                                        indent=2) + "\n")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
