import random

import pytest

from api_proc.soak.summary import fit_slope, warmup_requests


def test_exact_line_in_mb_per_thousand_requests():
    xs = [0, 100, 200, 300]
    assert fit_slope(xs, [50 + 0.003 * x for x in xs]) == pytest.approx(3.0)


def test_flat_and_falling():
    assert fit_slope([1, 2, 3], [10.0, 10.0, 10.0]) == pytest.approx(0.0)
    assert fit_slope([0, 1000], [20.0, 10.0]) == pytest.approx(-10.0)


def test_noise_around_a_trend_is_averaged_out():
    rng = random.Random(0)
    xs = list(range(0, 5000, 10))
    ys = [100 + 0.0015 * x + rng.gauss(0, 2) for x in xs]
    assert fit_slope(xs, ys) == pytest.approx(1.5, abs=0.3)


def test_undetermined_slopes_are_none():
    assert fit_slope([], []) is None
    assert fit_slope([5], [1.0]) is None
    assert fit_slope([7, 7, 7], [1.0, 2.0, 3.0]) is None  # no spread in requests


def test_lengths_must_match():
    with pytest.raises(ValueError):
        fit_slope([1, 2], [1.0])


def test_warmup_requests_rounds_up():
    assert warmup_requests(1000, 0.2) == 200
    assert warmup_requests(7, 0.2) == 2
    assert warmup_requests(10, 0.0) == 0
