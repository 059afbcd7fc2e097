"""A background thread that samples RSS/USS of the server's processes and its in-flight bytes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import psutil

from flatserve.soak.metrics import parse_mm_metrics, parse_plan_totals
from flatserve.soak.processes import Target

MB = 1 << 20


@dataclass
class Sample:
    time_s: float  # since the sampler was made
    phase: str  # "idle" (before load), "load", "final" (after load)
    requests: int  # requests finished when sampled
    in_flight: int
    rss_mb: dict[str, float] = field(default_factory=dict)  # by role
    uss_mb: dict[str, float] = field(default_factory=dict)
    mm_inflight_mb: float | None = None


class RssSampler:
    """`sample()` reads every target once; `start()` does so every `interval_s` in a thread."""

    def __init__(
        self,
        targets: list[Target],
        counts: Callable[[], tuple[int, int]],
        interval_s: float,
        uss_every: int = 5,
        metrics_url: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        self.targets = targets
        self.counts = counts  # -> (requests finished, requests in flight)
        self.interval_s = interval_s
        self.uss_every = uss_every
        self.samples: list[Sample] = []
        self.budget_bytes: float | None = None
        self.plan_bytes: dict[str, float] = {}  # each process's memory plan, by role
        self._metrics_url = metrics_url
        self._http = httpx.Client(timeout=min(2.0, max(0.5, interval_s)), headers=headers)
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def sample(self, phase: str) -> Sample:
        with self._lock:
            requests, in_flight = self.counts()
            sample = Sample(time.monotonic() - self._t0, phase, requests, in_flight)
            read_uss = self.uss_every > 0 and len(self.samples) % self.uss_every == 0
            for target in self.targets:
                self._read_process(target, sample, read_uss)
            sample.mm_inflight_mb = self._read_metrics()
            self.samples.append(sample)
            return sample

    def _read_process(self, target: Target, sample: Sample, read_uss: bool) -> None:
        if target.gone:
            return
        try:
            if read_uss and target.uss_ok:
                try:
                    info = target.process.memory_full_info()
                    sample.uss_mb[target.role] = info.uss / MB
                except psutil.AccessDenied:
                    target.uss_ok = False
                    info = target.process.memory_info()
            else:
                info = target.process.memory_info()
            sample.rss_mb[target.role] = info.rss / MB
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            target.gone = True

    def _read_metrics(self) -> float | None:
        if self._metrics_url is None:
            return None
        try:
            response = self._http.get(self._metrics_url)
        except httpx.HTTPError:
            return None
        if response.status_code == 404:
            self._metrics_url = None  # the server has no /metrics: stop asking
            return None
        if response.status_code != 200:
            return None
        metrics = parse_mm_metrics(response.text)
        self.plan_bytes = parse_plan_totals(response.text) or self.plan_bytes
        if metrics.budget_bytes is not None:
            self.budget_bytes = metrics.budget_bytes
        return None if metrics.inflight_bytes is None else metrics.inflight_bytes / MB

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.sample("load")
            # fixed rate; after a slow sample, skip the ticks it overran instead of bursting
            now = time.monotonic()
            while next_at <= now:
                next_at += self.interval_s
            self._stop.wait(next_at - now)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        self.stop()
        self._http.close()
