"""`flatserve run-batch`'s own flags (vLLM's names), apart from the command itself so that
building the CLI's parser imports nothing of the HTTP side."""

from __future__ import annotations

import argparse


def add_run_batch_args(parser: argparse.ArgumentParser) -> None:
    """run-batch's own flags, vLLM's names; the parser already has serve's."""
    group = parser.add_argument_group("run-batch")
    group.add_argument("-i", "--input-file", required=True,
                       help="the batch: a local JSONL file (a named pipe too) or an http(s) URL "
                       "read with GET; one request a line")
    group.add_argument("-o", "--output-file", required=True,
                       help="the results, one line per request in input order: a local file or "
                       "an http(s) URL written with PUT when the batch ends")
    group.add_argument("--output-tmp-dir", default=None,
                       help="with an http(s) --output-file: the folder of the local file the "
                       "results are written to before the upload (unset: the system's "
                       "temporary folder)")
    group.add_argument("--enable-metrics", action="store_true",
                       help="serve Prometheus metrics (the server's /metrics) on --url and "
                       "--port while the batch runs")
    group.add_argument("--url", default="127.0.0.1",
                       help="the address of the metrics server (--port: its port); vLLM's "
                       "default is 0.0.0.0")
    group.add_argument("--max-in-flight", type=int, default=0,
                       help="most requests running at once (twice as many lines are read "
                       "ahead at most); 0: 2 x --max-num-seqs per engine, as vLLM")
