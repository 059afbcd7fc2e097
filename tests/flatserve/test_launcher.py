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
