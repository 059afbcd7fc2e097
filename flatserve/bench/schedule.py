"""When the open loop sends each request: Poisson arrivals at a set rate."""

from __future__ import annotations

import numpy as np


def arrival_offsets(num_requests: int, rate: float, seed: int) -> np.ndarray:
    """Seconds from the start at which each request is sent: the first at 0, then exponential
    gaps of mean 1/rate (rate inf: all at 0)."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, max(0, num_requests - 1))
    return np.concatenate(([0.0], np.cumsum(gaps)))[:num_requests]
