"""Benchmark outputs: the printed table and the JSON file."""

from __future__ import annotations

import json
from pathlib import Path

from flatserve.bench.stats import BenchResult

COLUMNS = ("mean", "p50", "p90", "p99", "max")
NAME_WIDTH = 22


def describe_load(settings: dict) -> str:
    s = settings
    workload = f"{s['workload']} workload"
    if s["workload"] == "multi-turn":
        workload += f" ({s['turns']} turns each)"
    if s["workload"] not in ("image", "video"):
        length = f"prompt {s['prompt_len']} words"
        if s["prompt_len_range"]:
            length += f" ±{s['prompt_len_range']:.0%}"
        workload += ", " + length
    if s["workload"] == "video":
        workload += (f", with {s['images_per_request']}x {s.get('video_frames')}-frame "
                     f"{s['image_size']}px video")
    elif s["workload"] != "text":
        share = f"{s['image_share']:.0%} " if s["workload"] == "mixed" else ""
        workload += (f", {share}with {s['images_per_request']}x "
                     f"{s['image_size']}px image")
    output = f"max_tokens {s['output_len']}"
    if s["output_len_range"]:
        output += f" ±{s['output_len_range']:.0%}"
    if s["request_rate"] is None:
        loop = f"closed loop, concurrency {s['concurrency']}"
    else:
        cap = "no cap" if s["concurrency"] is None else f"at most {s['concurrency']} in flight"
        loop = f"Poisson arrivals at {s['request_rate']:g} req/s, {cap}"
    return f"{workload}, {output}; {loop}"


LATENCY_UNITS = {
    "token": "TTFT, TPOT and ITL per token (usage in every chunk)",
    "chunk": "TTFT and ITL per content chunk: the server sent no per-chunk token counts, and "
             "a token with no text yet is not seen",
    "mixed": "TTFT and ITL per token where chunks carried usage, per content chunk elsewhere",
}


def _row(name: str, stats: dict) -> str:
    cells = "".join("       n/a" if stats[c] is None else f"{stats[c]:10.2f}" for c in COLUMNS)
    return f"{name:<{NAME_WIDTH}}{cells}"


def format_table(result: BenchResult) -> str:
    settings = result.settings
    title = "flatserve bench" + (f": {result.label}" if result.label else "")
    health = f"health {result.health_path}"
    lines = [
        f"{'=' * 8} {title} {'=' * 8}",
        f"model {settings.get('model')!r} at {settings.get('base_url')}",
        describe_load(settings),
        LATENCY_UNITS[result.latency_unit],
        f"{'(ms)':<{NAME_WIDTH}}" + "".join(f"{c:>10}" for c in COLUMNS),
        _row("TTFT", result.ttft_ms),
        *([_row("  TTFT first turn", result.ttft_first_turn_ms),
           _row("  TTFT later turns", result.ttft_later_turns_ms)]
          if result.ttft_later_turns_ms is not None else []),
        _row("TPOT", result.tpot_ms),
        _row("ITL", result.itl_ms),
        _row("e2e latency", result.e2e_ms),
        _row(health, result.health_ms),
    ]
    if result.health_path != "/health":
        lines.append(f"  (the server has no /health: timed GET {result.health_path} instead)")
    if result.health_errors:
        lines.append(f"  ({result.health_errors} health probes failed)")
    lines += [
        f"{'requests/s':<{NAME_WIDTH}}{result.requests_per_s:10.2f}",
        f"{'output tokens/s':<{NAME_WIDTH}}{result.output_tokens_per_s:10.2f}",
    ]
    if result.total_tokens_per_s is not None:
        lines.append(f"{'total tokens/s':<{NAME_WIDTH}}{result.total_tokens_per_s:10.2f}")
    total = result.completed + result.errors
    if (cpu := result.server_cpu_us_per_token) is not None:
        lines.append(f"{'server CPU per token':<{NAME_WIDTH}}{cpu['api']:10.1f} us in the API "
                     f"process, {cpu['others']:.1f} us in the processes under it")
    lines.append(f"{'completed':<{NAME_WIDTH}}{result.completed:10d} of {total} in "
                 f"{result.duration_s:.2f} s, {result.output_tokens} output tokens")
    kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(result.error_kinds.items()))
    lines.append(f"{'errors':<{NAME_WIDTH}}{result.errors:10d}" + (f"  ({kinds})" if kinds else ""))
    if result.first_error:
        lines.append(f"{'first error':<{NAME_WIDTH}}{result.first_error}")
    return "\n".join(lines)


