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
