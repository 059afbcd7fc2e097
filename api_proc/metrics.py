"""Prometheus metrics of the API process, in a registry of its own (one per app)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

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
from prometheus_client.registry import Collector

from shared.messages import EngineStats

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, *, num_waiting: Callable[[], float], num_running: Callable[[], float],
                 mm_inflight_bytes: Callable[[], float], mm_inflight_budget: int,
                 engine_stats: Callable[[], Iterable[EngineStats | None]]):
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
        r.register(EngineCacheCollector(engine_stats))

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCacheCollector(Collector):
    """The engines' prefix-cache and encoder-cache figures, summed at each scrape from the
    stats they send with every step. A custom collector, not prometheus_client Counters: the engines keep
    the cumulative values and a Counter can only be incremented, so mirroring them would
    mean tracking per-engine deltas here; a collector reports them as counters (`_total`)
    as they are."""

    def __init__(self, engine_stats: Callable[[], Iterable[EngineStats | None]]):
        self.engine_stats = engine_stats

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        stats = [s for s in self.engine_stats() if s is not None]
        yield CounterMetricFamily(
            "flatserve_prefix_cache_queries",
            "Prompt tokens looked up in the engines' prefix caches at admission",
            value=sum(s.prefix_cache_queries for s in stats))
        yield CounterMetricFamily(
            "flatserve_prefix_cache_hits",
            "Prompt tokens found in the engines' prefix caches at admission (not computed)",
            value=sum(s.prefix_cache_hits for s in stats))
        yield GaugeMetricFamily(
            "flatserve_encoder_cache_bytes",
            "Bytes of vision embeddings in the engines' encoder caches",
            value=sum(s.encoder_cache_bytes for s in stats))
        yield GaugeMetricFamily(
            "flatserve_encoder_cache_entries", "Images in the engines' encoder caches",
            value=sum(s.encoder_cache_entries for s in stats))
        yield CounterMetricFamily(
            "flatserve_encoder_cache_queries", "Images looked up in the engines' encoder caches",
            value=sum(s.encoder_cache_queries for s in stats))
        yield CounterMetricFamily(
            "flatserve_encoder_cache_hits", "Images whose embeddings came from an encoder cache",
            value=sum(s.encoder_cache_hits for s in stats))
