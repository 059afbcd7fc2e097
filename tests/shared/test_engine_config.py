"""EngineConfig's command-line flags."""

from __future__ import annotations

import argparse

from flatserve.cli import build_serve_parser
from shared.config_args import add_dataclass_args, dataclass_from_args
from shared.engine_config import EngineConfig


def test_prefix_caching_is_on_by_default_and_both_flags_work():
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, EngineConfig)
    assert dataclass_from_args(EngineConfig, parser.parse_args([])).enable_prefix_caching
    off = dataclass_from_args(EngineConfig, parser.parse_args(["--no-enable-prefix-caching"]))
    on = dataclass_from_args(EngineConfig, parser.parse_args(["--enable-prefix-caching"]))
    assert not off.enable_prefix_caching and on.enable_prefix_caching
    assert not EngineConfig.from_json(off.to_json()).enable_prefix_caching


def test_serve_passes_the_flag_to_its_engines():
    args = build_serve_parser(argparse.ArgumentParser()).parse_args(["--no-enable-prefix-caching"])
    assert args.enable_prefix_caching is False
