import sys

import pytest

from flatserve.soak.config import (
    DEFAULT_REQUESTS,
    SoakConfig,
    parse_args,
    parse_bytes,
    passthrough_value,
)


def test_defaults_and_passthrough():
    config = parse_args(["--concurrency", "8", "--no-stream", "--", "--model", "/m",
                         "--mm-inflight-budget", "1024"])
    assert config.requests == DEFAULT_REQUESTS
    assert config.concurrency == 8 and config.stream is False
    assert config.server_args == ("--model", "/m", "--mm-inflight-budget", "1024")
    assert config.start_command(1234) == [sys.executable, "-m", "flatserve.cli", "serve",
                                          "--port", "1234", "--model", "/m",
                                          "--mm-inflight-budget", "1024"]


def test_duration_alone_means_no_request_limit():
    config = parse_args(["--duration-min", "0.5"])
    assert config.requests is None and config.duration_s == 30.0


def test_attach_options():
    config = parse_args(["--url", "http://127.0.0.1:8000/", "--pid", "10", "11", "--pid", "12",
                         "--allow-status", "429", "503", "--extra-body", '{"ignore_eos": true}'])
    assert config.url == "http://127.0.0.1:8000"
    assert config.pids == (10, 11, 12)
    assert config.allow_status == (429, 503)
    assert config.extra_body == {"ignore_eos": True}


@pytest.mark.parametrize("argv", [
    ["--concurrency", "0"],
    ["--disconnect-share", "1.5"],
    ["--warmup-share", "1"],
    ["--pid", "5"],  # pids without url
    ["--url", "http://x", "--", "--model", "m"],  # passthrough with url
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2


def test_config_is_validated_in_code_too():
    with pytest.raises(ValueError):
        SoakConfig(requests=0)


def test_byte_sizes():
    assert parse_bytes("2147483648") == 2 << 30
    assert parse_bytes("2GiB") == 2 << 30
    assert parse_bytes("512M") == 512 << 20
    assert parse_bytes("1.5k") == 1536
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_passthrough_value_forms():
    args = ("--a", "1", "--mm-inflight-budget=5", "--port", "9")
    assert passthrough_value(args, "--mm-inflight-budget") == "5"
    assert passthrough_value(args, "--port") == "9"
    assert passthrough_value(args, "--host") is None
