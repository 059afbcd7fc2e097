"""Engines on other hosts: a real `flatserve engine` with CURVE keys, reached by real API
sides with the right key (served) and wrong ones (refused, and told why); a bind or an engine
address beyond loopback without keys is refused before any process starts. Across two
network namespaces (a veth pair between them) where this machine permits them."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from rpc.curve import write_keys
from tests.e2e.server_process import REPO, ServerProcess, free_port

ENGINE_FLAGS = ("--max-num-seqs", "4", "--kv-cache-memory-bytes", str(64 << 20))
NETNS = ("unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child",
         "--mount-proc")


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flatserve.cli", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def mixed_keys(folder, client_from, server_from):
    """A key folder with one folder's client pair and another's server key."""
    folder.mkdir(mode=0o700)
    for name in ("client.key", "client.key_secret"):
        shutil.copy2(client_from / name, folder / name)
    shutil.copy2(server_from / "server.key", folder / "server.key")
    return folder


@pytest.fixture(scope="module")
def key_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    good, other = root / "good", root / "other"
    write_keys(good)
    write_keys(other)
    return {"good": good, "wrong client": mixed_keys(root / "wrong", other, good)}


@pytest.fixture(scope="module")
def engine(key_dirs, tiny_model_path, tmp_path_factory):
    address = f"tcp://127.0.0.1:{free_port()}"
    log_path = tmp_path_factory.mktemp("engine") / "engine.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "flatserve.cli", "engine", "--address", address,
             "--curve-key-dir", str(key_dirs["good"]), *ENGINE_FLAGS], cwd=REPO,
            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "ready on" not in log_path.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        yield address, log_path
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_the_right_key_is_served_over_http(engine, key_dirs, tmp_path):
    address, _ = engine
    server = ServerProcess("--engine-addresses", address, "--curve-key-dir",
                           str(key_dirs["good"]), log_path=tmp_path / "api.log")
    try:
        server.wait_ready()
        reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    finally:
        server.stop()


def test_a_wrong_key_is_refused_and_health_says_so(engine, key_dirs, tmp_path):
    address, engine_log = engine
    server = ServerProcess("--engine-addresses", address, "--curve-key-dir",
                           str(key_dirs["wrong client"]), log_path=tmp_path / "api.log")
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.process.poll() is None, server.log_tail()
            try:
                health = httpx.get(server.url + "/health", timeout=1)
                if "refused our key" in health.text:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.2)
        assert health.status_code == 503
        reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert reply.status_code == 503 and "refused our key" in reply.text
    finally:
        server.stop()
    assert "refused a connection whose key" in engine_log.read_text()


def test_plain_tcp_beyond_loopback_is_refused_before_any_process_starts(tmp_path):
    engine = run_cli("engine", "--address", "tcp://0.0.0.0:5555")
    assert engine.returncode == 2
    assert engine.stderr.strip().splitlines() == [
        "flatserve engine: tcp://0.0.0.0:5555 is not a loopback address: give --curve-key-dir "
        "DIR (flatserve keys --dir DIR writes one) or --insecure for unauthenticated, "
        "unencrypted traffic"]
    serve = run_cli("serve", "--engine-addresses", "tcp://10.1.2.3:5555")
    assert serve.returncode == 2 and len(serve.stderr.strip().splitlines()) == 1
    assert "tcp://10.1.2.3:5555 is not a loopback address" in serve.stderr
    missing = run_cli("serve", "--engine-addresses", "tcp://10.1.2.3:5555", "--curve-key-dir",
                      str(tmp_path / "none"))
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert "is not a folder of CURVE keys" in missing.stderr
    (tmp_path / "half").mkdir()
    half = run_cli("engine", "--address", "tcp://0.0.0.0:5555", "--curve-key-dir",
                   str(tmp_path / "half"))
    assert half.returncode == 2
    assert half.stderr.strip().splitlines() == [
        f"flatserve engine: {tmp_path / 'half' / 'server.key_secret'} is missing"]


def test_insecure_allows_plain_tcp_beyond_loopback():
    from api_proc.config import ApiConfig
    from shared.engine_config import EngineConfig

    EngineConfig(address="tcp://0.0.0.0:5555", insecure=True)
    ApiConfig(model=str(REPO), engine_addresses=("tcp://10.1.2.3:5555",), insecure=True)


# ---- two network namespaces ---------------------------------------------------------------

ENGINE_IP, CLIENT_IP = "10.231.0.1", "10.231.0.2"
NETNS_SCRIPT = r"""
set -eu
ip link set lo up
ip link add fs-eng type veth peer name fs-cli
ip addr add {engine_ip}/24 dev fs-eng
ip link set fs-eng up
unshare --net sleep 300 &   # holds the client's namespace
holder=$!
while [ "$(readlink /proc/$holder/ns/net)" = "$(readlink /proc/self/ns/net)" ]; do sleep 0.01; done
ip link set fs-cli netns $holder
in_client="nsenter --net=/proc/$holder/ns/net"
$in_client sh -c 'ip link set lo up; ip addr add {client_ip}/24 dev fs-cli; ip link set fs-cli up'
address=tcp://{engine_ip}:5555
plain=$({python} -m flatserve.cli engine --address $address 2>&1) && rc=0 || rc=$?
echo "plain bind: rc=$rc $plain"
{python} -m flatserve.cli engine --address $address --curve-key-dir {good} {engine_flags} \
    > {engine_log} 2>&1 &
