"""`flatserve serve` takes a vLLM user's command line: the positional model, several served
names, the JSON form of --limit-mm-per-prompt, defaults shown in --help; bad values fail in
the launcher, in one line, before any process starts."""

from __future__ import annotations

import argparse
import subprocess
import sys

import httpx
import pytest

from flatserve.cli import build_serve_parser
from tests.e2e.server_process import ServerProcess


def parse(*argv: str) -> argparse.Namespace:
    return build_serve_parser(argparse.ArgumentParser()).parse_args(list(argv))


def test_vllm_forms_parse():
    args = parse("/models/x", "--served-model-name", "a", "b", "--limit-mm-per-prompt",
                 '{"image": 2}', "--dtype", "bfloat16", "--device", "cuda:1",
                 "--no-enable-prefix-caching", "--uvicorn-log-level", "warning")
    assert args.model_tag == "/models/x" and args.served_model_name == ["a", "b"]
    assert args.limit_mm_per_prompt == 2 and args.dtype == "bfloat16"
    assert args.device == "cuda:1" and args.enable_prefix_caching is False
    assert parse("--limit-mm-per-prompt", "5").limit_mm_per_prompt == 5
    assert parse("-tp", "2").tensor_parallel_size == 2
    assert parse("--tensor-parallel-size", "4").tensor_parallel_size == 4
    assert parse().tensor_parallel_size == 1
    assert parse("--limit-mm-per-prompt", '{"image": 3, "video": 0}').limit_mm_per_prompt == 3


@pytest.mark.parametrize("flag, value, says", [
    ("--dtype", "fp64", "invalid choice: 'fp64'"),
    ("--device", "gpu", "is not a device"),
    ("--limit-mm-per-prompt", '{"video": 1}', "only images are supported"),
    ("--limit-mm-per-prompt", '{"sound": 1}', "unknown modality 'sound'"),
    ("--limit-mm-per-prompt", "many", "neither a count nor a JSON object"),
])
def test_bad_values_fail_in_one_line_before_any_process(flag, value, says):
    done = subprocess.run([sys.executable, "-m", "flatserve.cli", "serve", flag, value],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert says in done.stderr.strip().splitlines()[-1]


def test_help_shows_defaults():
    done = subprocess.run([sys.executable, "-m", "flatserve.cli", "serve", "--help"],
                          capture_output=True, text=True, timeout=60)
    text = " ".join(done.stdout.split())
    assert "(default: 64)" in text and "(default: 8)" in text and "MODEL" in text


@pytest.mark.parametrize("size, says", [
    ("3", "num_attention_heads (8) is not divisible by the tensor-parallel size 3"),
    ("0", "--tensor-parallel-size 0: it must be at least 1"),
])
def test_tensor_parallel_sizes_that_cannot_split_are_refused(size, says):
    done = subprocess.run([sys.executable, "-m", "flatserve.cli", "serve", "-tp", size],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert says in done.stderr.strip().splitlines()[-1]


def test_gpu_memory_utilization_is_refused_on_a_cpu():
    done = subprocess.run([sys.executable, "-m", "flatserve.cli", "serve", "--device", "cpu",
                           "--gpu-memory-utilization", "0.9"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--gpu-memory-utilization applies to GPUs" in done.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_positional_model_and_several_served_names(tiny_model_path, tmp_path):
    import json

    defaults = tmp_path / "gen"
    defaults.mkdir()
    (defaults / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    server = ServerProcess(str(tiny_model_path), "--served-model-name", "main", "alias",
                           "--max-logprobs", "2", "--generation-config", str(defaults),
                           "--enable-log-requests", log_path=tmp_path / "server.log")
    try:
        server.wait_ready()
        # --generation-config: a request without temperature samples at its default, 0
        ask = {"model": "main", "messages": [{"role": "user", "content": "a story"}],
               "max_tokens": 12}
        texts = {httpx.post(server.url + "/v1/chat/completions", timeout=60,
                            json=ask | extra).json()["choices"][0]["message"]["content"]
                 for extra in ({}, {}, {"temperature": 0})}
        assert len(texts) == 1
        many = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json=ask | {"logprobs": True, "top_logprobs": 3})
        assert many.status_code == 400 and "max_logprobs=2" in many.text
        ids = [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
        assert ids == ["main", "alias"]
        reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "alias", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert reply.status_code == 200 and reply.json()["model"] == "main"
        other = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "nope", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert other.status_code == 404
    finally:
        server.stop()
    assert "request chatcmpl-" in server.log_tail(20000)  # --enable-log-requests
    twice = subprocess.run([sys.executable, "-m", "flatserve.cli", "serve", str(tiny_model_path),
                            "--model", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert twice.returncode != 0 and "the model is given twice" in twice.stderr
