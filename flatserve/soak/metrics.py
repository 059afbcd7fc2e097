"""Reading the server's in-flight multimodal bytes (and its budget) and each process's memory
plan from GET /metrics.

Metric names are matched by substring so the server's naming can settle: the gauge is the
sample whose name ends with `mm_inflight_bytes` (summed over its label sets), the budget one
whose name contains `mm_inflight_budget`.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

INFLIGHT = "mm_inflight_bytes"
BUDGET = "mm_inflight_budget"


@dataclass(frozen=True)
class MmMetrics:
    inflight_bytes: float | None
    budget_bytes: float | None


def _pick(values: dict[str, float], matches) -> float | None:
    names = sorted((n for n in values if matches(n)), key=len)
    return values[names[0]] if names else None


def parse_mm_metrics(text: str) -> MmMetrics:
    """Prometheus text exposition -> the in-flight multimodal bytes and budget (None: absent)."""
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if "mm_inflight" in sample.name and not sample.name.endswith("_created"):
                    totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    except ValueError:  # not the text format; treat as absent
        return MmMetrics(None, None)
    inflight = _pick(totals, lambda n: n.endswith(INFLIGHT))
    if inflight is None:
        inflight = _pick(totals, lambda n: INFLIGHT in n and BUDGET not in n)
    return MmMetrics(inflight, _pick(totals, lambda n: BUDGET in n))


PLAN_TOTAL = "flatserve_memory_plan_total_bytes"


def parse_plan_totals(text: str) -> dict[str, float]:
    """Each process's memory plan in bytes, by its `process` label ("api", "engine 0"), the
    same names the soak gives the processes it samples; empty when the server has none."""
    plans: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == PLAN_TOTAL and "process" in sample.labels:
                    plans[sample.labels["process"]] = float(sample.value)
    except ValueError:
        return {}
    return plans
