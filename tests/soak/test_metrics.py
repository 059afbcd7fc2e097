from flatserve.soak.metrics import parse_mm_metrics

TEXT = """# HELP flatserve_mm_inflight_bytes Multimodal bytes being prepared.
# TYPE flatserve_mm_inflight_bytes gauge
flatserve_mm_inflight_bytes{engine="0"} 1024.0
flatserve_mm_inflight_bytes{engine="1"} 2048.0
# HELP flatserve_mm_inflight_budget_bytes The budget.
# TYPE flatserve_mm_inflight_budget_bytes gauge
flatserve_mm_inflight_budget_bytes 4096.0
# TYPE other_total counter
other_total 3.0
"""


def test_gauge_summed_over_labels_and_budget_found():
    metrics = parse_mm_metrics(TEXT)
    assert metrics.inflight_bytes == 3072.0
    assert metrics.budget_bytes == 4096.0


def test_zero_is_a_value_not_absent():
    assert parse_mm_metrics("api_mm_inflight_bytes 0\n").inflight_bytes == 0.0


def test_absent_or_garbage():
    assert parse_mm_metrics("other 1\n").inflight_bytes is None
    assert parse_mm_metrics("}{ not prometheus").inflight_bytes is None


def test_memory_plan_totals_by_process():
    from flatserve.soak.metrics import parse_plan_totals

    text = TEXT + """# TYPE flatserve_memory_plan_total_bytes gauge
flatserve_memory_plan_total_bytes{process="api"} 1048576.0
flatserve_memory_plan_total_bytes{process="engine 0"} 2097152.0
# TYPE flatserve_memory_plan_bytes gauge
flatserve_memory_plan_bytes{part="runtime",process="api"} 1048576.0
"""
    assert parse_plan_totals(text) == {"api": 1 << 20, "engine 0": 2 << 20}
    assert parse_plan_totals(TEXT) == {}
    assert parse_plan_totals("garbage {{") == {}
