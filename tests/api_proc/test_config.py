from __future__ import annotations

import argparse
import dataclasses

import pytest

from api_proc.config import ApiConfig


def test_defaults_and_derived_values(tiny_model_path):
    config = ApiConfig(model=str(tiny_model_path))
    assert config.served_model_name == (tiny_model_path.name,) and config.model_name == tiny_model_path.name
    assert config.api_key is None and config.allowed_local_media_path is None
    assert config.allowed_media_domains is None
    assert 1 <= config.num_media_workers <= 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1


@pytest.mark.parametrize("kw, match", [
    ({"model": ""}, "model"),
    ({"model": "/no/such/folder"}, "not a folder"),
    ({"port": 70000}, "port"),
    ({"api_key": ""}, "api_key"),
    ({"max_image_bytes": 0}, "max_image_bytes"),
    ({"mm_inflight_budget": -1}, "mm_inflight_budget"),
    ({"admission_timeout_s": 0}, "admission_timeout_s"),
    ({"allowed_local_media_path": "/no/such/folder"}, "allowed_local_media_path"),
    ({"allowed_media_domains": ("ok.com", " ")}, "empty"),
    ({"engine_addresses": ("http://x",)}, "engine address"),
    ({"chat_template": "/no/such/file.jinja"}, "chat_template"),
    ({"tool_call_parser": "mistral"}, "tool_call_parser must be one of hermes, qwen3_coder"),
    ({"reasoning_parser": "granite"}, "reasoning_parser must be one of deepseek_r1, qwen3"),
    ({"default_chat_template_kwargs": '{"tools": []}'},
     "default_chat_template_kwargs: tools cannot be set"),
    ({"default_chat_template_kwargs": "[1]"}, "is not a JSON object"),
    ({"enable_auto_tool_choice": True}, "needs tool_call_parser"),
])
def test_validation(tiny_model_path, kw, match):
    kw.setdefault("model", str(tiny_model_path))
    with pytest.raises(ValueError, match=match):
        ApiConfig(**kw)


def test_normalization(tiny_model_path, tmp_path):
    config = ApiConfig(model=str(tiny_model_path), allowed_media_domains=["Images.Example.COM."],
                       allowed_local_media_path=str(tmp_path / ".." / tmp_path.name),
                       engine_addresses=["ipc:///tmp/x.sock"])
    assert config.allowed_media_domains == ("images.example.com",)
    assert config.allowed_local_media_path == str(tmp_path.resolve())
    assert config.engine_addresses == ("ipc:///tmp/x.sock",)


def test_cli_defaults_come_from_the_dataclass(tiny_model_path):
    parser = ApiConfig.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", str(tiny_model_path)])
    assert ApiConfig.from_cli_args(args) == ApiConfig(model=str(tiny_model_path))
    args = parser.parse_args([
        "--model", str(tiny_model_path), "--port", "9001", "--api-key", "k",
        "--allowed-media-domains", "a.com", "b.com", "--allow-private-media-addresses",
        "--admission-timeout-s", "2.5", "--engine-addresses", "ipc:///tmp/e0.sock"])
    config = ApiConfig.from_cli_args(args, served_model_name="m")
    assert (config.port, config.api_key, config.model_name) == (9001, "k", "m")
    assert config.allowed_media_domains == ("a.com", "b.com")
    assert config.allow_private_media_addresses is True
    assert config.admission_timeout_s == 2.5
    assert config.engine_addresses == ("ipc:///tmp/e0.sock",)


def test_parsers_and_template_defaults_from_the_command_line(tiny_model_path, capsys):
    parser = ApiConfig.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", str(tiny_model_path), "--reasoning-parser", "qwen3",
                              "--tool-call-parser", "qwen3_coder", "--enable-auto-tool-choice",
                              "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    config = ApiConfig.from_cli_args(args)
    assert (config.reasoning_parser, config.tool_call_parser) == ("qwen3", "qwen3_coder")
    assert config.template_defaults == {"enable_thinking": False}
    assert ApiConfig(model=str(tiny_model_path)).template_defaults == {}
    for argv, says in [(["--reasoning-parser", "granite"], "invalid choice: 'granite'"),
                       (["--default-chat-template-kwargs", '{"messages": 1}'],
                        "messages cannot be set")]:
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert says in capsys.readouterr().err


@pytest.mark.parametrize("kw, match", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"torch_threads": -1}, "torch_threads"),
    ({"engine_nice": 20}, "engine_nice"),
    ({"engine_nice": -1}, "engine_nice"),
])
def test_bad_engine_settings_are_refused(kw, match):
    from shared.engine_config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig(model="m", **kw)
