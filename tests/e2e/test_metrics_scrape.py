"""A scrape of a real server's /metrics under load: vLLM's names with sane values, and the
RSS of every process."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "flatserve-tiny-qwen2.5-vl"


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def scrape(server) -> dict:
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_a_scrape_under_load_carries_vllm_names(server, oai):
    def ask(i: int) -> None:
        oai.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                    messages=[{"role": "user", "content": f"count {i}"}],
                                    extra_body={"ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        busy = pool.submit(lambda: list(pool.map(ask, range(12))))
        during = scrape(server)  # while requests run
        busy.result()
    after = scrape(server)
    m = {"model_name": MODEL}
    assert value(during, "vllm:kv_cache_usage_perc", **m) >= 0
    assert value(after, "vllm:generation_tokens_total", **m) >= 12 * 8
    assert value(after, "vllm:request_success_total", **m, finished_reason="length") >= 12
    assert value(after, "vllm:e2e_request_latency_seconds_count", **m) >= 12
    assert value(after, "vllm:request_queue_time_seconds_count", **m) >= 12
    assert 0 < value(after, "vllm:time_to_first_token_seconds_sum", **m) \
        < value(after, "vllm:e2e_request_latency_seconds_sum", **m)
    assert value(after, "vllm:num_requests_running", **m) == 0
    assert value(after, "vllm:kv_cache_usage_perc", **m) <= 1
    for process in ("api", "engine 0"):
        assert value(after, "flatserve_process_rss_bytes", process=process) > 10 << 20


def test_the_grafana_dashboard_queries_only_metrics_the_server_exports(server):
    import json
    import re
    from pathlib import Path

    dashboard = json.loads(Path("examples/grafana/flatserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"(?:vllm:|flatserve_)[a-z0-9_:]+", e)}
    exported = {name for name, _ in scrape(server)}
    assert used and used <= exported, used - exported
