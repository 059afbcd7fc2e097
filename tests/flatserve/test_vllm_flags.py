"""`flatserve serve` takes a vLLM user's command line: the positional model, several served
names, the JSON form of --limit-mm-per-prompt, defaults shown in --help; bad values fail in
the launcher, in one line, before any process starts."""

from __future__ import annotations

import argparse
import shutil
import ssl
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
    assert args.limit_mm_per_prompt == (2, 1) and args.dtype == "bfloat16"
    assert args.device == "cuda:1" and args.enable_prefix_caching is False
    assert parse("--limit-mm-per-prompt", "5").limit_mm_per_prompt == (5, 1)
    assert parse("-tp", "2").tensor_parallel_size == 2
    assert parse("--tensor-parallel-size", "4").tensor_parallel_size == 4
    assert parse().tensor_parallel_size == 1
    assert parse("--limit-mm-per-prompt", '{"image": 3, "video": 0}').limit_mm_per_prompt == (3, 0)


def test_mm_processor_kwargs_forms(tiny_model_path):
    from api_proc.config import ApiConfig

    both = (("max_pixels", 200704), ("min_pixels", 3136))
    assert parse("--mm-processor-kwargs",
                 '{"min_pixels": 3136, "max_pixels": 200704}').mm_processor_kwargs == both
    assert parse("--mm-processor-kwargs", '{"size": {"shortest_edge": 3136, '
                 '"longest_edge": 200704}}').mm_processor_kwargs == both
    config = ApiConfig(model=str(tiny_model_path), mm_processor_kwargs=both)
    from shared.model_config import load_model_config
    image = config.image_config(load_model_config(tiny_model_path).image)
    assert (image.min_pixels, image.max_pixels) == (3136, 200704)
    with pytest.raises(ValueError, match="min_pixels 3136 is above max_pixels 1000"):
        ApiConfig(model=str(tiny_model_path), mm_processor_kwargs=(("max_pixels", 1000),
                                                                    ("min_pixels", 3136)))


