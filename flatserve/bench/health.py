"""The server's health-check latency under load, polled from a thread of its own so that the
benchmark's busy event loop does not add to what is measured."""

from __future__ import annotations

import threading
import time

import httpx

HEALTH_PATH = "/health"
FALLBACK_PATH = "/v1/models"  # peer servers without /health
PROBE_TIMEOUT_S = 10.0


class ServerUnreachable(RuntimeError):
    pass


def health_path(base_url: str, headers: dict[str, str]) -> str:
    """The path to poll: /health, or /v1/models where /health is 404. Raises ServerUnreachable
    when neither answers."""
    try:
        with httpx.Client(headers=headers, timeout=PROBE_TIMEOUT_S) as client:
            if client.get(base_url + HEALTH_PATH).status_code != 404:
                return HEALTH_PATH
            if client.get(base_url + FALLBACK_PATH).status_code != 404:
                return FALLBACK_PATH
    except httpx.HTTPError as err:
        raise ServerUnreachable(f"could not reach {base_url}: {err!r}") from None
    raise ServerUnreachable(f"{base_url} answers 404 on both {HEALTH_PATH} and {FALLBACK_PATH}")


class HealthPoller:
    """`with HealthPoller(url, interval_s):` GETs `url` every `interval_s` seconds in a thread
    and keeps the latency of each answer (`latencies_s`) and the failures (`errors`)."""

    def __init__(self, url: str, interval_s: float, headers: dict[str, str] | None = None,
                 timeout_s: float = PROBE_TIMEOUT_S):
        self.url = url
        self.interval_s = interval_s
        self.latencies_s: list[float] = []
        self.errors = 0
        # made here, not in the thread: building its SSL context takes tens of ms
        self._client = httpx.Client(headers=headers, timeout=timeout_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="bench-health", daemon=True)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        with self._client:
            while True:  # at least one probe, however short the run
                started = time.perf_counter()
                try:
                    ok = self._client.get(self.url).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    self.latencies_s.append(time.perf_counter() - started)
                else:
                    self.errors += 1
                if self._stop.wait(self.interval_s):
                    return
