"""The API's Prometheus metrics that come from the engines' stats."""

from __future__ import annotations

from api_proc.metrics import Metrics
from shared.messages import EngineStats


def test_prefix_cache_counters_sum_the_engines_latest_stats():
    engines = [EngineStats(0, 0, 8, 8, 0, prefix_cache_queries=100, prefix_cache_hits=48),
               None,  # an engine that has not answered yet
               EngineStats(0, 0, 8, 8, 0, prefix_cache_queries=20, prefix_cache_hits=16)]
    metrics = Metrics(num_waiting=lambda: 0, num_running=lambda: 0, mm_inflight_bytes=lambda: 0,
                      mm_inflight_budget=1, engine_stats=lambda: engines)
    text = metrics.render().decode()
    assert "# TYPE flatserve_prefix_cache_queries_total counter" in text
    assert "flatserve_prefix_cache_queries_total 120.0" in text
    assert "flatserve_prefix_cache_hits_total 64.0" in text
    engines[1] = EngineStats(0, 0, 8, 8, 0, prefix_cache_queries=5, prefix_cache_hits=0)
    assert "flatserve_prefix_cache_queries_total 125.0" in metrics.render().decode()
