"""A scrape of a real server's /metrics under load: vLLM's names with sane values, and the
RSS of every process."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.test_openai_parity import _data_url, _image

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


def wait_idle(server) -> dict:
    """A scrape once the engines run and queue nothing (an earlier test's aborted streams
    may still be leaving)."""
    m = {"model_name": MODEL}
    for _ in range(100):
        samples = scrape(server)
        if value(samples, "vllm:num_requests_running", **m) == 0 \
                and value(samples, "vllm:num_requests_waiting", **m) == 0:
            return samples
        time.sleep(0.1)
    raise AssertionError("the server did not go idle")


def test_tokens_per_step_waiting_reasons_and_cache_settings_as_vllm_counts_them(server, oai):
    """vLLM's test_metrics, text and image: requests one at a time, so each step gives one
    request a token; the first step of each counts its prompt (less what the prefix cache
    held) too."""
    before = wait_idle(server)
    image = {"type": "image_url", "image_url": {"url": _data_url(_image(7, (64, 48)))}}
    contents = [[{"type": "text", "text": f"Tell me about {word}."}] for word in ("ants", "bees")]
    contents.append([image, {"type": "text", "text": "What is in this image?"}])
    usages = [oai.chat.completions.create(model=MODEL, max_tokens=6, temperature=0,
                                          messages=[{"role": "user", "content": content}],
                                          extra_body={"ignore_eos": True}).usage
              for content in contents]
    after = scrape(server)
    text = httpx.get(server.url + "/metrics").text
    for family in ("vllm:iteration_tokens_total", "vllm:num_requests_waiting_by_reason",
                   "vllm:cache_config_info"):
        assert f"# TYPE {family} " in text

    def grew(name: str, **labels) -> float:
        labels["model_name"] = MODEL
        return value(after, name, **labels) - value(before, name, **labels)

    generated = sum(u.completion_tokens for u in usages)
    prompt = sum(u.prompt_tokens for u in usages)
    assert generated == 3 * 6
    assert grew("vllm:iteration_tokens_total_count") == generated
    assert grew("vllm:iteration_tokens_total_bucket", le="+Inf") == generated
    assert grew("vllm:iteration_tokens_total_bucket", le="1.0") == generated - 3  # decodes
    assert grew("vllm:iteration_tokens_total_sum") \
        == prompt - grew("vllm:prefix_cache_hits_total") + generated

    m = {"model_name": MODEL}
    reasons = {r: value(after, "vllm:num_requests_waiting_by_reason", **m, reason=r)
               for r in ("capacity", "deferred")}
    assert reasons == {"capacity": 0, "deferred": 0}
    assert sum(reasons.values()) == value(after, "vllm:num_requests_waiting", **m)

    (info,) = [dict(labels) for name, labels in after if name == "vllm:cache_config_info"]
    assert (info["engine"], info["block_size"], info["cache_dtype"],
            info["enable_prefix_caching"], info["gpu_memory_utilization"]) \
        == ("0", "16", "auto", "True", "None")
    assert int(info["kv_cache_size_tokens"]) == 16 * int(info["num_gpu_blocks"]) > 0
    assert value(after, "vllm:cache_config_info", **info) == 1


def test_the_grafana_dashboard_queries_only_metrics_the_server_exports(server):
    import json
    import re
    from pathlib import Path

    dashboard = json.loads(Path("examples/grafana/flatserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"(?:vllm:|flatserve_)[a-z0-9_:]+", e)}
    exported = {name for name, _ in scrape(server)}
    assert used and used <= exported, used - exported
