"""scripts/bench_floor.py on the tiny model: each path timed through the engine beside a
floor counted from the loaded modules, and the floor never above the measured time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_floor  # noqa: E402


@pytest.mark.timeout(240)
def test_paths_beside_their_floor(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "floor.json"
    code = bench_floor.main(["--model", str(tiny_model_path), "--prompt-len", "64",
                             "--decode-batch", "2", "--image-size", "112", "--repeats", "1",
                             "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert [row["path"] for row in data["rows"]] == ["prefill", "decode", "vision"]
    for row in data["rows"]:
        assert row["gflop"] > 0 and row["measured_ms"] > 0
        # a floor above the measured time would mean work counted that the engine skips
        assert 0 < row["floor_over_measured"] <= 1.2, row
    assert "floor/measured" in capsys.readouterr().out
