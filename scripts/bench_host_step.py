"""Host time per engine step, beside the GPU time a step cannot go below.

What a GPU waits on between decode steps is the engine process's Python: scheduling, the
step's inputs, sampling settings, postprocessing, the engine's stats and the outputs'
wire encoding. This runs the real engine loop's work on the tiny model with the decoder's
forward replaced by ready-made logits, 16 columns wide (so nothing of the model's compute is
timed, nor the sampler's math over a vocabulary, which is the GPU's too) and
prints, per number of decoding sequences, the host milliseconds a step against the floor of
a 3B bf16 decode step on an H100 (its 6.2 GB of decoder weights read at 3.35 TB/s: 1.85 ms;
--floor-ms for another model or card). Host time above the floor is time the GPU idles
unless the host works ahead.

It also prints how many steps of a closed loop are decode-only (what a decode CUDA graph
can replay; the others, with a prompt chunk in them, run eagerly): concurrency c, prompts
of 300 tokens, outputs of 128 tokens or of 64-192 (uniform), the first quarter of the steps
left out as the ramp.

    python scripts/bench_host_step.py [--seqs 1 32 128] [--steps 64] [--floor-ms 1.85]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine_proc.llm_engine import LLMEngine  # noqa: E402
from engine_proc.model_runner import ModelRunner  # noqa: E402
from rpc.codec import encode  # noqa: E402
from shared.messages import AddRequest, StepOutputs  # noqa: E402
from shared.random_checkpoints import ensure_checkpoint  # noqa: E402
from shared.random_checkpoints.presets import TINY  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402

PROMPT = list(range(5, 25))
SAMPLED_COLUMNS = 16  # the ready logits' width (token ids 0-15: every request ignores EOS)


def host_ms_per_step(path: Path, num_seqs: int, steps: int) -> float:
    engine = LLMEngine(str(path), max_num_seqs=num_seqs, kv_cache_memory_bytes=256 << 20,
                       max_model_len=1024)
    # 16 columns, not the vocabulary: the sampler's math over a step's logits (an argmax
    # over 128 x 151,936 floats takes ~0.3 ms here) is the GPU's work, a launch on the host
    logits = torch.randn(num_seqs, SAMPLED_COLUMNS)
    original = ModelRunner._forward
    ModelRunner._forward = lambda self, inputs, pieces: logits[: len(inputs.sample_rows)]
    try:
        sampling = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
        for i in range(num_seqs):
            engine.add_request(AddRequest(f"r{i}", list(PROMPT), sampling, []))
        while engine.scheduler.num_waiting or not all(
                s.num_completion_tokens for s in engine.seqs.values()):
            engine.step()  # the prefills
        started = time.perf_counter()
        for _ in range(steps):  # what EngineProcess.run does per step, less the socket
            outputs = engine.step()
            stats = engine.stats()
            encode(StepOutputs(outputs, stats))
        return (time.perf_counter() - started) / steps * 1e3
    finally:
        ModelRunner._forward = original
        engine.close()


def decode_only_share(path: Path, concurrency: int, lengths: tuple[int, int],
                      num_requests: int) -> float:
    """The share of a closed loop's steps (after the first quarter) with no prompt chunk."""
    engine = LLMEngine(str(path), max_num_seqs=max(concurrency, 8),
                       kv_cache_memory_bytes=512 << 20, max_model_len=2048)
    logits = torch.randn(max(concurrency, 8) * 2, SAMPLED_COLUMNS)
    decode_only = []
    original_forward, original_run = ModelRunner._forward, ModelRunner.run

    def run(self, batch):
        decode_only.append(batch.num_decode_seqs == len(batch.seqs))
        return original_run(self, batch)

    ModelRunner._forward = lambda self, inputs, pieces: logits[: len(inputs.sample_rows)]
    ModelRunner.run = run
    rng = random.Random(0)

    def request(i: int) -> AddRequest:
        sampling = SamplingParams(max_tokens=rng.randint(*lengths), temperature=0.0,
                                  ignore_eos=True)
        return AddRequest(f"r{i}", list(range(5, 305)), sampling, [])

    try:
        for i in range(concurrency):
            engine.add_request(request(i))
        sent, finished = concurrency, 0
        while finished < num_requests:
            for output in engine.step():
                if output.finish_reason is not None:
                    finished += 1
                    if sent < num_requests:
                        engine.add_request(request(sent))
                        sent += 1
    finally:
        ModelRunner._forward, ModelRunner.run = original_forward, original_run
        engine.close()
    steady = decode_only[len(decode_only) // 4:]
    return sum(steady) / len(steady)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--floor-ms", type=float, default=1.85,
                        help="the GPU step floor to compare with (default: 3B bf16, H100)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = ensure_checkpoint(TINY)
    print("| decoding sequences | host ms / step | us / sequence | GPU floor ms | host / floor |")
    print("| --- | --- | --- | --- | --- |")
    for n in args.seqs:
        ms = host_ms_per_step(path, n, args.steps)
        print(f"| {n} | {ms:.2f} | {ms * 1e3 / n:.1f} | {args.floor_ms:.2f} | "
              f"{ms / args.floor_ms:.2f} |")
    print()
    print("| concurrency | output tokens | decode-only steps |")
    print("| --- | --- | --- |")
    for n in args.seqs:
        for lengths in ((128, 128), (64, 192)):
            share = decode_only_share(path, n, lengths, max(8 * n, 16))
            label = str(lengths[0]) if lengths[0] == lengths[1] else f"{lengths[0]}-{lengths[1]}"
            print(f"| {n} | {label} | {share:.0%} |")


if __name__ == "__main__":
    main()
