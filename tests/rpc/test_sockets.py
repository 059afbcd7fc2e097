"""ipc:// socket files live in a private 0700 directory removed on close; address checks."""

from __future__ import annotations

import os
import stat

import pytest

from rpc.engine_server import EngineServer
from rpc.sockets import IpcDir, check_address, new_ipc_address


def test_ipc_dir_is_private_and_the_socket_file_goes_with_the_server() -> None:
    with IpcDir() as d:
        assert stat.S_IMODE(os.stat(d.path).st_mode) == 0o700
        address = d.address("engine-0")
        assert address == f"ipc://{d.path}/engine-0.sock"
        server = EngineServer(address, max_requests=4)
        server.start()
        assert os.path.exists(address[len("ipc://"):])
        server.stop()
        assert not os.path.exists(address[len("ipc://"):])
        path = d.path
    assert not os.path.exists(path)


def test_an_address_in_use_fails_at_start() -> None:
    first = EngineServer("tcp://127.0.0.1:*", max_requests=4)
    first.start()
    try:
        assert first.address.startswith("tcp://127.0.0.1:") and not first.address.endswith("*")
        with pytest.raises(OSError, match="cannot bind"):
            EngineServer(first.address, max_requests=4).start()
    finally:
        first.stop()


def test_new_ipc_address_uses_a_private_process_directory() -> None:
    a, b = new_ipc_address("a"), new_ipc_address("b")
    assert a != b and os.path.dirname(a) == os.path.dirname(b)
    directory = os.path.dirname(a[len("ipc://"):])
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700


@pytest.mark.parametrize("name", ["", "a/b", "../up", "x" * 200, "sp ace"])
def test_bad_ipc_names(name: str) -> None:
    with IpcDir() as d, pytest.raises(ValueError):
        d.address(name)


@pytest.mark.parametrize("address", ["http://x", "ipc://" + "/x" * 60, "tcp:/oops", "",
                                     "inproc://x"])
def test_bad_addresses(address: str) -> None:
    with pytest.raises(ValueError):
        check_address(address)
