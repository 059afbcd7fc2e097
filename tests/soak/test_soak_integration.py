"""The soak against a real OpenAI-compatible server process (tests/soak/fake_server.py): it
passes on a flat server and fails on one that leaks per request (R5)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from flatserve.soak import SoakConfig, main, run_soak
from flatserve.soak.server import free_port

FAKE_SERVER = str(Path(__file__).with_name("fake_server.py"))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def config(tmp_path, *server_args, **overrides) -> SoakConfig:
    values = dict(requests=240, concurrency=4, image_size=64, max_tokens=4, interval_s=0.05,
                  max_slope=20.0, disconnect_share=0.2, out=str(tmp_path), progress=False,
                  server_command=(sys.executable, FAKE_SERVER, "serve"),
                  server_args=tuple(server_args), server_timeout_s=30.0)
    values.update(overrides)
    return SoakConfig(**values)


def test_flat_server_passes_and_is_stopped(tmp_path):
    summary = run_soak(config(tmp_path, "--engines", "1"))
    assert summary.passed, summary.reasons
    assert [p.role for p in summary.processes] == ["api", "engine 0"]
    assert summary.requests == 240 and summary.errors == 0 and summary.disconnects > 0
    assert summary.budget_mb == 64.0  # read from the server's /metrics
    for name in ("samples.csv", "rss.png", "summary.json"):
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "server.log").exists()
    for p in summary.processes:
        assert not psutil.pid_exists(p.pid) or psutil.Process(p.pid).status() == "zombie"


def test_leaking_server_fails(tmp_path):
    summary = run_soak(config(tmp_path, "--leak-kb", "256", requests=160, stream=False))
    assert not summary.passed
    api = summary.process("api")
    assert api.slope_mb_per_1k > 100  # 256 KiB per request is 250 MB per 1,000
    assert any(r.startswith("api: RSS grows") for r in summary.reasons)
    assert summary.errors == 0


def test_unexpected_errors_fail_the_run(tmp_path):
    summary = run_soak(config(tmp_path, "--fail-every", "25", requests=100))
    assert not summary.passed
    assert summary.errors == 4 and summary.errors_by_kind == {"HTTP 500": 4}
    assert "injected failure" in summary.error_messages[0]


@pytest.fixture
def running_server():
    port = free_port()
    process = subprocess.Popen([sys.executable, FAKE_SERVER, "serve", "--port", str(port),
                                "--engines", "1"], start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
        yield url, process.pid
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_attach_with_pids_from_the_command_line(tmp_path, running_server, capsys):
    url, pid = running_server
    engine = psutil.Process(pid).children()[0].pid
    code = main(["--url", url, "--pid", str(pid), str(engine), "--requests", "200",
                 "--concurrency", "4", "--image-size", "48", "--images-per-request", "2",
                 "--no-stream", "--max-tokens", "4", "--interval", "0.05", "--max-slope", "20",
                 "--out", str(tmp_path / "run"), "--json", str(tmp_path / "s.json"),
                 "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads((tmp_path / "s.json").read_text())
    assert [(p["role"], p["pid"]) for p in data["processes"]] == [("api", pid),
                                                                  ("engine 0", engine)]
    assert data["passed"] and data["requests"] == 200 and data["config"]["stream"] is False
    assert "PASSED" in out and "engine 0" in out


def test_sigterm_stops_the_soak_and_the_server_it_started(tmp_path):
    soak = subprocess.Popen(
        [sys.executable, "-m", "flatserve.cli", "soak", "--requests", "100000", "--concurrency",
         "2", "--image-size", "48", "--max-tokens", "4", "--interval", "0.05", "--no-progress",
         "--out", str(tmp_path), "--server-command", f"{sys.executable} {FAKE_SERVER} serve",
         "--", "--engines", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    server: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 30
        while len(server) < 2:  # the api and its engine are up
            assert soak.poll() is None and time.monotonic() < deadline, "no server started"
            server = psutil.Process(soak.pid).children(recursive=True)
            time.sleep(0.1)
        time.sleep(2.0)  # some load
        soak.send_signal(signal.SIGTERM)
        out = soak.communicate(timeout=30)[0].decode()
        # results kept; 2 s of load may judge a slope too (or too few samples to fit one)
        assert soak.returncode == 130 and re.search(r"^FAILED: .*interrupted$", out, re.M), out
        assert (tmp_path / "summary.json").exists()
        _, alive = psutil.wait_procs(server, timeout=10)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], out
    finally:  # never leave a load generator or server behind when the test fails
        for p in [*server, psutil.Process(soak.pid)] if soak.poll() is None else server:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        soak.wait()
