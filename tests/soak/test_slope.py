import random

import pytest

from flatserve.soak.summary import fit_slope, slope_stderr, warmup_requests


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


def test_stderr_of_an_exact_line_is_zero_and_undetermined_cases_are_none():
    xs = [0, 100, 200, 300]
    assert slope_stderr(xs, [50 + 0.003 * x for x in xs]) == pytest.approx(0.0, abs=1e-9)
    assert slope_stderr([0, 1, 2], [1.0, 2.0, 4.0]) is None  # too few samples
    assert slope_stderr([7, 7, 7, 7], [1.0, 2.0, 3.0, 4.0]) is None
    with pytest.raises(ValueError):
        slope_stderr([1, 2, 3, 4], [1.0])


def test_stderr_covers_the_true_slope_under_independent_noise():
    """About 95% of noisy runs land within two standard errors of the true slope."""
    rng = random.Random(1)
    xs = list(range(0, 2000, 5))
    hits = 0
    for _ in range(200):
        ys = [100 + 0.001 * x + rng.gauss(0, 20) for x in xs]
        hits += abs(fit_slope(xs, ys) - 1.0) <= 2 * slope_stderr(xs, ys)
    assert 180 <= hits <= 200


def test_stderr_widens_for_correlated_noise():
    """A slow wander (the per-request working set, sampled faster than it turns over)
    is not independent noise: the error must cover the slopes it fakes."""
    rng = random.Random(2)
    xs = list(range(0, 2000, 2))
    hits, ratios = 0, []
    for _ in range(200):
        level, ys = 0.0, []
        for _x in xs:
            level = 0.95 * level + rng.gauss(0, 6)  # AR(1): sd ~19 MB, correlated
            ys.append(100 + level)
        se = slope_stderr(xs, ys)
        hits += abs(fit_slope(xs, ys)) <= 2 * se
        naive = slope_stderr_independent(xs, ys)
        ratios.append(se / naive)
    assert 170 <= hits <= 200
    assert min(ratios) > 3  # sqrt(1.95 / 0.05) ~ 6 for r = 0.95


def slope_stderr_independent(xs, ys):
    """The textbook least-squares error, which assumes independent residuals."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    ss = sum((y - my - b * (x - mx)) ** 2 for x, y in zip(xs, ys, strict=True))
    return (ss / (n - 2) / sxx) ** 0.5 * 1000
