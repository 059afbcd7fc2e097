"""`flatserve serve --tensor-parallel-size 2` on the CPU: each engine is two processes
(rank 0 and a worker it spawns), its answers are TP=1's, and killing the worker rank fails
the engine within about a second: in-flight requests end with an error, /health says 503,
new requests get 503, nothing hangs."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from tests.e2e.server_process import ServerProcess
from tests.e2e.test_openai_parity import _data_url, _image

MODEL = "flatserve-tiny-qwen2.5-vl"


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory, tiny_model_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    # restarts off: the death test looks at the engine that died, not at its successor
    proc = ServerProcess("-tp", "2", "--max-engine-restarts", "0",
                         log_path=tmp_path_factory.mktemp("tp") / "server.log", env=env)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def worker_pids(server: ServerProcess) -> list[int]:
    """The worker ranks: children of the engine processes."""
    return [c.pid for pid in server.engine_pids() for c in psutil.Process(pid).children()]


def chat(url: str, content) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_two_ranks_answer_as_one(server, tp_server):
    workers = worker_pids(tp_server)
    assert len(workers) == 1
    assert "tp rank 1" in " ".join(psutil.Process(workers[0]).cmdline())
    # the ranks share the cores: rank 0 logs its threads, the worker takes as many
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"torch intra-op threads: {threads}" in tp_server.log_path.read_text()
    image = [{"type": "text", "text": "what is this"},
             {"type": "image_url", "image_url": {"url": _data_url(_image(3, (120, 90)))}}]
    for content in ("tell me a story", image):
        assert chat(tp_server.url, content) == chat(server.url, content)


def test_a_killed_worker_rank_is_the_engines_death(tp_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}],
            "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", tp_server.url + "/v1/chat/completions", json=body,
                      timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        os.kill(worker_pids(tp_server)[0], signal.SIGKILL)
        killed = time.monotonic()
        rest = "\n".join(lines)
        ended = time.monotonic() - killed
    assert '"error"' in rest  # the stream ends with an error event, not a hang
    assert ended < 2.0
    while httpx.get(tp_server.url + "/health", timeout=5).status_code != 503:
        assert time.monotonic() - killed < 2.0, "/health did not notice in time"
        time.sleep(0.05)
    r = httpx.post(tp_server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 503
    engine = psutil.Process(tp_server.process.pid).children()
    assert not [p for p in engine if p.status() != psutil.STATUS_ZOMBIE
                and "engine" in " ".join(p.cmdline())], "rank 0 outlived its worker"
