"""Soak outputs: one CSV row per sample, a PNG plot of RSS over requests, a JSON summary."""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

from flatserve.soak.sampler import Sample
from flatserve.soak.summary import ProcessSummary, Summary


def _slug(role: str) -> str:
    return re.sub(r"[^0-9A-Za-z]+", "_", role).strip("_")


def roles_of(samples: list[Sample]) -> list[str]:
    roles: dict[str, None] = {}
    for sample in samples:
        roles.update(dict.fromkeys(sample.rss_mb))
    return list(roles)


def write_csv(path: Path, samples: list[Sample]) -> None:
    roles = roles_of(samples)
    header = ["time_s", "phase", "requests", "in_flight", "mm_inflight_mb"]
    for role in roles:
        header += [f"{_slug(role)}.rss_mb", f"{_slug(role)}.uss_mb"]

    def cell(value: float | None) -> str:
        return "" if value is None else f"{value:.3f}"

    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for s in samples:
            row = [f"{s.time_s:.3f}", s.phase, s.requests, s.in_flight, cell(s.mm_inflight_mb)]
            for role in roles:
                row += [cell(s.rss_mb.get(role)), cell(s.uss_mb.get(role))]
            writer.writerow(row)


def write_json(path: str | Path, summary: Summary) -> None:
    text = json.dumps(summary.to_dict(), indent=2, default=str)
    if str(path) == "-":
        sys.stdout.write(text + "\n")
    else:
        Path(path).write_text(text + "\n")


def _plot_plans(ax, samples: list[Sample], summary: Summary, colors: dict[str, str]) -> None:
    for p in summary.processes:
        color = colors.get(p.role)
        points = [(s.requests, s.rss_mb[p.role]) for s in samples if p.role in s.rss_mb]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, linewidth=1, color=color, label=f"{p.role} RSS")
        if p.plan_mb is not None:
            ax.axhline(p.plan_mb, color=color, linestyle="-", linewidth=2, alpha=0.6,
                       label=f"{p.role} plan {p.plan_mb:,.0f} MB")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("RSS and plan (MB)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="best")


def _stderr(p: ProcessSummary) -> str:
    se = p.slope_stderr_mb_per_1k
    return "" if se is None else f" ± {se:.2f}"


def write_plot(path: Path, samples: list[Sample], summary: Summary) -> None:
    """RSS of each process over requests finished (fit lines dashed, warm-up dotted, the API's
    idle RSS plus the in-flight budget as a line); above it, when the server has a memory
    plan, each process's RSS against its plan drawn as a line of its colour (on a scale from
    zero, where the plan fits); the in-flight multimodal MB below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_mm = any(s.mm_inflight_mb is not None for s in samples)
    has_plan = any(p.plan_mb is not None for p in summary.processes)
    ratios = [2] * has_plan + [3] + [1] * has_mm
    fig, axes = plt.subplots(len(ratios), 1, figsize=(10, 3 + 2.5 * len(ratios)),
                             sharex=True, squeeze=False, height_ratios=ratios)
    ax = axes[1 if has_plan else 0][0]
    colors: dict[str, str] = {}
    for p in summary.processes:
        points = [(s.requests, s.rss_mb[p.role]) for s in samples if p.role in s.rss_mb]
        if not points:
            continue
        xs, ys = zip(*points, strict=True)
        (line,) = ax.plot(xs, ys, marker=".", markersize=3, linewidth=1,
                          label=f"{p.role} (pid {p.pid})")
        colors[p.role] = line.get_color()
        if p.slope_mb_per_1k is not None and p.warm_mb is not None:
            x0, x1 = summary.warmup_requests, max(xs)
            fit = [(s.requests, s.rss_mb[p.role]) for s in samples
                   if s.phase == "load" and p.role in s.rss_mb and s.requests >= x0]
            mean_x = sum(x for x, _ in fit) / len(fit)
            mean_y = sum(y for _, y in fit) / len(fit)
            k = p.slope_mb_per_1k / 1000.0
            ax.plot([x0, x1], [mean_y + k * (x0 - mean_x), mean_y + k * (x1 - mean_x)],
                    linestyle="--", color=line.get_color(), linewidth=1,
                    label=f"{p.role} fit {p.slope_mb_per_1k:+.2f}{_stderr(p)} MB/1k")
    if has_plan:
        _plot_plans(axes[0][0], samples, summary, colors)
    api = next((p for p in summary.processes if p.role == "api"),
               summary.processes[0] if summary.processes else None)
    if summary.budget_mb is not None and api is not None and api.idle_mb is not None:
        ax.axhline(api.idle_mb + summary.budget_mb, color="red", linestyle="-.", linewidth=1,
                   label=f"{api.role} idle + mm budget ({summary.budget_mb:.0f} MB)")
    if summary.warmup_requests:
        for row in axes:
            row[0].axvline(summary.warmup_requests, color="gray", linestyle=":", linewidth=1)
    verdict = "PASSED" if summary.passed else "FAILED"
    cfg = summary.config
    axes[0][0].set_title(f"RSS soak {verdict}: {summary.requests} requests, "
                         f"c={cfg.get('concurrency')}, {cfg.get('image_size')}px "
                         f"{'video ' if cfg.get('workload') == 'video' else ''}"
                         f"x{cfg.get('images_per_request')}, max {summary.max_slope:g} MB/1k")
    ax.set_ylabel("RSS (MB)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="best")
    if has_mm:
        mm = axes[-1][0]
        points = [(s.requests, s.mm_inflight_mb) for s in samples if s.mm_inflight_mb is not None]
        xs, ys = zip(*points, strict=True)
        mm.plot(xs, ys, linewidth=1, color="tab:purple", label="in-flight multimodal")
        if summary.budget_mb is not None:
            mm.axhline(summary.budget_mb, color="red", linestyle="-.", linewidth=1, label="budget")
        mm.set_ylabel("in-flight MB")
        mm.grid(True, alpha=0.3)
        mm.legend(fontsize="small", loc="best")
    axes[-1][0].set_xlabel("requests finished")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
