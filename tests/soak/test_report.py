import csv
import json

from PIL import Image

from flatserve.soak.load import LoadStats
from flatserve.soak.report import write_csv, write_json, write_plot
from flatserve.soak.sampler import Sample
from flatserve.soak.summary import summarize


def run_data():
    samples = [Sample(0.0, "idle", 0, 0, {"api": 50.0, "engine 0": 300.0}, {"api": 40.0})]
    samples += [Sample(1.0 + i, "load", i * 10, 3, {"api": 50.0 + i * 0.1, "engine 0": 300.0},
                       mm_inflight_mb=float(i % 3)) for i in range(20)]
    samples.append(Sample(30.0, "final", 200, 0, {"api": 51.0, "engine 0": 300.0}))
    stats = LoadStats(finished=200, ok=200, started_at=0.0, ended_at=20.0)
    summary = summarize(samples, [("api", 1, False), ("engine 0", 2, False)], stats,
                        max_slope=2.0, warmup_share=0.2, budget_mb=32.0,
                        config={"concurrency": 4, "image_size": 64, "images_per_request": 1})
    return samples, summary


def test_csv_has_one_row_per_sample(tmp_path):
    samples, _ = run_data()
    write_csv(tmp_path / "s.csv", samples)
    with open(tmp_path / "s.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(samples)
    assert rows[0]["phase"] == "idle" and rows[0]["api.uss_mb"] == "40.000"
    assert rows[1]["engine_0.rss_mb"] == "300.000" and rows[1]["api.uss_mb"] == ""
    assert rows[-1]["requests"] == "200"


def test_json_round_trips(tmp_path):
    _, summary = run_data()
    write_json(tmp_path / "s.json", summary)
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["passed"] is False  # the api grows 10 MB per 1,000 requests
    assert [p["role"] for p in data["processes"]] == ["api", "engine 0"]
    for key in ("idle_mb", "warm_mb", "peak_mb", "final_mb", "slope_mb_per_1k", "slope_stderr_mb_per_1k", "pid"):
        assert key in data["processes"][0]
    for key in ("requests", "errors", "disconnects", "max_slope", "duration_s",
                "requests_per_s", "config"):
        assert key in data


def test_png_is_written(tmp_path):
    samples, summary = run_data()
    write_plot(tmp_path / "rss.png", samples, summary)
    with Image.open(tmp_path / "rss.png") as image:
        assert image.format == "PNG" and image.size[0] > 500


def test_the_plot_gains_a_panel_with_each_plan_as_a_line(tmp_path):
    samples, summary = run_data()
    write_plot(tmp_path / "without.png", samples, summary)
    summary.process("api").plan_mb = 120.0
    summary.process("engine 0").plan_mb = 900.0
    write_plot(tmp_path / "with.png", samples, summary)
    with Image.open(tmp_path / "without.png") as without, \
            Image.open(tmp_path / "with.png") as with_plans:
        assert with_plans.size[1] > without.size[1]