@pytest.mark.parametrize("flag, value, says", [
    ("--dtype", "fp64", "invalid choice: 'fp64'"),
    ("--device", "gpu", "is not a device"),
    ("--limit-mm-per-prompt", '{"audio": 1}', "audio is not supported"),
    ("--limit-mm-per-prompt", '{"video": -1}', "the video limit must be a count"),
    ("--media-io-kwargs", '{"video": {"frames": 8}}', "unknown setting 'frames'"),
    ("--media-io-kwargs", '{"image": {"x": 1}}', "'image' takes no settings"),
    ("--media-io-kwargs", '{"video": {"num_frames": -1}}', "num_frames must be a positive"),
    ("--limit-mm-per-prompt", '{"sound": 1}', "unknown modality 'sound'"),
    ("--limit-mm-per-prompt", "many", "neither a count nor a JSON object"),
    ("--mm-processor-kwargs", '{"fps": 2}', "unknown processor setting 'fps'"),
    ("--mm-processor-kwargs", '{"max_pixels": -1}', "max_pixels must be a positive pixel count"),
    ("--mm-processor-kwargs", "[1]", "is not a JSON object"),
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
    assert "(default: 64)" in text and "(default: (8, 1))" in text and "MODEL" in text


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


# ---- the review of vLLM's flags: aliases, no-op values, refusals by name -----------------


def parse_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        build_serve_parser(argparse.ArgumentParser(prog="flatserve serve")).parse_args(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_representative_vllm_command_line_parses_and_validates(tiny_model_path):
    from api_proc.config import ApiConfig
    from flatserve.launcher import ENGINE_FLAGS
    from shared.engine_config import EngineConfig

    args = parse(str(tiny_model_path), "--host", "0.0.0.0", "--port", "8000",
                 "--max-model-len", "4k", "--served-model-name", "x", "--disable-log-requests",
                 "--trust-remote-code", "--enforce-eager", "--enable-chunked-prefill",
                 "--max-num-seqs", "32", "--max-num-batched-tokens", "2048", "--block-size", "16",
                 "--seed", "1", "--dtype", "auto", "--kv-cache-dtype", "auto",
                 "--load-format", "safetensors", "--swap-space", "0", "-pp", "1", "-dp", "1",
                 "--disable-fastapi-docs", "--disable-log-stats", "--root-path", "/llm",
                 "--allowed-origins", '["https://ui.example"]', "--api-key", "k",
                 "--limit-mm-per-prompt", '{"image": 4}', "--uvicorn-log-level", "warning",
                 "--disable-uvicorn-access-log", "--num-gpu-blocks-override", "100",
                 "--generation-config", "vllm", "--response-role", "assistant",
                 "--no-async-scheduling", "--attention-backend", "auto",
                 "--stream-interval", "4", "--sse-keep-alive-interval", "15")
    config = ApiConfig.from_cli_args(args, model=args.model_tag, served_model_name=("x",),
                                     engine_addresses=("ipc:///tmp/e.sock",))
    assert config.max_model_len == 4000 and config.host == "0.0.0.0"
    assert config.root_path == "/llm" and config.allowed_origins == ("https://ui.example",)
    assert config.enable_log_requests is False and config.max_images_per_prompt == 4
    assert config.stream_interval == 4 and config.sse_keep_alive_interval == 15.0
    engine = EngineConfig(model=args.model_tag, **{n: getattr(args, n) for n in ENGINE_FLAGS})
    assert engine.seed == 1 and engine.num_kv_blocks == 100 and engine.max_num_seqs == 32
    assert args.disable_uvicorn_access_log
    assert parse("--max-model-len", "32K").max_model_len == 32768
    graphs = parse(str(tiny_model_path), "--no-enforce-eager", "--cudagraph-capture-sizes", "1",
                   "2", "4", "--max-cudagraph-capture-size", "4")
    engine = EngineConfig(model=graphs.model_tag, **{n: getattr(graphs, n) for n in ENGINE_FLAGS})
    assert engine.enforce_eager is False and engine.cudagraph_capture_sizes == (1, 2, 4)
    assert EngineConfig.from_json(engine.to_json()) == engine
    with pytest.raises(ValueError, match="cudagraph_capture_sizes must be whole numbers"):
        EngineConfig(model="m", cudagraph_capture_sizes=("1", "x"))


@pytest.mark.parametrize("argv, says", [
    (["--quantization", "awq"], "--quantization awq cannot apply here: weights run unquantized"),
    (["-q", "fp8"], "-q fp8 cannot apply here"),
    (["--swap-space", "4"], "--swap-space 4 cannot apply here: preemption recomputes: there "
                            "is no CPU swap space (accepted: 0)"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 cannot apply here"),
    (["--no-enable-chunked-prefill"], "chunked prefill is always on"),
    (["--compilation-config", "{}"], "no torch.compile"),
    (["--optimization-level", "3"], "no torch.compile"),
    (["--async-scheduling"], "--async-scheduling cannot apply here: an engine schedules each "
                             "step once the step before it has sampled"),
    (["--performance-mode", "throughput"], "no performance modes"),
    (["--attention-backend", "FLASH_ATTN"], "flatserve's own kernels for the device "
                                            "(FlashAttention's varlen"),
    (["-pp", "2"], "-pp 2 cannot apply here: no pipeline parallelism"),
    (["--revision", "main"], "no hub downloads"),
    (["--download-dir", "/x"], "no hub downloads"),
    (["--hf-token"], "--hf-token cannot apply here: flatserve serves local checkpoint"),
    (["--tokenizer", "/x"], "the tokenizer is the model folder's own"),
    (["--max-num-partial-prefills", "2"], "bounded by the step's token budget"),
    (["--enable-lora"], "no LoRA adapters"),
    (["--speculative-config", "{}"], "no speculative decoding"),
    (["--response-role", "bot"], "responses carry the role assistant"),
    (["--max-model-len", "1.5K"], "binary suffixes take whole numbers"),
    (["--allowed-origins", "[1]"], "not a JSON list of strings"),
    (["--reasoning-config", '{"think_start": "<t>"}'], "unknown reasoning setting"),
    (["--reasoning-config", '{"reasoning_end_str": ""}'], "must be a non-empty string"),
])
def test_flags_that_cannot_apply_are_refused_by_name(capsys, argv, says):
    line = parse_error(capsys, *argv)
    assert line.startswith("flatserve serve: error: ") and says in line


def test_qwen35_recipe_flags_are_flatserves_own(tiny_model_path):
    """vLLM's recipe for Qwen3.5: --reasoning-parser qwen3 --enable-auto-tool-choice
    --tool-call-parser qwen3_coder (and --default-chat-template-kwargs)."""
    from api_proc.config import ApiConfig

    args = parse(str(tiny_model_path), "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
                 "--tool-call-parser", "qwen3_coder", "--default-chat-template-kwargs",
                 '{"enable_thinking": false}')
    config = ApiConfig.from_cli_args(args, model=args.model_tag)
    assert (config.reasoning_parser, config.tool_call_parser) == ("qwen3", "qwen3_coder")
    assert config.template_defaults == {"enable_thinking": False}
    assert parse("--reasoning-parser", "deepseek_r1").reasoning_parser == "deepseek_r1"


@pytest.mark.parametrize("argv, says", [
    (["--reasoning-parser", "granite"], "argument --reasoning-parser: invalid choice: 'granite'"),
    (["--default-chat-template-kwargs", '{"tools": []}'], "tools cannot be set"),
])
def test_unknown_parsers_fail_in_one_line_before_any_process(argv, says):
    done = subprocess.run([sys.executable, "-m", "flatserve.cli", "serve", "/models/x", *argv],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and says in done.stderr.strip().splitlines()[-1]


def test_an_unknown_tool_call_parser_fails_in_one_line(tiny_model_path):
    done = subprocess.run([sys.executable, "-m", "flatserve.cli", "serve", str(tiny_model_path),
                           "--tool-call-parser", "mistral"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "tool_call_parser must be one of hermes, qwen3_coder, got 'mistral'" in \
        done.stderr.strip().splitlines()[-1]


def test_a_refusal_comes_before_any_process_starts():
    done = subprocess.run([sys.executable, "-m", "flatserve.cli", "serve", "/models/x",
                           "--quantization", "awq"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "flatserve serve: error: --quantization awq cannot apply here: weights run "
        "unquantized, in --dtype")


def test_help_lists_the_vllm_flags_with_their_reasons():
    done = subprocess.run([sys.executable, "-m", "flatserve.cli", "serve", "--help"],
                          capture_output=True, text=True, timeout=60)
    text = " ".join(done.stdout.split())
    assert "--swap-space VALUE preemption recomputes: there is no CPU swap space (accepted: 0)" \
        in text
    assert "--quantization [VALUE], -q [VALUE] weights run unquantized, in --dtype (refused)" \
        in text
    assert "--num-kv-blocks NUM_KV_BLOCKS, --num-gpu-blocks-override NUM_KV_BLOCKS" in text
    assert "--seed SEED" in text and "(default: 0)" in text


def test_cors_settings_without_origins_are_refused(tiny_model_path):
    from api_proc.config import ApiConfig

    for setting in ({"allow_credentials": True}, {"allowed_methods": ("POST",)},
                    {"allowed_headers": ("x-api-key",)}):
        with pytest.raises(ValueError, match="give it too"):
            ApiConfig(model=str(tiny_model_path), **setting)
    ApiConfig(model=str(tiny_model_path), allowed_origins=("https://ui.example",),
              allow_credentials=True, allowed_methods=("POST",))


def test_cors_and_root_path(start_app):
    plain = start_app()
    assert httpx.get(plain.url + "/v1/models").status_code == 200
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"}
    refused = httpx.options(plain.url + "/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in refused.headers  # no CORS unless asked
    app = start_app(allowed_origins=("https://ui.example",), root_path="/llm")
    allowed = httpx.options(app.url + "/v1/chat/completions", headers=preflight)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://ui.example"
    other = httpx.options(app.url + "/v1/chat/completions",
                          headers=preflight | {"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    for path in ("/llm/v1/models", "/v1/models"):  # behind a proxy that keeps or strips it
        assert httpx.get(app.url + path).status_code == 200, path


@pytest.mark.slow
def test_seed_repeats_unseeded_sampling(tiny_model_path, tmp_path):
    """--seed: a server's unseeded samples repeat from one start to the next with the same
    seed, and differ with another. Token ids of 32 tokens sampled at a flattened
    temperature: unlike 8 at temperature 1, two seeds cannot agree by chance on a CPU whose
    rounding makes the tiny model's distribution peak."""
    ask = {"messages": [{"role": "user", "content": "a story"}], "max_tokens": 32,
           "temperature": 1.5, "ignore_eos": True, "return_token_ids": True}
    servers = []  # three fresh servers, started side by side
    try:
        for i, seed in enumerate(("5", "5", "6")):
            servers.append(ServerProcess(str(tiny_model_path), "--seed", seed,
                                         log_path=tmp_path / f"server{i}.log"))
        ids = []
        for server in servers:
            server.wait_ready()
            reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, json=ask)
            ids.append(reply.json()["choices"][0]["token_ids"])
    finally:
        for server in servers:
            server.stop()
    assert len(ids[0]) == 32
    assert ids[0] == ids[1] != ids[2]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_serves_https_with_the_given_certificate(tiny_model_path, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    trusted = ssl.create_default_context(cafile=str(cert))
    server = ServerProcess(str(tiny_model_path), "--ssl-keyfile", str(key), "--ssl-certfile",
                           str(cert), tls_ca=trusted, log_path=tmp_path / "server.log")
    try:
        server.wait_ready()
        reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, verify=trusted,
                           json={"messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 2})
        assert reply.status_code == 200
        with pytest.raises(httpx.ConnectError):  # an unknown certificate is refused
            httpx.get(server.url + "/health", timeout=10)
        plain = server.url.replace("https://", "http://")
        with pytest.raises(httpx.HTTPError):  # no plain HTTP on the TLS port
            httpx.get(plain + "/health", timeout=10)
    finally:
        server.stop()
    assert f"on https://127.0.0.1:{server.port}" in server.log_tail(20000)


def test_tls_files_are_checked_before_any_process_starts(tmp_path):
    (tmp_path / "key.pem").write_text("not a key")
    done = subprocess.run([sys.executable, "-m", "flatserve.cli", "serve", "--ssl-keyfile",
                           str(tmp_path / "key.pem"), "--ssl-certfile", str(tmp_path / "key.pem")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "TLS files cannot be loaded" in done.stderr.strip().splitlines()[-1]
    alone = subprocess.run([sys.executable, "-m", "flatserve.cli", "serve", "--ssl-keyfile",
                            str(tmp_path / "key.pem")], capture_output=True, text=True, timeout=120)
    assert alone.returncode == 2 and "go together" in alone.stderr.strip().splitlines()[-1]
