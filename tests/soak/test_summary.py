import pytest

from flatserve.soak.load import LoadStats
from flatserve.soak.sampler import Sample
from flatserve.soak.summary import format_table, summarize


def make_samples(total=1000, step=50, api=lambda x: 100.0, engine=lambda x: 500.0):
    samples = [Sample(0.1 * i, "idle", 0, 0, {"api": 90.0 + i, "engine 0": 400.0})
               for i in range(3)]
    for x in range(0, total + 1, step):
        samples.append(Sample(1.0 + x / 100, "load", x, 4,
                              {"api": api(x), "engine 0": engine(x)},
                              uss_mb={"api": api(x) - 20} if x % 200 == 0 else {},
                              mm_inflight_mb=3.0))
    samples.append(Sample(99.0, "final", total, 0, {"api": api(total) - 1, "engine 0": 500.0}))
    return samples


def stats(finished=1000, errors=0, **kwargs):
    s = LoadStats(finished=finished, ok=finished - errors, errors=errors, started_at=0.0,
                  ended_at=10.0, **kwargs)
    return s


PROCS = [("api", 11, False), ("engine 0", 12, False)]


def test_flat_run_passes_with_figures():
    summary = summarize(make_samples(), PROCS, stats(), max_slope=2.0, warmup_share=0.2,
                        budget_mb=64.0)
    assert summary.passed and summary.reasons == []
    api = summary.process("api")
    assert api.pid == 11
    assert api.idle_mb == 91.0  # median of the idle samples
    assert api.warm_mb == 100.0
    assert api.final_mb == 99.0
    assert api.peak_mb == 100.0
    assert api.peak_uss_mb == 80.0
    assert api.slope_mb_per_1k == pytest.approx(0.0)
    assert summary.warmup_requests == 200
    assert summary.requests_per_s == pytest.approx(100.0)
    assert summary.mm_inflight_peak_mb == 3.0


def test_growth_fails_and_names_the_process():
    summary = summarize(make_samples(engine=lambda x: 500 + 0.01 * x), PROCS, stats(),
                        max_slope=2.0, warmup_share=0.2)
    assert not summary.passed
    assert not summary.process("engine 0").passed and summary.process("api").passed
    assert summary.process("engine 0").slope_mb_per_1k == pytest.approx(10.0)
    assert any("engine 0" in r and "10.00 MB per 1,000" in r for r in summary.reasons)


def test_warmup_growth_is_not_counted():
    def warming(x):
        return 100 + min(x, 150) * 0.5  # grows 75 MB in the first 150 requests, then flat

    summary = summarize(make_samples(api=warming), PROCS, stats(), max_slope=2.0,
                        warmup_share=0.2)
    assert summary.passed
    assert summary.process("api").warm_mb == 175.0
    failed = summarize(make_samples(api=warming), PROCS, stats(), max_slope=2.0,
                       warmup_share=0.0)
    assert not failed.passed


def test_unexpected_errors_fail_but_disconnects_and_rejections_do_not():
    ok = summarize(make_samples(), PROCS, stats(disconnects=100, rejected=5), 2.0, 0.2)
    assert ok.passed and ok.disconnects == 100 and ok.rejected == 5
    bad = summarize(make_samples(), PROCS, stats(errors=1), 2.0, 0.2)
    assert not bad.passed and "1 requests failed unexpectedly" in bad.reasons


def test_too_few_samples_exited_and_interrupted_fail():
    short = summarize(make_samples(total=100, step=50), PROCS, stats(finished=100), 2.0, 0.2)
    assert not short.passed and short.process("api").slope_mb_per_1k is None
    exited = summarize(make_samples(), [("api", 11, False), ("engine 0", 12, True)], stats(),
                       2.0, 0.2)
    assert not exited.passed and exited.process("engine 0").exited
    interrupted = summarize(make_samples(), PROCS, stats(), 2.0, 0.2, interrupted=True)
    assert not interrupted.passed and interrupted.interrupted


def test_table_lists_every_process_and_the_verdict():
    summary = summarize(make_samples(engine=lambda x: 500 + 0.01 * x), PROCS,
                        stats(errors=2), 2.0, 0.2, budget_mb=64.0)
    table = format_table(summary)
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["process", "pid"]
    assert any(line.startswith("api") and line.rstrip().endswith("ok") for line in lines)
    assert any(line.startswith("engine 0") and "+10.00" in line and "FAIL" in line
               for line in lines)
    assert "errors 2" in table and "budget 64.0 MB" in table
    assert lines[-1].startswith("FAILED")


def test_slope_comes_with_its_standard_error():
    def noisy(x):
        return 100 + (7 if x % 100 else -7)  # flat on average, swinging 14 MB

    summary = summarize(make_samples(api=noisy), PROCS, stats(), 2.0, 0.2)
    api = summary.process("api")
    assert api.slope_stderr_mb_per_1k > 0
    assert summary.process("engine 0").slope_stderr_mb_per_1k == pytest.approx(0.0)
    table = format_table(summary)
    assert "± se" in table.splitlines()[0]
    api_line = next(line for line in table.splitlines() if line.startswith("api"))
    assert f"{api.slope_stderr_mb_per_1k:.2f}" in api_line


def test_a_peak_above_its_memory_plan_fails_and_names_the_process():
    plans = {"api": 150.0, "engine 0": 480.0}  # the engine peaks at 500 MB
    summary = summarize(make_samples(), PROCS, stats(), max_slope=2.0, warmup_share=0.2,
                        plans_mb=plans)
    assert not summary.passed
    assert summary.process("api").passed and summary.process("api").plan_mb == 150.0
    assert not summary.process("engine 0").passed
    assert summary.reasons == ["engine 0: peak RSS 500.0 MB is above its memory plan 480.0 MB"]
    table = format_table(summary)
    assert "plan MB" in table.splitlines()[0]
    assert "480.0" in table.splitlines()[3] and "FAIL" in table.splitlines()[3]


def test_peaks_within_their_plans_pass():
    summary = summarize(make_samples(), PROCS, stats(), max_slope=2.0, warmup_share=0.2,
                        plans_mb={"api": 150.0, "engine 0": 500.0})
    assert summary.passed, summary.reasons
