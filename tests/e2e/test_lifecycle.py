"""Process lifecycle through a real `flatserve serve`: errors keep the server serving, a
client that disconnects aborts its request in the engine, a dead engine is reported, and
Ctrl-C leaves no process or socket file behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import psutil
import pytest

from api_proc.engine_client import EngineConnection
from tests.e2e.server_process import ServerProcess

MODEL = "flatserve-tiny-qwen2.5-vl"


def _chat(url: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=30, **kw)


def _engine_stats(address: str):
    """The stats a second API process would see: an engine answers any peer's ping."""
    async def go():
        connection = EngineConnection(address)
        connection.open()
        try:
            await connection.wait_ready(5)
            return connection.stats
        finally:
            await connection.close()

    return asyncio.run(go())


def test_bad_requests_get_openai_errors_and_server_keeps_serving(server):
    cases = [
        ({"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404),
        ({"messages": "not a list"}, 400),
        ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}]}]}, 400),
        ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]}, 400),
        ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}}]}]}, 400),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**7}, 400),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400),
    ]
    for body, status in cases:
        r = _chat(server.url, {"max_tokens": 2, **body})
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["message"] and error["type"]
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert _chat(server.url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_huge_text_prompt_is_refused_untokenized_and_its_memory_goes_back(server, path):
    api = psutil.Process(server.process.pid)
    assert _chat(server.url, {"messages": [{"role": "user", "content": "warm"}],
                              "max_tokens": 2}).status_code == 200
    idle = api.memory_info().rss
    text = "word " * 2_000_000  # 10 MB: tokenized, it took ~100 MB per MB of text
    prompt = {"prompt": text} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": text}]}
    r = httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 2, **prompt},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "characters" in r.json()["error"]["message"]
    assert api.memory_info().rss - idle < 20 << 20


def test_client_disconnect_aborts_the_request_in_the_engine(server):
    address = httpx.get(server.url + "/health").json()["engines"][0]["address"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "tell me everything"}],
            "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = _engine_stats(address)
        if stats.num_running == 0 and stats.num_waiting == 0:
            break
        time.sleep(0.1)
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total