engine=$!
for _ in $(seq 1200); do
    grep -q "ready on" {engine_log} && break
    kill -0 $engine
    sleep 0.1
done
for keys in {good} {wrong} {other} ""; do
    echo "client $keys: $($in_client {python} -m tests.e2e.remote_client $address $keys)"
done
kill $engine
wait $engine || true
"""


@functools.cache
def netns_refusal() -> str | None:
    """Why two network namespaces with a veth pair cannot be made here (None: they can)."""
    if not all(shutil.which(tool) for tool in ("unshare", "nsenter", "ip")):
        return "needs unshare, nsenter and ip (util-linux, iproute2)"
    try:
        probe = subprocess.run(
            [*NETNS, "sh", "-c", "ip link add fs-a type veth peer name fs-b && "
             "unshare --net true"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"namespace probe failed: {e}"
    if probe.returncode != 0:
        return f"unprivileged user and network namespaces are not permitted here: " \
               f"{probe.stderr.strip()[-200:]}"
    return None


def test_keys_across_two_network_namespaces(key_dirs, tiny_model_path, tmp_path):
    """The engine binds a veth address in one namespace; clients in the other reach it only
    through the pair: the right key is served, a client key not in authorized/, another
    server key and no key at all are refused, and the engine never hears their messages."""
    reason = netns_refusal()
    if reason is not None:
        pytest.skip(reason)
    other = tmp_path / "other"
    write_keys(other)
    script = NETNS_SCRIPT.format(
        engine_ip=ENGINE_IP, client_ip=CLIENT_IP, python=sys.executable, good=key_dirs["good"],
        wrong=key_dirs["wrong client"], other=other, engine_flags=" ".join(ENGINE_FLAGS),
        engine_log=tmp_path / "engine.log")
    done = subprocess.run([*NETNS, "bash", "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=240)
    engine_log = (tmp_path / "engine.log").read_text() if (tmp_path / "engine.log").exists() \
        else ""
    assert done.returncode == 0, done.stdout + done.stderr + engine_log
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert lines["plain bind"].startswith("rc=2 ") and "not a loopback" in lines["plain bind"]
    outcomes = {k: json.loads(lines[f"client {v}"]) for k, v in
                (("good", key_dirs["good"]), ("wrong", key_dirs["wrong client"]),
                 ("other", other), ("none", ""))}
    assert outcomes["good"]["ok"] and len(outcomes["good"]["tokens"]) == 4, outcomes
    assert "refused our key" in outcomes["wrong"]["reason"], outcomes
    assert "not our server.key" in outcomes["other"]["reason"], outcomes
    assert "requires CURVE keys" in outcomes["none"]["reason"], outcomes
    assert f"ready on tcp://{ENGINE_IP}:5555" in engine_log
    assert engine_log.count("refused a connection whose key") == 1, engine_log
