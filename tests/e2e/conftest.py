from __future__ import annotations

import pytest

from tests.e2e.server_process import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_path):
    proc = ServerProcess(log_path=tmp_path_factory.mktemp("server") / "server.log")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()