def test_engine_killed_mid_stream_fails_cleanly_and_health_says_so(tmp_path):
    proc = ServerProcess("--max-engine-restarts", "0", log_path=tmp_path / "server.log")
    proc.wait_ready()
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}],
                "max_tokens": 4000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", proc.url + "/v1/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(proc.engine_pids()[0], signal.SIGKILL)
            rest = "\n".join(lines)
        assert '"error"' in rest  # the stream ends with an error event, not a hang
        health = httpx.get(proc.url + "/health", timeout=5)
        assert health.status_code == 503
        assert "exited" in health.text or "unavailable" in health.text
        r = _chat(proc.url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"]["message"]
    finally:
        proc.stop()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stop_leaves_no_process_or_socket_file(tmp_path, sig):
    proc = ServerProcess(log_path=tmp_path / "server.log").wait_ready()
    engines = proc.engine_pids()
    assert engines
    assert psutil.Process(engines[0]).cmdline()[0] == "flatserve: engine 0"
    socket_file = httpx.get(proc.url + "/health").json()["engines"][0]["address"][len("ipc://"):]
    assert os.path.exists(socket_file)
    assert proc.stop(sig) == 0
    time.sleep(0.5)
    for pid in engines:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not os.path.exists(os.path.dirname(socket_file)), proc.log_tail()


def test_sigterm_drains_then_ends_what_runs_on_with_an_error(tmp_path):
    # vLLM's flag name; a generation far longer than the drain is cut with an error event
    proc = ServerProcess("--shutdown-timeout", "1", log_path=tmp_path / "server.log").wait_ready()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}],
            "max_tokens": 4000, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", proc.url + "/v1/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            proc.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert '"code":"server_shutting_down"' in rest[-2].replace(" ", "")
        assert proc.process.wait(timeout=30) == 0
        assert "requests still running after 1 s aborted" in proc.log_tail(), proc.log_tail()
    finally:
        proc.stop()


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _wait_until(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_dead_engine_is_restarted_and_its_gauges_zeroed(tmp_path):
    proc = ServerProcess(log_path=tmp_path / "server.log").wait_ready()
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}],
                "max_tokens": 4000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", proc.url + "/v1/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            _wait_until(lambda: _metric(proc.url, "vllm:num_requests_running") == 1,
                        "the engine never reported the request running")
            dead = proc.engine_pids()[0]
            os.kill(dead, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert sum('"error"' in line for line in rest) == 1  # failed once, then [DONE]
        assert rest[-1] == "data: [DONE]"
        # the dead engine's last figures are gone at once, not shown as if it were busy
        assert _metric(proc.url, "vllm:num_requests_running") == 0
        _wait_until(lambda: httpx.get(proc.url + "/health", timeout=5).status_code == 200,
                    "the engine was not restarted:\n" + proc.log_tail())
        assert _metric(proc.url, "flatserve_engine_restarts_total") == 1
        assert proc.engine_pids() and dead not in proc.engine_pids()
        assert _chat(proc.url, {"messages": [{"role": "user", "content": "again"}],
                                "max_tokens": 2}).status_code == 200
    finally:
        proc.stop()


def test_an_engine_that_cannot_come_back_stops_the_server_non_zero(tmp_path, tiny_model_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    proc = ServerProcess("--model", str(model), "--served-model-name", MODEL,
                         "--max-engine-restarts", "1", log_path=tmp_path / "server.log")
    proc.wait_ready()
    try:
        for weights in model.glob("*.safetensors"):
            weights.unlink()  # a restarted engine cannot load
        os.kill(proc.engine_pids()[0], signal.SIGKILL)
        assert proc.process.wait(timeout=120) == 1, proc.log_tail()
        assert "1 restarts in a row failed" in proc.log_tail(), proc.log_tail()
    finally:
        proc.stop()


def test_engine_restarts_can_be_turned_off(tmp_path):
    proc = ServerProcess("--max-engine-restarts", "0", log_path=tmp_path / "server.log")
    proc.wait_ready()
    try:
        os.kill(proc.engine_pids()[0], signal.SIGKILL)
        _wait_until(lambda: httpx.get(proc.url + "/health", timeout=5).status_code == 503,
                    "the dead engine was not noticed")
        time.sleep(2)  # longer than the first backoff: a restart would have begun
        assert proc.engine_pids() == [] and proc.process.poll() is None
        assert _metric(proc.url, "flatserve_engine_restarts_total") == 0
    finally:
        proc.stop()


def _pending_signals(pid: int) -> int:
    """The signals pending for a process (its /proc status ShdPnd mask)."""
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("ShdPnd:"))
    return int(line.split()[1], 16)


def test_a_second_ctrl_c_kills_an_engine_slow_to_stop(tmp_path):
    proc = ServerProcess(log_path=tmp_path / "server.log").wait_ready()
    engine = proc.engine_pids()[0]
    socket_file = httpx.get(proc.url + "/health").json()["engines"][0]["address"][len("ipc://"):]
    os.kill(engine, signal.SIGSTOP)  # an engine that does not stop when asked
    try:
        proc.process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 20
        while not _pending_signals(engine) & (1 << (signal.SIGTERM - 1)):
            assert time.monotonic() < deadline, "the launcher never asked the engine to stop"
            time.sleep(0.05)
        proc.process.send_signal(signal.SIGINT)  # the second Ctrl-C
        assert proc.stop(timeout=20) == 0, proc.log_tail()
        assert not psutil.pid_exists(engine) or \
            psutil.Process(engine).status() == psutil.STATUS_ZOMBIE, proc.log_tail()
        assert not os.path.exists(os.path.dirname(socket_file)), proc.log_tail()
        assert "SIGINT while stopping: killing the engines" in proc.log_tail()
    finally:
        if psutil.pid_exists(engine):
            os.kill(engine, signal.SIGKILL)


def test_two_engines_share_the_load(tmp_path):
    # the engines split the host's cores between them instead of each taking all of them
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    log = tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = ServerProcess("--engines", "2", log_path=log, env=env).wait_ready()
    try:
        engines = httpx.get(proc.url + "/health").json()["engines"]
        assert len(engines) == 2 and all(e["ok"] for e in engines)
        # not niced by default (--engine-nice): a niced engine's OpenMP threads wait on
        # each other whenever the API or a client takes one's core
        nice = psutil.Process().nice()
        assert [psutil.Process(pid).nice() for pid in proc.engine_pids()] == [nice] * 2
        lines = log.read_text().splitlines()
        for rank in (0, 1):
            assert any(f" engine{rank} " in line and f"torch intra-op threads: {threads}" in line
                       for line in lines), proc.log_tail()
        body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 24,
                "ignore_eos": True}

        async def burst():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(client.post(
                    proc.url + "/v1/chat/completions", json={"model": MODEL, **body})
                    for _ in range(8)))

        replies = asyncio.run(burst())
        assert all(r.status_code == 200 for r in replies)
        finished = [_engine_stats(e["address"]).num_requests_finished for e in engines]
        assert sum(finished) == 8 and min(finished) >= 2, finished
    finally:
        proc.stop()


def test_a_paused_api_process_ends_the_streams_its_engine_dropped(tmp_path):
    """Stopped past the engine's 3 s peer timeout (SIGSTOP here; an event loop starved of
    CPU alike), the API process comes back to an engine that aborted its requests: each
    stream ends with a 503 error event instead of waiting for its client to give up, and
    the server keeps serving."""
    proc = ServerProcess(log_path=tmp_path / "server.log").wait_ready()
    try:
        body = {"model": httpx.get(proc.url + "/v1/models").json()["data"][0]["id"],
                "messages": [{"role": "user", "content": "tell me a long story"}],
                "max_tokens": 4000, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", proc.url + "/v1/chat/completions", json=body,
                          timeout=httpx.Timeout(30.0)) as response:
            lines = response.iter_lines()
            events.append(next(line for line in lines if line.startswith("data:")))
            os.kill(proc.process.pid, signal.SIGSTOP)
            time.sleep(4.5)
            os.kill(proc.process.pid, signal.SIGCONT)
            started = time.monotonic()
            events += [line for line in lines if line.startswith("data:")]
            ended_in = time.monotonic() - started
        errors = [e for e in events if '"error"' in e]
        assert errors and "engine_dropped_request" in errors[-1], events[-3:]
        assert ended_in < 15, proc.log_tail()
        reply = httpx.post(proc.url + "/v1/chat/completions", timeout=30,
                           json={**body, "stream": False, "max_tokens": 4})
        assert reply.status_code == 200, reply.text
    finally:
        os.kill(proc.process.pid, signal.SIGCONT)
        assert proc.stop() == 0, proc.log_tail()
