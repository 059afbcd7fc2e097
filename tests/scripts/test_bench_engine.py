"""scripts/bench_engine.py's steady-state mode: the same requests, staggered into a closed
loop, produce the same tokens as the synchronized run, and the JSON carries both ratios."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_engine  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_steady_state_beside_synchronized(tmp_path, capsys):
    out = tmp_path / "engine.json"
    code = bench_engine.main(
        [
            "--num-requests",
            "2",
            "--max-tokens",
            "4",
            "--hf-batch-sizes",
            "",
            "--no-floor",
            "--steady-requests",
            "6",
            "--steady-images",
            "3",
            "--steady-image-size",
            "56",
            "--steady-concurrency",
            "2",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    rows = data["steady_rows"]
    assert [r["system"] for r in rows] == [
        "text: synchronized",
        "text: steady",
        "image: synchronized",
        "image: steady",
    ]
    # the same requests either way: every one runs to its own max_tokens (ignore_eos)
    assert rows[0]["output_tokens"] == rows[1]["output_tokens"] > 6
    assert rows[2]["output_tokens"] == rows[3]["output_tokens"] > 3
    for kind in ("text", "image"):
        assert data[f"steady_vs_synchronized_{kind}"] > 0
    assert "steady_vs_synchronized_image" in capsys.readouterr().out


def test_steady_loop_staggers_and_caps_arrivals():
    """run_engine's admission: one new request per step, never more than the cap in flight."""
    added: list[int] = []  # in-flight count right after each add

    class Engine:
        def __init__(self):
            self.running: dict[str, int] = {}

        def add_request(self, request):
            self.running[request] = 3  # each request needs 3 steps
            added.append(len(self.running))

        def has_unfinished_requests(self):
            return bool(self.running)

        def step(self):
            outputs = []
            for rid in list(self.running):
                self.running[rid] -= 1
                done = self.running[rid] == 0
                if done:
                    del self.running[rid]
                outputs.append(
                    type(
                        "Out",
                        (),
                        {
                            "request_id": rid,
                            "new_token_ids": [1],
                            "finish_reason": "length" if done else None,
                        },
                    )
                )
            return outputs

    engine = Engine()
    tokens, _ = bench_engine.drive(engine, [f"r{i}" for i in range(7)], steady_concurrency=2)
    assert tokens == 7 * 3
    assert max(added) == 2 and added[:2] == [1, 2]
