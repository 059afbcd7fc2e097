"""Prometheus metrics of the API process, in a registry of its own (one per app).

What vLLM measures carries vLLM's names, types, buckets and `model_name` label (`vllm:...`),
so dashboards and alerts written for vLLM work unchanged; what only flatserve has is named
`flatserve_...`: HTTP outcomes, admission of image bytes, the caches, the RSS of every
process and its memory plan (shared/memory_plan.py). Figures the engines keep (running and
waiting requests, KV usage, preemptions, cache counters, tokens per step, their RSS) are read
from the stats each engine sends with every step, summed over engines at each scrape; the
cache settings are labelled per engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from itertools import accumulate

import psutil
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from shared.memory_plan import MemoryPlan
from shared.messages import ITERATION_TOKENS_BUCKETS, EngineStats

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """vLLM's 1, 2, 5, 10, 20, 50, ... buckets up to `limit`."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(buckets)
            buckets.append(float(m * scale))
        scale *= 10


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, *, num_waiting: Callable[[], float], num_running: Callable[[], float],
                 mm_inflight_bytes: Callable[[], float], mm_inflight_budget: int,
                 engine_stats: Callable[[], Iterable[EngineStats | None]],
                 model_name: str = "flatserve", max_model_len: int = 8192,
                 engine_plans: Callable[[], Iterable[MemoryPlan | None]] = tuple):
        self.registry = r = CollectorRegistry()
        label = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(name, doc, label, buckets=buckets, registry=r).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(name, doc, label, registry=r).labels(model_name)

        # ---- vLLM's
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        self._success = Counter("vllm:request_success", "Count of successfully processed "
                                "requests.", ["model_name", "finished_reason"], registry=r)
        self.model_name = model_name
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token = histogram("vllm:inter_token_latency_seconds",
                                     "Histogram of inter-token latency in seconds.",
                                     TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        lengths = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", lengths)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", lengths)
        self.request_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            lengths)
        self.request_n = histogram("vllm:request_params_n",
                                   "Histogram of the n request parameter.",
                                   (1.0, 2.0, 5.0, 10.0, 20.0))
        # ---- flatserve's
        self.requests = Counter("flatserve_requests", "Finished HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
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
        self.image_bytes_skipped = Counter(
            "flatserve_image_bytes_skipped", "Pixel bytes not sent: the engine's encoder cache "
            "held the image", registry=r)
        self.image_decodes_skipped = Counter(
            "flatserve_image_decodes_skipped", "Images not decoded: the engine's encoder cache "
            "held them", registry=r)
        self.image_resubmits = Counter(
            "flatserve_image_resubmits", "Requests sent again with pixels: the engine had "
            "evicted an image sent without them", registry=r)
        self.unknown_keys = Counter(
            "flatserve_unknown_keys_ignored", "Keys inside chat messages, content parts and "
            "their tool calls that the server does not know, ignored as vLLM ignores them",
            ["where"], registry=r)
        self.engine_restarts = Counter(
            "flatserve_engine_restarts", "Engines spawned again after they died", registry=r)
        r.register(EngineStatsCollector(engine_stats, model_name))
        self.api_plan: MemoryPlan | None = None  # set by the launcher once computed
        r.register(MemoryPlanCollector(lambda: self.api_plan, engine_plans))

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def count_unknown_key(self, where: str) -> None:
        """An ignored key inside a message ("message"), a content part ("part") or a tool
        call of a message ("tool_call")."""
        self.unknown_keys.labels(where).inc()

    def count_finished(self, reason: str) -> None:
        """A request that ended without an error ("stop", "length", "abort", ...)."""
        self._success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineStatsCollector(Collector):
    """What the engines keep, summed at each scrape from the stats they send with every step.
    A custom collector, not prometheus_client Counters: the engines keep the cumulative
    values and a Counter can only be incremented, so mirroring them would mean tracking
    per-engine deltas here; a collector reports them as they are."""

    def __init__(self, engine_stats: Callable[[], Iterable[EngineStats | None]],
                 model_name: str):
        self.engine_stats = engine_stats
        self.model_name = model_name
        self.process = psutil.Process()

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        all_stats = list(self.engine_stats())
        stats = [s for s in all_stats if s is not None]

        def total(name: str) -> int:
            return sum(getattr(s, name) for s in stats)

        def vllm(cls, name: str, doc: str, value: float):
            family = cls(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            return family

        blocks = total("num_kv_blocks_total")
        used = blocks - total("num_kv_blocks_free")
        yield vllm(GaugeMetricFamily, "vllm:num_requests_running",
                   "Number of requests in model execution batches.", total("num_running"))
        yield vllm(GaugeMetricFamily, "vllm:num_requests_waiting",
                   "Number of requests waiting to be processed.", total("num_waiting"))
        yield self.waiting_by_reason(total("num_waiting"), total("num_waiting_deferred"))
        yield vllm(GaugeMetricFamily, "vllm:kv_cache_usage_perc",
                   "KV-cache usage. 1 means 100 percent usage.", used / blocks if blocks else 0.0)
        yield vllm(CounterMetricFamily, "vllm:num_preemptions",
                   "Cumulative number of preemption from the engine.", total("num_preemptions"))
        yield vllm(CounterMetricFamily, "vllm:prefix_cache_queries",
                   "Prefix cache queries, in terms of number of queried tokens.",
                   total("prefix_cache_queries"))
        yield vllm(CounterMetricFamily, "vllm:prefix_cache_hits",
                   "Prefix cache hits, in terms of number of cached tokens.",
                   total("prefix_cache_hits"))
        yield vllm(CounterMetricFamily, "vllm:mm_cache_queries",
                   "Multi-modal cache queries, in terms of number of queried items.",
                   total("encoder_cache_queries"))
        yield vllm(CounterMetricFamily, "vllm:mm_cache_hits",
                   "Multi-modal cache hits, in terms of number of cached items.",
                   total("encoder_cache_hits"))
        yield self.iteration_tokens(stats)
        yield cache_config_info(all_stats)
        yield GaugeMetricFamily("flatserve_engine_mm_bytes_held",
                                "Pixels, vision states and embeddings the engines' requests hold",
                                value=total("mm_bytes_held"))
        yield GaugeMetricFamily(
            "flatserve_encoder_cache_bytes",
            "Bytes of vision embeddings in the engines' encoder caches",
            value=total("encoder_cache_bytes"))
        yield GaugeMetricFamily(
            "flatserve_encoder_cache_entries", "Images in the engines' encoder caches",
            value=total("encoder_cache_entries"))
        yield CounterMetricFamily(
            "flatserve_encoder_cache_queries", "Images looked up in the engines' encoder caches",
            value=total("encoder_cache_queries"))
        yield CounterMetricFamily(
            "flatserve_encoder_cache_hits", "Images whose embeddings came from an encoder cache",
            value=total("encoder_cache_hits"))
        yield GaugeMetricFamily(
            "flatserve_kv_cache_bytes", "Bytes of the engines' KV caches (allocated at start)",
            value=total("kv_cache_bytes"))
        yield GaugeMetricFamily(
            "flatserve_state_cache_bytes", "Bytes of the engines' recurrent state slots "
            "(hybrid models such as Qwen3.5; allocated at start)",
            value=total("state_cache_bytes"))
        yield GaugeMetricFamily(
            "flatserve_cuda_graph_bytes", "Device bytes the engines' CUDA graphs (decode and "
            "mixed steps) took when captured at start (--no-enforce-eager; 0 when eager)",
            value=total("cuda_graph_bytes"))
        yield CounterMetricFamily(
            "flatserve_forward_steps", "Forwards the engines ran (steps with tokens)",
            value=total("num_forward_steps"))
        yield CounterMetricFamily(
            "flatserve_cuda_graph_steps", "Forwards that replayed a decode CUDA graph",
            value=total("num_graph_steps"))
        yield CounterMetricFamily(
            "flatserve_piecewise_graph_steps", "Forwards with prompt chunks (or decodes past "
            "the decode graphs) that replayed CUDA graphs in pieces around their attention "
            "(the rest ran eagerly: more tokens than the largest size)",
            value=total("num_piecewise_steps"))
        yield GaugeMetricFamily(
            "flatserve_state_slots_free", "Recurrent state slots no running request holds",
            value=total("num_state_slots_free"))
        rss = GaugeMetricFamily("flatserve_process_rss_bytes",
                                "Resident set size of each flatserve process",
                                labels=["process"])
        rss.add_metric(["api"], self.process.memory_info().rss)
        for i, s in enumerate(all_stats):
            if s is not None and s.rss_bytes:
                rss.add_metric([f"engine {i}"], s.rss_bytes)
        yield rss

    def waiting_by_reason(self, waiting: int, deferred: int) -> GaugeMetricFamily:
        family = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            labels=["model_name", "reason"])
        family.add_metric([self.model_name, "capacity"], waiting - deferred)
        family.add_metric([self.model_name, "deferred"], deferred)
        return family

    def iteration_tokens(self, stats: list[EngineStats]) -> HistogramMetricFamily:
        counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        for s in stats:
            for i, count in enumerate(s.iteration_tokens_counts):
                counts[i] += count
        bounds = [floatToGoString(b) for b in (*ITERATION_TOKENS_BUCKETS, math.inf)]
        family = HistogramMetricFamily("vllm:iteration_tokens_total",
                                       "Histogram of number of tokens per engine_step.",
                                       labels=["model_name"])
        family.add_metric([self.model_name], list(zip(bounds, accumulate(counts), strict=True)),
                          sum(s.iteration_tokens_sum for s in stats))
        return family


def cache_config_info(all_stats: list[EngineStats | None]) -> GaugeMetricFamily:
    """vLLM's info-style gauge, 1 for each engine, its cache settings in the labels: those of
    vLLM's CacheConfig that flatserve has, written as vLLM writes them (str() of the value,
    "None" for a setting not given). The KV cache is always in the model's dtype: vLLM's
    cache_dtype "auto"."""
    family = GaugeMetricFamily(
        "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
        labels=["block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                "num_gpu_blocks", "kv_cache_size_tokens", "engine"])
    for i, s in enumerate(all_stats):
        if s is None:
            continue
        family.add_metric([str(s.block_size), "auto", str(s.enable_prefix_caching),
                           str(s.gpu_memory_utilization or None), str(s.num_kv_blocks_total),
                           str(s.num_kv_blocks_total * s.block_size), str(i)], 1)
    return family


class MemoryPlanCollector(Collector):
    """Every process's memory plan, part by part and in total, labelled as
    flatserve_process_rss_bytes is ("api", "engine N"), so each ceiling sits beside its RSS."""

    def __init__(self, api_plan: Callable[[], MemoryPlan | None],
                 engine_plans: Callable[[], Iterable[MemoryPlan | None]]):
        self.api_plan = api_plan
        self.engine_plans = engine_plans

    def collect(self) -> Iterable[GaugeMetricFamily]:
        plans = [("api", self.api_plan())]
        plans += [(f"engine {i}", plan) for i, plan in enumerate(self.engine_plans())]
        parts = GaugeMetricFamily("flatserve_memory_plan_bytes",
                                  "Each part of a process's memory plan: what it may hold",
                                  labels=["process", "part"])
        totals = GaugeMetricFamily("flatserve_memory_plan_total_bytes",
                                   "A process's memory plan: the RSS it stays under",
                                   labels=["process"])
        for process, plan in plans:
            if plan is None:
                continue
            for part in plan.parts:
                parts.add_metric([process, part.name], part.nbytes)
            totals.add_metric([process], plan.total)
        yield parts
        yield totals
