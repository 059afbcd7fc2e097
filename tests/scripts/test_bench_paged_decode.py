"""scripts/bench_paged_decode.py at tiny shapes: one row per split count, the Triton kernel
agreeing with attention.py's eager path (in Triton's interpreter without a GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.triton_device import runs_triton

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_paged_decode  # noqa: E402

from tests.tolerance import tolerance  # noqa: E402


@runs_triton
def test_rows_per_split_count(tmp_path, capsys):
    out = tmp_path / "paged.json"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    code = bench_paged_decode.main([
        "--batch-sizes", "2", "--context-lens", "40", "--splits", "1,3", "--heads", "4",
        "--kv-heads", "2", "--head-dim", "32", "--dtype", "float32", "--iters", "1",
        "--device", device, "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["splits"] for row in rows] == [1, 3]
    # float32 attention over 40 keys of 32 dims, N(0, 1) scores and values (|values| < 5)
    bound = tolerance(torch.float32, 32 + 2 * 40, scale=1.0)
    for row in rows:
        assert row["max_abs_diff"] <= bound["atol"] + 5 * bound["rtol"], row
        assert row["triton_us"] > 0
        assert (row["triton_graph_us"] is not None) == (device == "cuda")
    assert "| batch | context | splits |" in capsys.readouterr().out
