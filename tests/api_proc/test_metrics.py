"""The API's Prometheus metrics that come from the engines' stats."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from api_proc.metrics import Metrics
from shared.messages import ITERATION_TOKENS_BUCKETS, EngineStats


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
    engines = [EngineStats(2, 3, 100, 25, 0, num_preemptions=4, rss_bytes=5 << 20,
                           cuda_graph_bytes=3 << 20, num_forward_steps=10, num_graph_steps=7),
               EngineStats(1, 1, 100, 75, 0, num_preemptions=1, rss_bytes=7 << 20,
                           cuda_graph_bytes=1 << 20, num_forward_steps=5)]
    metrics = Metrics(num_waiting=lambda: 0, num_running=lambda: 0, mm_inflight_bytes=lambda: 0,
                      mm_inflight_budget=1, engine_stats=lambda: engines, model_name="m")
    text = metrics.render().decode()
    assert 'vllm:num_requests_running{model_name="m"} 4.0' in text
    assert 'vllm:num_requests_waiting{model_name="m"} 3.0' in text
    assert 'vllm:kv_cache_usage_perc{model_name="m"} 0.5' in text  # 100 of 200 blocks used
    assert 'vllm:num_preemptions_total{model_name="m"} 5.0' in text
    assert 'flatserve_process_rss_bytes{process="engine 1"} 7.340032e+06' in text
    assert 'flatserve_process_rss_bytes{process="api"}' in text
    assert "flatserve_cuda_graph_bytes 4.194304e+06" in text
    assert "flatserve_forward_steps_total 15.0" in text
    assert "flatserve_cuda_graph_steps_total 7.0" in text


def families(metrics: Metrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def test_tokens_per_step_waiting_reasons_and_cache_settings_as_vllm_exports_them():
    zeros = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    engines = [
        EngineStats(3, 1, 100, 60, 0, num_waiting_deferred=1,
                    iteration_tokens_counts=[2, 0, 1] + zeros[3:], iteration_tokens_sum=14,
                    block_size=16, enable_prefix_caching=True, gpu_memory_utilization=0.9),
        None,  # an engine that has not answered yet
        EngineStats(1, 0, 50, 50, 0, iteration_tokens_counts=zeros[:-1] + [1],
                    iteration_tokens_sum=20000, block_size=32),
    ]
    metrics = Metrics(num_waiting=lambda: 0, num_running=lambda: 0, mm_inflight_bytes=lambda: 0,
                      mm_inflight_budget=1, engine_stats=lambda: engines, model_name="m")
    found = families(metrics)

    waiting = found["vllm:num_requests_waiting_by_reason"]
    assert waiting.type == "gauge"
    assert {s.labels["reason"]: s.value for s in waiting.samples} == {"capacity": 3,
                                                                      "deferred": 1}
    assert {s.labels["model_name"] for s in waiting.samples} == {"m"}

    steps = found["vllm:iteration_tokens_total"]
    assert steps.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in steps.samples if s.name.endswith("_bucket")}
    # vLLM's buckets, cumulative over both engines
    assert list(buckets) == ["1.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0", "512.0",
                             "1024.0", "2048.0", "4096.0", "8192.0", "16384.0", "+Inf"]
    assert (buckets["1.0"], buckets["8.0"], buckets["16.0"], buckets["16384.0"],
            buckets["+Inf"]) == (2, 2, 3, 3, 4)
    totals = {s.name: s.value for s in steps.samples if not s.name.endswith("_bucket")}
    assert totals == {"vllm:iteration_tokens_total_count": 4,
                      "vllm:iteration_tokens_total_sum": 20014}

    info = found["vllm:cache_config_info"]
    assert info.type == "gauge"
    assert [s.labels for s in info.samples] == [
        {"engine": "0", "block_size": "16", "cache_dtype": "auto",
         "enable_prefix_caching": "True", "gpu_memory_utilization": "0.9",
         "num_gpu_blocks": "100", "kv_cache_size_tokens": "1600"},
        {"engine": "2", "block_size": "32", "cache_dtype": "auto",
         "enable_prefix_caching": "False", "gpu_memory_utilization": "None",
         "num_gpu_blocks": "50", "kv_cache_size_tokens": "1600"},
    ]
    assert [s.value for s in info.samples] == [1, 1]
