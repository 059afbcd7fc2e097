"""CURVE keys: the folder `flatserve keys` writes, which addresses need keys, and a real
EngineServer over tcp:// that serves the right key and refuses every wrong one (its busy
loop never hears of them), with the API side saying why within its liveness timeout."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import sys
import time

import pytest
import zmq

from api_proc.engine_client import NOT_CONNECTED, EngineConnection
from rpc.curve import (
    KeyFileError,
    check_plain_tcp,
    is_loopback,
    load_client_keys,
    load_server_keys,
    write_keys,
)
from rpc.engine_server import EngineServer
from shared.messages import AbortRequests, EngineStats

STATS = EngineStats(0, 0, 10, 10, 0, 0, 3)
FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret",
         "authorized/client.key")


@pytest.fixture
def keys(tmp_path):
    write_keys(tmp_path / "keys")
    return tmp_path / "keys"


@pytest.fixture
def server(keys):
    srv = EngineServer("tcp://127.0.0.1:*", max_requests=3, keys=load_server_keys(keys))
    srv.stats = STATS
    srv.start()
    yield srv
    srv.stop()


def test_the_key_folder(tmp_path):
    written = write_keys(tmp_path / "k")
    assert sorted(str(p.relative_to(tmp_path / "k")) for p in written) == sorted(FILES)
    assert stat.S_IMODE(os.stat(tmp_path / "k").st_mode) == 0o700
    for name in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE(os.stat(tmp_path / "k" / name).st_mode) == 0o600
    server, client = load_server_keys(tmp_path / "k"), load_client_keys(tmp_path / "k")
    assert server.authorized == {client.public} and client.server_public == server.public
    assert not [p for p in (tmp_path / "k").iterdir() if p.name.startswith(".")]
    with pytest.raises(KeyFileError, match="exists: keys are never replaced without --force"):
        write_keys(tmp_path / "k")
    write_keys(tmp_path / "k", force=True)
    assert load_client_keys(tmp_path / "k").public != client.public


def test_keys_command_refuses_to_overwrite(tmp_path):
    command = [sys.executable, "-m", "flatserve.cli", "keys", "--dir", str(tmp_path / "k")]
    first = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0 and "client.key_secret" in first.stdout
    again = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        f"flatserve keys: {tmp_path / 'k' / 'server.key'} exists: keys are never replaced "
        "without --force"]


@pytest.mark.parametrize("broken, says", [
    (lambda k: (k / "server.key_secret").unlink(), "server.key_secret is missing"),
    (lambda k: os.chmod(k / "server.key_secret", 0o644), "chmod 600"),
    (lambda k: shutil.rmtree(k / "authorized"), "authorized is missing"),
    (lambda k: (k / "authorized" / "client.key").unlink(), "holds no *.key file"),
    (lambda k: (k / "server.key_secret").write_text("curve\n  public-key = \"x\"\n"),
     "not a CURVE key"),
])
def test_unusable_server_keys_are_named(keys, broken, says):
    broken(keys)
    with pytest.raises(KeyFileError) as e:
        load_server_keys(keys)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("address, loopback", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.3.2.1:5555", True), ("tcp://[::1]:5555", True),
    ("tcp://localhost:5555", True), ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False),
    ("tcp://10.0.0.5:5555", False), ("tcp://eth0:5555", False), ("tcp://gpu-host:5555", False),
    ("tcp://127.0.0.1;10.0.0.5:5555", False),
])
def test_which_addresses_are_loopback(address, loopback):
    assert is_loopback(address) is loopback


def test_plain_tcp_beyond_loopback_needs_insecure():
    check_plain_tcp("ipc:///tmp/x.sock", insecure=False)
    check_plain_tcp("tcp://127.0.0.1:5555", insecure=False)
    check_plain_tcp("tcp://0.0.0.0:5555", insecure=True)
    with pytest.raises(ValueError, match="not a loopback address: give --curve-key-dir"):
        check_plain_tcp("tcp://0.0.0.0:5555", insecure=False)


def _mixed(tmp_path, client_from, server_from):
    """A key folder with one folder's client pair and another's server key."""
    mixed = tmp_path / "mixed"
    mixed.mkdir(mode=0o700)
    for name in ("client.key", "client.key_secret"):
        shutil.copy2(client_from / name, mixed / name)
    shutil.copy2(server_from / "server.key", mixed / "server.key")
    return mixed


async def _connect(address, keys_dir) -> EngineConnection:
    keys = load_client_keys(keys_dir) if keys_dir else None
    connection = EngineConnection(address, heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5,
                                  keys=keys)
    connection.open()
    deadline = time.monotonic() + 5
    while connection.lost_reason == NOT_CONNECTED and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return connection


def test_the_right_key_is_served(server, keys):
    async def main():
        connection = await _connect(server.address, keys)
        try:
            assert connection.available and connection.stats == STATS
            connection.send(AbortRequests(["x"]))
        finally:
            await connection.close()
    asyncio.run(main())
    deadline = time.monotonic() + 2
    while not (got := server.take_commands()) and time.monotonic() < deadline:
        server.wait_for_commands(0.05)
    assert got == [AbortRequests([])]  # heard (the id was not its to abort)


@pytest.mark.parametrize("wrong, says", [
    ("client", "the engine refused our key (ZAP status 400)"),
    ("server", "CURVE handshake failed: the engine's key is not our server.key"),
    ("none", "the engine requires CURVE keys"),
])
def test_a_wrong_key_is_refused_and_said(server, keys, tmp_path, wrong, says):
    other = tmp_path / "other"
    write_keys(other)
    keys_dir = {"client": lambda: _mixed(tmp_path, other, keys),
                "server": lambda: _mixed(tmp_path, keys, other), "none": lambda: None}[wrong]()

    async def main():
        connection = await _connect(server.address, keys_dir)
        try:
            assert not connection.available and says in connection.lost_reason
            assert not connection.send(AbortRequests(["x"]))  # no connection to queue on
        finally:
            await connection.close()
    asyncio.run(main())
    server.wait_for_commands(0.2)
    assert server.take_commands() == []


def test_a_plain_server_refuses_a_keyed_client(keys):
    srv = EngineServer("tcp://127.0.0.1:*", max_requests=3)
    srv.stats = STATS
    srv.start()
    try:
        async def main():
            connection = await _connect(srv.address, keys)
            try:
                assert "takes no" in connection.lost_reason
            finally:
                await connection.close()
        asyncio.run(main())
    finally:
        srv.stop()


def test_a_silent_address_says_unreachable_or_refused():
    with zmq.Context.instance().socket(zmq.ROUTER) as hole:  # bound, never answers
        port = hole.bind_to_random_port("tcp://127.0.0.1")

        async def main():
            connection = EngineConnection(f"tcp://127.0.0.1:{port}", heartbeat_interval_s=0.05,
                                          heartbeat_timeout_s=0.3)
            connection.open()
            await asyncio.sleep(0.6)
            try:
                assert connection.lost_reason == ("no answer to pings since connecting: the "
                                                  "engine is unreachable")
            finally:
                await connection.close()
        asyncio.run(main())
