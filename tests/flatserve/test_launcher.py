"""`flatserve serve` refuses a folder it cannot serve before starting any process."""

from __future__ import annotations

import json
import subprocess
import sys


def test_an_unsupported_model_fails_in_one_line_before_any_process(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"}))
    done = subprocess.run(
        [sys.executable, "-m", "flatserve.cli", "serve", "--model", str(tmp_path), "--port", "1"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "unsupported architecture LlavaForConditionalGeneration" in lines[0]
    assert "Qwen3VLForConditionalGeneration" in lines[0]


def test_data_parallel_engines_take_a_device_each_on_gpus():
    from flatserve.launcher import _engine_device

    gpu = {"device": "cuda", "max_num_seqs": 8}
    assert [_engine_device(gpu, e, 1, True)["device"] for e in range(3)] == \
        ["cuda:0", "cuda:1", "cuda:2"]
    # with tensor parallelism each engine takes tp devices from its first one
    assert [_engine_device({"device": "cuda:2"}, e, 2, True)["device"] for e in range(2)] == \
        ["cuda:2", "cuda:4"]
    # --engines: all on --device; a CPU has one device
    assert _engine_device(gpu, 1, 1, False) is gpu
    assert _engine_device({"device": "cpu"}, 1, 1, True) == {"device": "cpu"}


def test_engines_and_data_parallel_size_are_not_both_given():
    done = subprocess.run([sys.executable, "-m", "flatserve.cli", "serve", "--engines", "2",
                           "-dp", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "not both" in done.stderr.strip().splitlines()[-1]


def test_spawning_flags_are_refused_with_engine_addresses():
    done = subprocess.run([sys.executable, "-m", "flatserve.cli", "serve", "--engine-addresses",
                           "ipc:///tmp/nowhere.sock", "-tp", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "no engine is spawned here" in done.stderr.strip().splitlines()[-1]


def test_engine_restarts_are_refused_where_no_engine_is_spawned():
    done = subprocess.run([sys.executable, "-m", "flatserve.cli", "serve", "--engine-addresses",
                           "ipc:///tmp/nowhere.sock", "--max-engine-restarts", "3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--max-engine-restarts applies to engines spawned here" in \
        done.stderr.strip().splitlines()[-1]
