"""From samples to verdict: per-process RSS figures, the post-warm-up slope, pass or fail."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

import numpy as np

from flatserve.soak.load import LoadStats
from flatserve.soak.sampler import Sample

MIN_FIT_SAMPLES = 3


@dataclass
class ProcessSummary:
    role: str
    pid: int
    idle_mb: float | None
    warm_mb: float | None  # first sample after the warm-up
    peak_mb: float | None
    final_mb: float | None
    slope_mb_per_1k: float | None  # None: too few samples after the warm-up to fit
    slope_stderr_mb_per_1k: float | None = None  # the slope's standard error (see slope_stderr)
    peak_uss_mb: float | None = None
    plan_mb: float | None = None  # the server's memory plan for this process (its /metrics)
    exited: bool = False
    passed: bool = True


@dataclass
class Summary:
    processes: list[ProcessSummary]
    requests: int  # finished, whatever the outcome
    ok: int
    errors: int
    disconnects: int
    rejected: int
    passed: bool
    reasons: list[str]  # why it failed; empty when it passed
    max_slope: float
    warmup_requests: int
    duration_s: float
    requests_per_s: float
    mm_inflight_peak_mb: float | None = None
    budget_mb: float | None = None
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    error_messages: list[str] = field(default_factory=list)
    stop_reason: str | None = None
    interrupted: bool = False
    config: dict = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def process(self, role: str) -> ProcessSummary:
        return next(p for p in self.processes if p.role == role)


def _centred(requests: list[float], rss_mb: list[float]) -> tuple[np.ndarray, np.ndarray, float]:
    """(requests - mean, RSS - mean, sum of squared request deviations)."""
    x = np.asarray(requests, dtype=float)
    y = np.asarray(rss_mb, dtype=float)
    if x.shape != y.shape:
        raise ValueError("requests and rss_mb differ in length")
    dx = x - x.mean() if x.size else x
    dy = y - y.mean() if y.size else y
    return dx, dy, float(dx @ dx)


def fit_slope(requests: list[float], rss_mb: list[float]) -> float | None:
    """Least-squares slope of RSS (MB) over requests finished, in MB per 1,000 requests;
    None with fewer than two distinct request counts."""
    dx, dy, sxx = _centred(requests, rss_mb)
    if sxx == 0:
        return None
    return float(dx @ dy) / sxx * 1000.0


def slope_stderr(requests: list[float], rss_mb: list[float]) -> float | None:
    """Standard error of `fit_slope`'s slope, MB per 1,000 requests; None with fewer than
    four samples or no spread in requests.

    RSS sampled faster than the per-request working set turns over is not independent
    noise around the line, so the least-squares error is widened by sqrt((1 + r) / (1 - r)),
    r the lag-1 autocorrelation of the residuals (an AR(1) allowance; r < 0 counts as 0).
    A slope within about two of these of zero is not evidence of growth."""
    dx, dy, sxx = _centred(requests, rss_mb)
    if dx.size < 4 or sxx == 0:
        return None
    residuals = dy - (float(dx @ dy) / sxx) * dx
    ss = float(residuals @ residuals)
    if ss == 0:
        return 0.0
    r = min(max(float(residuals[1:] @ residuals[:-1]) / ss, 0.0), 0.99)
    return math.sqrt(ss / (dx.size - 2) / sxx * (1 + r) / (1 - r)) * 1000.0


def warmup_requests(total_requests: int, warmup_share: float) -> int:
    return math.ceil(total_requests * warmup_share)


def summarize_process(role: str, pid: int, samples: list[Sample], warmup: int,
                      exited: bool = False) -> ProcessSummary:
    """Figures for one process. The slope is fitted on load samples at or after `warmup`
    requests finished: idle and after-load samples sit at other in-flight levels."""
    values = [(s, s.rss_mb[role]) for s in samples if role in s.rss_mb]
    idle = [v for s, v in values if s.phase == "idle"]
    fit = [(s.requests, v) for s, v in values if s.phase == "load" and s.requests >= warmup]
    final = [v for s, v in values if s.phase == "final"] or [v for _, v in values[-1:]]
    uss = [s.uss_mb[role] for s in samples if role in s.uss_mb]
    slope = stderr = None
    if len(fit) >= MIN_FIT_SAMPLES:
        xs, ys = [float(x) for x, _ in fit], [y for _, y in fit]
        slope, stderr = fit_slope(xs, ys), slope_stderr(xs, ys)
    return ProcessSummary(
        role=role,
        pid=pid,
        idle_mb=statistics.median(idle) if idle else None,
        warm_mb=fit[0][1] if fit else None,
        peak_mb=max(v for _, v in values) if values else None,
        final_mb=final[-1] if final else None,
        slope_mb_per_1k=slope,
        slope_stderr_mb_per_1k=stderr,
        peak_uss_mb=max(uss) if uss else None,
        exited=exited,
    )


def summarize(
    samples: list[Sample],
    processes: list[tuple[str, int, bool]],  # (role, pid, exited)
    stats: LoadStats,
    max_slope: float,
    warmup_share: float,
    budget_mb: float | None = None,
    interrupted: bool = False,
    config: dict | None = None,
    plans_mb: dict[str, float] | None = None,
) -> Summary:
    """`plans_mb`: each process's memory plan by role; a process whose peak RSS goes above
    its plan fails."""
    warmup = warmup_requests(stats.finished, warmup_share)
    reasons: list[str] = []
    summaries = []
    for role, pid, exited in processes:
        summary = summarize_process(role, pid, samples, warmup, exited)
        summary.plan_mb = (plans_mb or {}).get(role)
        if summary.plan_mb is not None and summary.peak_mb is not None \
                and summary.peak_mb > summary.plan_mb:
            reasons.append(f"{role}: peak RSS {summary.peak_mb:.1f} MB is above its memory plan "
                           f"{summary.plan_mb:.1f} MB")
            summary.passed = False
        if exited:
            reasons.append(f"{role} (pid {pid}) exited during the run")
            summary.passed = False
        if summary.slope_mb_per_1k is None:
            reasons.append(f"{role}: fewer than {MIN_FIT_SAMPLES} RSS samples after the warm-up "
                           "to fit a slope (send more requests or lower --interval)")
            summary.passed = False
        elif summary.slope_mb_per_1k > max_slope:
            reasons.append(f"{role}: RSS grows {summary.slope_mb_per_1k:.2f} MB per 1,000 "
                           f"requests (limit {max_slope:g})")
            summary.passed = False
        summaries.append(summary)
    if not processes:
        reasons.append("no process was sampled")
    if stats.errors:
        reasons.append(f"{stats.errors} requests failed unexpectedly")
    if stats.stop_reason:
        reasons.append(f"load stopped early: {stats.stop_reason}")
    if interrupted:
        reasons.append("interrupted")
    mm = [s.mm_inflight_mb for s in samples if s.mm_inflight_mb is not None]
    duration = stats.duration_s
    return Summary(
        processes=summaries,
        requests=stats.finished,
        ok=stats.ok,
        errors=stats.errors,
        disconnects=stats.disconnects,
        rejected=stats.rejected,
        passed=not reasons,
        reasons=reasons,
        max_slope=max_slope,
        warmup_requests=warmup,
        duration_s=duration,
        requests_per_s=stats.finished / duration if duration > 0 else 0.0,
        mm_inflight_peak_mb=max(mm) if mm else None,
        budget_mb=budget_mb,
        errors_by_kind=dict(stats.errors_by_kind),
        error_messages=list(stats.error_messages),
        stop_reason=stats.stop_reason,
        interrupted=interrupted,
        config=dict(config or {}),
    )


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(summary: Summary) -> str:
    header = ("process", "pid", "idle MB", "warm MB", "peak MB", "plan MB", "final MB",
              "MB/1k req", "± se", "result")
    rows = [header]
    for p in summary.processes:
        slope = "-" if p.slope_mb_per_1k is None else f"{p.slope_mb_per_1k:+.2f}"
        stderr = "-" if p.slope_stderr_mb_per_1k is None else f"{p.slope_stderr_mb_per_1k:.2f}"
        result = "ok" if p.passed else ("EXITED" if p.exited else "FAIL")
        rows.append((p.role, str(p.pid), _mb(p.idle_mb), _mb(p.warm_mb), _mb(p.peak_mb),
                     _mb(p.plan_mb), _mb(p.final_mb), slope, stderr, result))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    s = summary
    lines.append("")
    lines.append(f"requests {s.requests} (ok {s.ok}, disconnected {s.disconnects}, "
                 f"rejected {s.rejected}), errors {s.errors}; "
                 f"{s.requests_per_s:.2f} req/s over {s.duration_s:.1f} s")
    lines.append(f"slope fitted after the first {s.warmup_requests} requests; "
                 f"limit {s.max_slope:g} MB per 1,000 requests; se: the slope's standard "
                 "error (sampling noise)")
    if any(p.plan_mb is not None for p in s.processes):
        lines.append("plan: the server's memory plan for the process (its RSS ceiling); a peak "
                     "above it fails")
    if s.mm_inflight_peak_mb is not None or s.budget_mb is not None:
        budget = "" if s.budget_mb is None else f" (budget {s.budget_mb:.1f} MB)"
        lines.append(f"in-flight multimodal peak {_mb(s.mm_inflight_peak_mb)} MB{budget}")
    for kind, count in sorted(s.errors_by_kind.items()):
        lines.append(f"  errors {kind}: {count}")
    for message in s.error_messages:
        lines.append(f"  {message}")
    lines.append("PASSED" if s.passed else "FAILED: " + "; ".join(s.reasons))
    return "\n".join(lines)
