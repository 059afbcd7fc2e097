"""From per-request results to the run's figures: latency percentiles and throughput."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from flatserve.bench.request import RequestResult

PERCENTILES = (50, 90, 99)


def latency_stats(seconds: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 and max in milliseconds (all None when there are no values)."""
    if not seconds:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    ms = np.asarray(seconds) * 1000.0
    return {"mean": float(ms.mean()),
            **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES},
            "max": float(ms.max())}


@dataclass
class BenchResult:
    label: str | None
    completed: int  # measured requests that ended with [DONE]
    errors: int
    duration_s: float  # first measured send to last measured finish
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float | None  # None: the server sent no prompt token counts
    output_tokens: int
    prompt_tokens: int | None
    ttft_ms: dict
    ttft_first_turn_ms: dict | None  # multi-turn runs: TTFT of first turns, of later ones
    ttft_later_turns_ms: dict | None
    tpot_ms: dict
    itl_ms: dict
    e2e_ms: dict
    health_ms: dict
    health_path: str
    health_errors: int
    # what TTFT, ITL and TPOT time: "token" (every chunk carried its token count), "chunk"
    # (none did: per content chunk, which may carry several tokens or stand for none), "mixed"
    latency_unit: str = "token"
    error_kinds: dict[str, int] = field(default_factory=dict)
    first_error: str | None = None
    settings: dict = field(default_factory=dict)
    # CPU time per output token of a server on this machine (server_cpu.py): "api" (the
    # process on its port), "others" (those under it); None when it could not be read
    server_cpu_us_per_token: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(results: list[RequestResult], health_latencies_s: list[float], health_path: str,
              health_errors: int = 0, label: str | None = None,
              settings: dict | None = None) -> BenchResult:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    duration = (max(r.ended_at for r in results) - min(r.sent_at for r in results)
                if results else 0.0)
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_counts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    prompt_tokens = sum(prompt_counts) if prompt_counts else None

    multi_turn = any(r.turn for r in results)
    first = [r.ttft_s for r in ok if r.ttft_s is not None and r.turn == 0]
    later = [r.ttft_s for r in ok if r.ttft_s is not None and r.turn > 0]

    def per_s(count: float) -> float:
        return count / duration if duration > 0 else 0.0

    per_token = {r.per_token for r in ok}
    unit = "mixed" if len(per_token) > 1 else "chunk" if per_token == {False} else "token"
    return BenchResult(
        label=label,
        completed=len(ok),
        errors=len(failed),
        duration_s=duration,
        requests_per_s=per_s(len(ok)),
        output_tokens_per_s=per_s(output_tokens),
        total_tokens_per_s=None if prompt_tokens is None else per_s(prompt_tokens + output_tokens),
        output_tokens=output_tokens,
        prompt_tokens=prompt_tokens,
        ttft_ms=latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        ttft_first_turn_ms=latency_stats(first) if multi_turn else None,
        ttft_later_turns_ms=latency_stats(later) if multi_turn else None,
        tpot_ms=latency_stats([t for r in ok if (t := r.tpot_s) is not None]),
        itl_ms=latency_stats([gap for r in ok for gap in r.itl_s]),
        e2e_ms=latency_stats([r.e2e_s for r in ok]),
        health_ms=latency_stats(health_latencies_s),
        health_path=health_path,
        health_errors=health_errors,
        latency_unit=unit,
        error_kinds=dict(Counter(r.error_kind for r in failed)),
        first_error=min(failed, key=lambda r: r.ended_at).error if failed else None,
        settings=settings or {},
    )
