#!/usr/bin/env python
"""Serving benchmark: streamed chat requests against an OpenAI-compatible server (started here,
or attached with --base-url); prints TTFT, TPOT, ITL, end-to-end and /health latency and
throughput.

    python scripts/bench_serve.py --num-requests 200 --concurrency 16 --workload mixed \\
        --image-size 448 -- --model /path/to/qwen2.5-vl --max-num-seqs 64
    python scripts/bench_serve.py --base-url http://127.0.0.1:8000 --request-rate 4 \\
        --ignore-eos --json out/bench.json

See `--help`; the work is done by flatserve.bench.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatserve.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="bench_serve.py"))
