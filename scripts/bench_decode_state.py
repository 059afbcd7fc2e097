"""Decode step of a hybrid model (Qwen3.5) against the number of running sequences, and
where its time goes.

For each batch size N, N sequences are prefilled (a prompt of --prompt-len tokens each),
then decode-only steps are timed. Every Gated DeltaNet layer reads and writes each
sequence's recurrent state once per step (in place by slot where the CPU kernel runs,
else gathered, advanced and scattered back), so the state traffic grows with N while the
weights are read once: the table prints the step time, the time per token, the state
bytes moved per step and at what rate while the states are worked on, `state_share`: the share of the step spent in the layers' conv and
delta rule with their states (wall clock, both paths alike), and from torch.profiler the
share in the torch ops that move states (index_select / index_copy_ / bmm / baddbmm /
mul_: the torch path's) and in matmuls. FLATSERVE_DELTA_RULE_KERNEL=0 runs the torch path.

    python scripts/bench_decode_state.py --model FOLDER [--batch-sizes 1,8,32,64]
        [--dtype float32] [--threads 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STATE_OPS = ("aten::index_select", "aten::index_copy_", "aten::bmm", "aten::baddbmm_",
             "aten::mul_")
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul")


def _requests(config, n: int, prompt_len: int, seed: int):
    import numpy as np

    from shared.messages import AddRequest
    from shared.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = min(config.text.vocab_size, 4000)
    for i in range(n):
        ids = rng.integers(10, vocab, prompt_len).tolist()
        yield AddRequest(f"r{i}", ids, SamplingParams(max_tokens=10**6, temperature=0.0,
                                                      ignore_eos=True))


class StateClock:
    """Wall time in every Gated DeltaNet layer's conv and delta rule (states included)."""

    def __init__(self) -> None:
        from engine_proc.layers.gated_delta_net import GatedDeltaNet

        self.seconds = 0.0
        for name in ("_conv", "_delta_rule"):
            setattr(GatedDeltaNet, name, self._timed(getattr(GatedDeltaNet, name)))

    def _timed(self, method):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return timed


def measure(engine, config, n: int, args, clock: StateClock) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    for request in _requests(config, n, args.prompt_len, n):
        engine.add_request(request)
    while any(s.num_completion_tokens == 0 for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    for _ in range(2):
        engine.step()  # warm
    clock.seconds = 0.0
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_s = (time.perf_counter() - started) / args.steps
    state_share = clock.seconds / args.steps / step_s
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            engine.step()
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        totals[event.key] = event.self_cpu_time_total
    everything = sum(totals.values()) or 1.0
    state = sum(totals.get(k, 0.0) for k in STATE_OPS) / everything
    matmul = sum(totals.get(k, 0.0) for k in MATMUL_OPS) / everything
    shape = engine.model_runner.state_shape
    ssm_bytes = shape.num_heads * shape.key_dim * shape.value_dim * shape.ssm_dtype.itemsize
    moved = 2 * n * shape.num_layers * ssm_bytes  # read and written once per step at least
    for request_id in list(engine.seqs):
        engine.abort_request(request_id)
    engine.step()
    del torch
    return {"running": n, "step_ms": round(step_s * 1e3, 2),
            "ms_per_token": round(step_s * 1e3 / n, 3),
            "state_mib_per_step": round(moved / 2**20, 1),
            "state_gb_per_s": round(moved / (state_share * step_s) / 1e9, 2),
            "state_share": round(state_share, 3), "state_ops_share": round(state, 3),
            "matmul_share": round(matmul, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Qwen3.5 checkpoint folder")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)

    import torch

    from engine_proc.llm_engine import LLMEngine
    from shared.model_config import load_model_config

    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_model_config(args.model)
    if not config.text.is_hybrid:
        parser.error(f"{args.model} is not a hybrid model")
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    engine = LLMEngine(args.model, max_num_seqs=max(sizes), max_model_len=args.prompt_len + 512,
                       device="cpu", dtype=args.dtype, decode_share=0.0,
                       enable_prefix_caching=False, encoder_cache_bytes=0)
    clock = StateClock()
    measure(engine, config, max(sizes), args, clock)  # warm-up: kernels, allocator at full size
    rows = [measure(engine, config, n, args, clock) for n in sizes]
    header = list(rows[0])
    print(f"decode steps, {Path(args.model).name}, {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in header) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
