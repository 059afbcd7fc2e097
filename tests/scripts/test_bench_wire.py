"""scripts/bench_wire.py runs end to end on a small load: the real engine process with its
stand-in model, the real engine client reading every stream to the end, the raw pyzmq limit
and the stand-in alone, and every token is counted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_wire  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("iterate", [False, True], ids=["delivered", "iterated"])
def test_every_token_is_streamed_and_costed(tmp_path, capsys, iterate):
    out = tmp_path / "wire.json"
    bench_wire.main(["--requests", "12", "--concurrency", "4", "--output-len", "5",
                     "--step-ms", "1", "--json", str(out), *(["--iterate"] if iterate else [])])
    result = json.loads(out.read_text())
    assert result["tokens"] == 12 * 5
    for key in ("engine_us_per_token", "api_us_per_token", "raw_engine_us_per_token",
                "raw_api_us_per_token", "stand_in_us_per_token"):
        assert key in result  # their values: CPU clocks tick every 10 ms, this load may read 0
    table = capsys.readouterr().out
    assert "engine process" in table and "api process" in table
