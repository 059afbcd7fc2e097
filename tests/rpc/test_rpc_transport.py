"""ipc:// socket files live in a private 0700 directory removed on close; address checks."""

from __future__ import annotations

import os
import stat

import pytest

from rpc import Codec, IpcDir, RpcClient, RpcServer, new_ipc_address
from rpc.transport import check_address


async def test_ipc_dir_is_private_and_removed_on_close(codec: Codec) -> None:
    with IpcDir() as d:
        assert stat.S_IMODE(os.stat(d.path).st_mode) == 0o700
        address = d.address("engine-0")
        assert address == f"ipc://{d.path}/engine-0.sock"
        server = RpcServer(address, codec)
        server.register_unary("ping", _ping)
        await server.start()
        client = RpcClient(address, codec)
        assert await client.call("ping") == "pong"
        await client.close()
        assert os.path.exists(address[len("ipc://"):])
        await server.close()
        assert not os.path.exists(address[len("ipc://"):])  # the socket file went with it
        path = d.path
    assert not os.path.exists(path)


async def _ping() -> str:
    return "pong"


def test_new_ipc_address_uses_a_private_process_directory() -> None:
    a, b = new_ipc_address("a"), new_ipc_address("b")
    assert a != b and os.path.dirname(a) == os.path.dirname(b)
    directory = os.path.dirname(a[len("ipc://"):])
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700


@pytest.mark.parametrize("name", ["", "a/b", "../up", "x" * 200, "sp ace"])
def test_bad_ipc_names(name: str) -> None:
    with IpcDir() as d, pytest.raises(ValueError):
        d.address(name)


@pytest.mark.parametrize("address", ["http://x", "ipc://" + "/x" * 60, "tcp:/oops", ""])
def test_bad_addresses(address: str) -> None:
    with pytest.raises(ValueError):
        check_address(address)
