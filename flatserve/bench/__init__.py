"""Serving benchmark in the spirit of `vllm bench serve`: streamed chat requests (text, images
or both) against any OpenAI-compatible server, in a closed loop or at a Poisson rate; TTFT,
TPOT, ITL, end-to-end and /health latency percentiles, and throughput.

    from flatserve.bench import BenchConfig, run_bench
    result = run_bench(BenchConfig(base_url="http://127.0.0.1:8000", num_requests=100))
    print(result.ttft_ms["p99"], result.output_tokens_per_s)

`main(argv) -> int` is the command line (`scripts/bench_serve.py`, `flatserve bench`).
"""

from flatserve.bench.config import BenchConfig, build_parser, parse_args
from flatserve.bench.report import format_table
from flatserve.bench.runner import BenchError, main, run_bench, run_rounds
from flatserve.bench.stats import BenchResult

__all__ = [
    "BenchConfig",
    "BenchError",
    "BenchResult",
    "build_parser",
    "format_table",
    "main",
    "parse_args",
    "run_bench",
    "run_rounds",
]
