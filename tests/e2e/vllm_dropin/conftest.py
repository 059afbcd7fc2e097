"""One `flatserve serve` for every test of this folder (vLLM drop-in behaviour, issue 31):
started once per package, with the vLLM flags these tests exercise, so the folder adds one
server start to the suite, not one per file."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.server_process import ServerProcess

MODEL = "flatserve-tiny-qwen2.5-vl"
FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-server-load-tracking")


@pytest.fixture(scope="package")
def dropin_server(tmp_path_factory, tiny_model_path):
    proc = ServerProcess(*FLAGS, log_path=tmp_path_factory.mktemp("dropin") / "server.log")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="package")
def oai(dropin_server):
    return openai.OpenAI(base_url=dropin_server.url + "/v1", api_key="unused", max_retries=0)
