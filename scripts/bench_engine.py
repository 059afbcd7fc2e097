"""Offline engine benchmark: LLMEngine vs transformers `generate` on the same requests.

A mixed batch of image and text requests (default 32, all arriving at once) runs through
flatserve's in-process engine and through transformers' Qwen2_5_VLForConditionalGeneration:
one request at a time, and in left-padded batches. Each system runs in its own fresh
process so its peak RSS is its own. Prints a table (output tokens/s, mean/p50 time to
first token, peak RSS, and the engine's throughput as a multiple of each) and can write
JSON with the headline ratio under `speedup_vs_transformers`.

    python scripts/bench_engine.py [--model PATH] [--num-requests 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

IMAGE_SIZES = [(56, 56), (84, 112), (112, 112), (140, 168), (224, 224)]


@dataclass
class Spec:
    """One benchmark request, buildable in any process."""

    request_id: str
    prompt_token_ids: list[int]
    image_sizes: list[tuple[int, int]]
    image_seed: int
    max_tokens: int


@dataclass
class Result:
    system: str
    num_requests: int
    output_tokens: int
    wall_s: float
    ttft_s: list[float]
    peak_rss_mib: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def row(self) -> dict:
        def num(x: float, scale: float = 1.0) -> float | None:  # None (JSON null) for NaN
            return None if np.isnan(x) else round(scale * float(x), 1)

        return {
            "system": self.system,
            "output_tokens_per_s": round(self.tokens_per_s, 1),
            "mean_ttft_ms": num(np.mean(self.ttft_s), 1000),
            "p50_ttft_ms": num(np.median(self.ttft_s), 1000),
            "peak_rss_mib": num(self.peak_rss_mib),
            "wall_s": round(self.wall_s, 3),
            "output_tokens": self.output_tokens,
        }


def make_specs(
    config,
    num_requests: int,
    image_fraction: float,
    min_tokens: int,
    max_tokens: int,
    seed: int,
    image_sizes: list[tuple[int, int]] = IMAGE_SIZES,
    prompt_len: int = 0,
) -> list[Spec]:
    """prompt_len: tokens of every prompt (0: drawn from 16-95)."""
    rng = np.random.default_rng(seed)
    specs = []
    for i in range(num_requests):
        ids = rng.integers(10, 3900, prompt_len or int(rng.integers(16, 96))).tolist()
        sizes = []
        if rng.random() < image_fraction:
            h, w = image_sizes[int(rng.integers(len(image_sizes)))]
            sizes.append((h, w))
            n = (h // 14) * (w // 14) // 4
            tail = rng.integers(10, 3900, int(rng.integers(4, 24))).tolist()
            ids = ids[:8] + [config.vision_start_token_id] + [config.image_token_id] * n
            ids += [config.vision_end_token_id] + tail
        num_out = int(rng.integers(min_tokens, max_tokens + 1))
        specs.append(Spec(f"req-{i}", ids, sizes, seed * 1000 + i, num_out))
    return specs


def images_of(spec: Spec) -> list[np.ndarray]:
    rng = np.random.default_rng(spec.image_seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in spec.image_sizes]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- flatserve ------------------------------------------------------------------------


# The dense math of a forward: what an engine with no overhead at all would still run.
KERNEL_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_attention_math",
)


def drive(engine, requests: list, steady_concurrency: int = 0) -> tuple[int, list[float]]:
    """Run `requests` through `engine` to the end; returns the output tokens and each
    request's time to first token (from the call). All arrive at once, or (steady_concurrency
    > 0) one per step until that many are in flight, then one per finished request at the
    next step: a closed loop whose newcomers' prefills always share steps with decodes.
    Consumes `requests`: the engine owns each one (and its pixels) once added."""
    pending = requests
    pending.reverse()  # pop() from the end takes them in order
    # How many more may arrive now: all at once, or one per step up to the concurrency.
    allowance = len(pending) if not steady_concurrency else 1
    in_flight = num_tokens = 0
    first: dict[str, float] = {}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while (
            pending and allowance > 0 and (not steady_concurrency or in_flight < steady_concurrency)
        ):
            engine.add_request(pending.pop())
            allowance -= 1
            in_flight += 1
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            num_tokens += len(output.new_token_ids)
            first.setdefault(output.request_id, now - start)
            if output.finish_reason is not None:
                in_flight -= 1
        if steady_concurrency:
            allowance = 1
    return num_tokens, list(first.values())


def run_engine(
    model: str,
    specs: list[Spec],
    args: dict,
    kernels_only: bool = False,
    steady_concurrency: int = 0,
) -> Result:
    """The engine over `specs`. kernels_only: run it under torch.profiler and report the
    time spent inside KERNEL_OPS as the wall time (a floor for any engine on this
    machine, same dtype and threads); CPU only. steady_concurrency: see `drive`."""
    import torch

    from engine_proc.llm_engine import LLMEngine
    from shared.messages import AddRequest, ImageInput
    from shared.sampling_params import SamplingParams

    engine = LLMEngine(model, **args)

    def requests(prefix: str):
        for spec in specs:
            images = [
                ImageInput(p, (1, p.shape[0] // 14, p.shape[1] // 14)) for p in images_of(spec)
            ]
            sampling = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
            yield AddRequest(prefix + spec.request_id, spec.prompt_token_ids, sampling, images)

    # first-call costs stay out of the figures; only 4 warm-up requests (and images) are built
    engine.generate(list(itertools.islice(requests("warmup-"), 4)))
    pending = list(requests(""))
    profiler = None
    if kernels_only:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.start()
    start = time.perf_counter()
    num_tokens, first = drive(engine, pending, steady_concurrency)
    wall = time.perf_counter() - start
    if not kernels_only:
        name = "flatserve LLMEngine"
        if steady_concurrency:
            name += f", steady (staggered, {steady_concurrency} in flight)"
        return Result(name, len(specs), num_tokens, wall, first, peak_rss_mib())
    profiler.stop()
    kernel_us = sum(e.self_cpu_time_total for e in profiler.key_averages() if e.key in KERNEL_OPS)
    return Result(
        "floor: matmul + attention kernels only",
        len(specs),
        num_tokens,
        kernel_us / 1e6,
        [float("nan")],
        float("nan"),
    )


# ---- transformers ---------------------------------------------------------------------


class _FirstToken:
    """A generate streamer that notes when the first new token appears."""

    def __init__(self, start: float):
        self.start = start
        self.calls = 0
        self.first: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            self.first = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def run_transformers(model_path: str, specs: list[Spec], batch_size: int, dtype: str) -> Result:
    import torch
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_path, dtype=getattr(torch, dtype)
    ).eval()
    processor = AutoImageProcessor.from_pretrained(model_path)
    image_token_id = model.config.image_token_id
    pad_id = model.generation_config.pad_token_id or 0

    def generate(batch: list[Spec], start: float) -> tuple[int, float]:
        length = max(len(s.prompt_token_ids) for s in batch)
        ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, spec in enumerate(batch):  # left padding
            ids[i, length - len(spec.prompt_token_ids) :] = torch.tensor(spec.prompt_token_ids)
            mask[i, length - len(spec.prompt_token_ids) :] = 1
        kwargs = dict(
            input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == image_token_id).int()
        )
        images = [p for spec in batch for p in images_of(spec)]
        if images:
            processed = processor(images=images, return_tensors="pt")
            kwargs.update(
                pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"]
            )
        streamer = _FirstToken(start)
        # a static batch runs until its longest request is done; min_new_tokens because
        # the engine runs with ignore_eos (same lengths); each row counts only its own
        num_out = max(s.max_tokens for s in batch)
        with torch.no_grad():
            model.generate(
                **kwargs,
                max_new_tokens=num_out,
                min_new_tokens=num_out,
                do_sample=False,
                streamer=streamer,
            )
        return sum(s.max_tokens for s in batch), streamer.first

    generate(specs[:2], time.perf_counter())  # warmup
    ttft: list[float] = []
    num_tokens = 0
    start = time.perf_counter()
    for i in range(0, len(specs), batch_size):
        batch = specs[i : i + batch_size]
        n, first = generate(batch, start)
        num_tokens += n
        ttft += [first] * len(batch)
    wall = time.perf_counter() - start
    name = "transformers generate, " + (
        "one at a time" if batch_size == 1 else f"batches of {batch_size}"
    )
    return Result(name, len(specs), num_tokens, wall, ttft, peak_rss_mib())


# ---- driver ---------------------------------------------------------------------------


def _child(target, args, threads, queue) -> None:
    if target is run_engine:  # the engine runs with the settings a spawned engine gets
        from shared.memory import bound_kernel_caches

        bound_kernel_caches()
    if threads:
        import torch

        torch.set_num_threads(threads)
    try:
        queue.put(("ok", asdict(target(*args))))
    except Exception as exc:  # reported in the table instead of killing the run
        queue.put(("error", f"{type(exc).__name__}: {exc}"))
    queue.close()
    queue.join_thread()  # the result is in the pipe: skip the teardown (0.5 s of torch's)
    os._exit(0)


def in_fresh_process(target, args: tuple, threads: int) -> Result | str:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(target, args, threads, queue))
    proc.start()
    status, payload = queue.get()
    proc.join()
    return Result(**payload) if status == "ok" else payload


def steady_vs_synchronized(model: str, config, args, engine_args: dict) -> dict:
    """The engine on the same requests twice per kind (text, image): all arriving at once,
    and in the steady state (`run_engine` steady_concurrency). Mixed prompt and output
    lengths (output within --steady-output-spread of --max-tokens). Prints a table; returns
    the rows and the ratios steady / synchronized in output tokens/s."""
    concurrency = args.steady_concurrency
    engine_args = {**engine_args, "max_num_seqs": concurrency}
    spread = args.steady_output_spread
    lo = max(1, round(args.max_tokens * (1 - spread)))
    hi = max(lo, round(args.max_tokens * (1 + spread)))
    size = args.steady_image_size
    kinds = {
        "text": make_specs(
            config, args.steady_requests, 0.0, lo, hi, args.seed, prompt_len=args.prompt_len
        ),
        "image": make_specs(
            config, args.steady_images, 1.0, lo, hi, args.seed, image_sizes=[(size, size)]
        ),
    }
    rows, ratios = [], {}
    for kind, specs in kinds.items():
        if not specs:
            continue  # --steady-requests 0 or --steady-images 0
        pair = []
        for steady in (0, concurrency):
            label = f"{kind}: " + ("steady" if steady else "synchronized")
            print(f"running {label} ...", file=sys.stderr, flush=True)
            result = in_fresh_process(
                run_engine, (model, specs, engine_args, False, steady), args.threads
            )
            if isinstance(result, str):
                print(f"  {label} failed: {result}", file=sys.stderr)
                break
            pair.append(result)
            rows.append({**result.row(), "system": label})
        if len(pair) == 2:
            ratios[f"steady_vs_synchronized_{kind}"] = round(
                pair[1].tokens_per_s / pair[0].tokens_per_s, 3
            )
    print(
        f"\nsteady state vs synchronized: {args.steady_requests} text requests and "
        f"{args.steady_images} with one {size}x{size} image, output {lo}-{hi} tokens, "
        f"{concurrency} in flight"
    )
    header = ["run", "out tok/s", "p50 TTFT ms", "wall s"]
    keys = ["system", "output_tokens_per_s", "p50_ttft_ms", "wall_s"]
    widths = [
        max(len(h), *(len(str(r[k])) for r in rows)) for h, k in zip(header, keys, strict=True)
    ]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(str(row[k]).ljust(w) for k, w in zip(keys, widths, strict=True)))
    for key, value in ratios.items():
        print(f"{key}: {value}")
    return {"steady_rows": rows, **ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the tiny model)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument(
        "--min-tokens",
        type=int,
        default=None,
        help="draw each request's output length from [min, max]",
    )
    parser.add_argument("--image-fraction", type=float, default=0.5)
    parser.add_argument(
        "--hf-batch-sizes", default="1,8,32", help="transformers batch sizes to run"
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights and activations, the same for both systems",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per system (0: torch's default)"
    )
    parser.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the engine's matmul and attention kernels alone (CPU): the most any "
        "engine could reach with no overhead, as a limit beside the ratios",
    )
    parser.add_argument(
        "--steady",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also compare the engine in the steady state (staggered arrivals, closed loop) "
        "with the same requests arriving at once, for text and for images",
    )
    parser.add_argument("--steady-concurrency", type=int, default=32)
    parser.add_argument("--steady-requests", type=int, default=96, help="text requests")
    parser.add_argument("--steady-images", type=int, default=32, help="image requests")
    parser.add_argument("--steady-image-size", type=int, default=448, help="pixels per side")
    parser.add_argument(
        "--steady-output-spread",
        type=float,
        default=0.5,
        help="steady runs draw output lengths from max_tokens * [1 - s, 1 + s]",
    )
    parser.add_argument(
        "--prompt-len", type=int, default=0, help="tokens of every text prompt (0: 16-95 mixed)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)

    from shared.model_config import load_model_config
    from shared.random_checkpoints import ensure_tiny_checkpoint

    model = str(args.model or ensure_tiny_checkpoint())
    config = load_model_config(model)
    min_tokens = args.max_tokens if args.min_tokens is None else args.min_tokens
    specs = make_specs(
        config,
        args.num_requests,
        args.image_fraction,
        min_tokens,
        args.max_tokens,
        args.seed,
        prompt_len=args.prompt_len,
    )
    engine_args = dict(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        device=args.device,
        dtype=args.dtype,
    )
    results: list[Result] = []
    errors: dict[str, str] = {}
    runs = [("flatserve", run_engine, (model, specs, engine_args))]
    if args.floor:
        runs.append(("kernel floor", run_engine, (model, specs, engine_args, True)))
    for bs in (int(b) for b in args.hf_batch_sizes.split(",") if b):
        runs.append((f"transformers bs={bs}", run_transformers, (model, specs, bs, args.dtype)))
    for name, target, target_args in runs:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        result = in_fresh_process(target, target_args, args.threads)
        if isinstance(result, str):
            errors[name] = result
            print(f"  {name} failed: {result}", file=sys.stderr)
        else:
            results.append(result)

    engine = results[0] if results and results[0].system.startswith("flatserve") else None
    floor = next((r for r in results if r.system.startswith("floor")), None)
    rows = [r.row() for r in results]
    for result, row in zip(results, rows, strict=True):
        row["engine_speedup"] = (
            round(engine.tokens_per_s / result.tokens_per_s, 2) if engine else None
        )
    hf = [r for r in results if r.system.startswith("transformers")]
    best_hf = max(hf, key=lambda r: r.tokens_per_s) if hf else None
    speedup = round(engine.tokens_per_s / best_hf.tokens_per_s, 2) if engine and best_hf else None

    num_images = sum(bool(s.image_sizes) for s in specs)
    lengths = (
        f"{args.max_tokens}" if min_tokens == args.max_tokens else f"{min_tokens}-{args.max_tokens}"
    )
    print(
        f"\n{len(specs)} concurrent requests ({num_images} with an image, {len(specs) - num_images} "
        f"text-only), {lengths} output tokens each, model {Path(model).name}, {args.dtype}, "
        f"torch threads {args.threads or 'default'}\n"
    )
    header = ["system", "out tok/s", "mean TTFT ms", "p50 TTFT ms", "peak RSS MiB", "engine x"]
    keys = [
        "system",
        "output_tokens_per_s",
        "mean_ttft_ms",
        "p50_ttft_ms",
        "peak_rss_mib",
        "engine_speedup",
    ]
    widths = [
        max(len(h), *(len(str(r[k])) for r in rows)) for h, k in zip(header, keys, strict=True)
    ]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(str(row[k]).ljust(w) for k, w in zip(keys, widths, strict=True)))
    ceiling = round(floor.tokens_per_s / best_hf.tokens_per_s, 2) if floor and best_hf else None
    if best_hf:
        print(f"\nspeedup vs best transformers ({best_hf.system}): {speedup}x output tokens/s")
    if ceiling:
        print(
            f"ceiling on this machine: {ceiling}x (the kernel floor vs the same transformers "
            f"run: an engine with zero overhead would reach that much, no more)"
        )
    for name, error in errors.items():
        print(f"{name}: FAILED {error}")
    steady = steady_vs_synchronized(model, config, args, engine_args) if args.steady else {}
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "num_requests": len(specs),
                    "num_image_requests": num_images,
                    "min_tokens": min_tokens,
                    "max_tokens": args.max_tokens,
                    "threads": args.threads,
                    "dtype": args.dtype,
                    "model": model,
                    "results": rows,
                    "errors": errors,
                    "best_transformers": best_hf.system if best_hf else None,
                    "speedup_vs_transformers": speedup,
                    "ceiling_vs_transformers": ceiling,
                    **steady,
                },
                indent=2,
            )
            + "\n"
        )
    return 0 if engine else 1


if __name__ == "__main__":
    sys.exit(main())
