"""Prometheus metrics of the API process, in a registry of its own (one per app)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import psutil
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared.messages import EngineStats

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, *, num_waiting: Callable[[], float], num_running: Callable[[], float],
                 mm_inflight_bytes: Callable[[], float], mm_inflight_budget: int,
                 engine_stats: Callable[[], list[EngineStats]] = list):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("flatserve_requests", "Finished HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("flatserve_prompt_tokens", "Prompt tokens of served requests",
                                     registry=r)
        self.completion_tokens = Counter("flatserve_completion_tokens",
                                         "Completion tokens streamed back", registry=r)
        self.ttft = Histogram("flatserve_time_to_first_token_seconds",
                              "Request arrival to first generated token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.num_preparing = Gauge("flatserve_requests_preparing",
                                   "Requests loading media or waiting for admission", registry=r)
        Gauge("flatserve_requests_waiting_admission",
              "Requests waiting for multimodal budget", registry=r).set_function(num_waiting)
        Gauge("flatserve_requests_running", "Requests handed to an engine and not finished",
              registry=r).set_function(num_running)
        Gauge("flatserve_mm_inflight_bytes",
              "Image bytes reserved: bodies, decoding, and pixels not yet prefilled by an engine",
              registry=r).set_function(mm_inflight_bytes)
        Gauge("flatserve_mm_inflight_budget_bytes", "The cap on flatserve_mm_inflight_bytes",
              registry=r).set(mm_inflight_budget)
        process = psutil.Process()
        Gauge("flatserve_process_rss_bytes", "Resident set size of the API process",
              registry=r).set_function(lambda: process.memory_info().rss)
        self.image_bytes_skipped = Counter(
            "flatserve_image_bytes_skipped", "Pixel bytes not sent: the engine's encoder cache "
            "held the image", registry=r)
        self.image_decodes_skipped = Counter(
            "flatserve_image_decodes_skipped", "Images not decoded: the engine's encoder cache "
            "held them", registry=r)
        self.image_resubmits = Counter(
            "flatserve_image_resubmits", "Requests sent again with pixels: the engine had "
            "evicted an image sent without them", registry=r)
        r.register(_EncoderCacheCollector(engine_stats))

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EncoderCacheCollector:
    """The engines' encoder caches, summed over the engines' latest stats."""

    def __init__(self, engine_stats: Callable[[], list[EngineStats]]) -> None:
        self.engine_stats = engine_stats

    def describe(self) -> list:
        return []  # collected on each scrape only

    def collect(self) -> Iterator:
        stats = self.engine_stats()
        def total(name: str) -> int:
            return sum(getattr(s, name) for s in stats)
        yield GaugeMetricFamily("flatserve_encoder_cache_bytes",
                                "Bytes of vision embeddings in the engines' encoder caches",
                                value=total("encoder_cache_bytes"))
        yield GaugeMetricFamily("flatserve_encoder_cache_entries",
                                "Images in the engines' encoder caches",
                                value=total("encoder_cache_entries"))
        yield CounterMetricFamily("flatserve_encoder_cache_queries",
                                  "Images looked up in the engines' encoder caches",
                                  value=total("encoder_cache_queries"))
        yield CounterMetricFamily("flatserve_encoder_cache_hits",
                                  "Images whose embeddings came from an encoder cache",
                                  value=total("encoder_cache_hits"))
