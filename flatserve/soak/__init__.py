"""RSS soak test: load a server with image requests and check that every process stays flat.

    from flatserve.soak import SoakConfig, run_soak
    summary = run_soak(SoakConfig(requests=500, concurrency=8, server_args=("--model", path)))
    assert summary.passed, summary.reasons

`main(argv) -> int` is the command line (`scripts/soak_rss.py`, `flatserve soak`).
"""

from flatserve.soak.config import SoakConfig, build_parser, parse_args
from flatserve.soak.runner import SoakError, main, run_soak
from flatserve.soak.server import ServerStartError
from flatserve.soak.summary import ProcessSummary, Summary, fit_slope, format_table

__all__ = [
    "ProcessSummary",
    "ServerStartError",
    "SoakConfig",
    "SoakError",
    "Summary",
    "build_parser",
    "fit_slope",
    "format_table",
    "main",
    "parse_args",
    "run_soak",
]
