"""scripts/bench_host_step.py: the engine loop's host work per step is timed with every
sequence decoding and the forward left out, the closed loop's decode-only share is counted,
and the real forward and run are back afterwards."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_host_step  # noqa: E402

from engine_proc.model_runner import ModelRunner  # noqa: E402
from shared.random_checkpoints import ensure_checkpoint  # noqa: E402
from shared.random_checkpoints.presets import TINY  # noqa: E402


def test_a_row_per_batch_size_and_the_forward_restored(monkeypatch, capsys):
    forward = ModelRunner._forward
    steps = []
    step = bench_host_step.LLMEngine.step
    monkeypatch.setattr(bench_host_step.LLMEngine, "step",
                        lambda self: steps.append(self.scheduler.num_running) or step(self))
    ms = bench_host_step.host_ms_per_step(ensure_checkpoint(TINY), 3, 4)
    assert ms > 0
    assert steps[-4:] == [3, 3, 3, 3]  # the timed steps ran with every sequence decoding
    assert ModelRunner._forward is forward
    monkeypatch.setattr(sys, "argv", ["bench_host_step.py", "--seqs", "2", "--steps", "2"])
    bench_host_step.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 3  # the host time, then the decode-only share for both lengths
    assert ModelRunner._forward is forward


def test_a_closed_loop_with_one_length_is_mostly_decode_only_and_mixed_lengths_less():
    """Equal lengths keep a closed loop's requests in step (their prompts arrive together);
    mixed lengths spread them, so more steps carry a prompt chunk."""
    path = ensure_checkpoint(TINY)
    run, forward = ModelRunner.run, ModelRunner._forward
    equal = bench_host_step.decode_only_share(path, 16, (128, 128), 48)
    mixed = bench_host_step.decode_only_share(path, 16, (64, 192), 48)
    assert equal > 0.9 and mixed < equal
    assert ModelRunner.run is run and ModelRunner._forward is forward
