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
    assert "# TYPE vllm:prefix_cache_queries_total counter" in text
    assert 'vllm:prefix_cache_queries_total{model_name="flatserve"} 120.0' in text
    assert 'vllm:prefix_cache_hits_total{model_name="flatserve"} 64.0' in text
    engines[1] = EngineStats(0, 0, 8, 8, 0, prefix_cache_queries=5, prefix_cache_hits=0)
    assert 'vllm:prefix_cache_queries_total{model_name="flatserve"} 125.0' in metrics.render().decode()


def test_engine_figures_kv_usage_preemptions_and_rss_per_process():
    engines = [EngineStats(2, 3, 100, 25, 0, num_preemptions=4, rss_bytes=5 << 20),
               EngineStats(1, 1, 100, 75, 0, num_preemptions=1, rss_bytes=7 << 20)]
    metrics = Metrics(num_waiting=lambda: 0, num_running=lambda: 0, mm_inflight_bytes=lambda: 0,
                      mm_inflight_budget=1, engine_stats=lambda: engines, model_name="m")
    text = metrics.render().decode()
    assert 'vllm:num_requests_running{model_name="m"} 4.0' in text
    assert 'vllm:num_requests_waiting{model_name="m"} 3.0' in text
    assert 'vllm:kv_cache_usage_perc{model_name="m"} 0.5' in text  # 100 of 200 blocks used
    assert 'vllm:num_preemptions_total{model_name="m"} 5.0' in text
    assert 'flatserve_process_rss_bytes{process="engine 1"} 7.340032e+06' in text
    assert 'flatserve_process_rss_bytes{process="api"}' in text
