from __future__ import annotations

import pytest

from tests.e2e.server_process import ServerProcess


@pytest.fixture(scope="package")
def server(tmp_path_factory, tiny_model_path):
    """The default model served, one server for every test of tests/e2e that only sends it
    requests and reads what it answers (a test that stops, pauses or reconfigures a server
    starts its own); file:// media URLs may read from `server.media_dir`."""
    media = tmp_path_factory.mktemp("media")
    proc = ServerProcess("--allowed-local-media-path", str(media),
                         log_path=tmp_path_factory.mktemp("server") / "server.log")
    proc.media_dir = media
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()