# (row name, how to read it from a result, higher is better)
_COMPARED = (
    ("TTFT p50 (ms)", lambda r: r.ttft_ms["p50"], False),
    ("TTFT p50, first turn", lambda r: (r.ttft_first_turn_ms or {}).get("p50"), False),
    ("TTFT p50, later turns", lambda r: (r.ttft_later_turns_ms or {}).get("p50"), False),
    ("TTFT p99 (ms)", lambda r: r.ttft_ms["p99"], False),
    ("TPOT p50 (ms)", lambda r: r.tpot_ms["p50"], False),
    ("e2e p50 (ms)", lambda r: r.e2e_ms["p50"], False),
    ("requests/s", lambda r: r.requests_per_s, True),
    ("output tokens/s", lambda r: r.output_tokens_per_s, True),
    ("API CPU per token (us)", lambda r: _cpu(r, "api"), False),
    ("others' CPU per token", lambda r: _cpu(r, "others"), False),
)


def _cpu(result: BenchResult, part: str) -> float | None:
    cpu = result.server_cpu_us_per_token
    return None if cpu is None else cpu[part]


def format_comparison(baseline: BenchResult, result: BenchResult) -> str:
    """The two runs side by side, with the factor by which `result` is better (>1) or
    worse (<1) than `baseline` on each figure."""
    width = 26
    lines = [f"{'=' * 8} {baseline.label} vs {result.label} {'=' * 8}",
             f"{'':<{width}}{'baseline':>12}{'this':>12}{'better by':>12}"]
    for name, read, higher_better in _COMPARED:
        a, b = read(baseline), read(result)
        if a is None or b is None:
            continue
        ratio = (b / a if higher_better else a / b) if a and b else float("nan")
        lines.append(f"{name:<{width}}{a:12.2f}{b:12.2f}{ratio:11.2f}x")
    return "\n".join(lines)


# the figures of a comparison over rounds: (row name, how to read it, higher is better)
_ROUND_ROWS = (
    ("requests/s", lambda r: r.requests_per_s, True),
    ("output tokens/s", lambda r: r.output_tokens_per_s, True),
    ("TTFT p50 (ms)", lambda r: r.ttft_ms["p50"], False),
    ("TTFT p90 (ms)", lambda r: r.ttft_ms["p90"], False),
    ("TTFT p99 (ms)", lambda r: r.ttft_ms["p99"], False),
    ("TPOT p50 (ms)", lambda r: r.tpot_ms["p50"], False),
    ("ITL p50 (ms)", lambda r: r.itl_ms["p50"], False),
    ("ITL p99 (ms)", lambda r: r.itl_ms["p99"], False),
    ("e2e p50 (ms)", lambda r: r.e2e_ms["p50"], False),
    ("e2e p99 (ms)", lambda r: r.e2e_ms["p99"], False),
    ("API CPU/token us", lambda r: _cpu(r, "api"), False),
)


def _cells(values: list[float | None]) -> str:
    return ", ".join("n/a" if v is None else f"{v:.2f}" for v in values)


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present and len(present) == len(values) else None


def format_rounds(rounds: list[tuple[BenchResult, BenchResult]]) -> str:
    """Two servers over alternating rounds: each figure per round for each, and the factor by
    which the first is better (>1) or worse (<1) than the second, from the rounds' means."""
    this, peer = rounds[0][0].label, rounds[0][1].label
    width, column = 18, 24
    lines = [f"{'=' * 8} {this} vs {peer}, {len(rounds)} round(s), per round {'=' * 8}",
             f"{'':<{width}}{this:>{column}}{peer:>{column}}{this + ' better by':>22}"]
    for name, read, higher_better in _ROUND_ROWS:
        a = [read(r[0]) for r in rounds]
        b = [read(r[1]) for r in rounds]
        ma, mb = _mean(a), _mean(b)
        if ma is None or mb is None or not ma or not mb:
            ratio = "n/a"
        else:
            ratio = f"{(ma / mb if higher_better else mb / ma):.2f}x"
        lines.append(f"{name:<{width}}{_cells(a):>{column}}{_cells(b):>{column}}{ratio:>22}")
    units = {r.latency_unit for pair in rounds for r in pair}
    if len(units) > 1:
        lines.append(f"latencies per: {this} {rounds[0][0].latency_unit}, "
                     f"{peer} {rounds[0][1].latency_unit} (their ratios compare unlike units)")
    errors = [f"{r[0].errors}/{r[1].errors}" for r in rounds]
    lines.append(f"{'errors':<{width}}{'  (' + ', '.join(errors) + ' per round)':>{column}}")
    return "\n".join(lines)


def write_rounds_json(path: str | Path, rounds: list[tuple[BenchResult, BenchResult | None]]
                      ) -> None:
    data = {"rounds": [{"seed": this.settings.get("seed"), "this": this.to_dict(),
                        "peer": None if peer is None else peer.to_dict()}
                       for this, peer in rounds]}
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def write_json(path: str | Path, result: BenchResult, baseline: BenchResult | None = None
               ) -> None:
    data = result.to_dict()
    if baseline is not None:
        data["baseline"] = baseline.to_dict()
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
