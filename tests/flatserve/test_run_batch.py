"""`flatserve run-batch` run as users run it, on the tiny model: a batch file in, one result
line per request out, Prometheus metrics while it runs, http(s) input and output."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpx
import pytest

from tests.api_proc.conftest import data_url, encode_image
from tests.e2e.server_process import REPO, SMALL_ENGINE_FLAGS, free_port

pytestmark = pytest.mark.timeout(300)


def command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "flatserve.cli", "run-batch", *SMALL_ENGINE_FLAGS, *flags]


def run_batch(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(command(*flags), cwd=REPO, capture_output=True, text=True,
                          timeout=240)


def request(custom_id: str, url: str = "/v1/chat/completions", **body) -> str:
    if url == "/v1/chat/completions":
        body.setdefault("messages", [{"role": "user", "content": "Hello there"}])
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"max_tokens": 4, "ignore_eos": True, **body}})


IMAGE_MESSAGE = [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": data_url(encode_image(64, 48))}},
    {"type": "text", "text": "What is this?"}]}]


def test_a_batch_gets_one_result_line_per_request_in_input_order(tmp_path):
    lines = [
        request("chat"),
        request("completion", "/v1/completions", prompt="Once upon a time"),
        request("image", messages=IMAGE_MESSAGE),
        '{"custom_id": "broken", "method": "POST", ',
        request("embedding", "/v1/embeddings", input="Hello"),
        "",
        request("unknown-model", model="NonExistModel"),
        request("streamed", stream=True),
        request("last", "/v1/completions", prompt="The end"),
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    done = run_batch("-i", str(source), "-o", str(target), "--max-in-flight", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(x) for x in target.read_text().splitlines()]
    # the blank line is no request; the broken one has no custom_id to give back
    assert [r["custom_id"] for r in results] == [
        "chat", "completion", "image", None, "embedding", "unknown-model", "streamed", "last"]
    by_id = {r["custom_id"]: r for r in results}
    for name, kind in (("chat", "chat.completion"), ("completion", "text_completion"),
                       ("image", "chat.completion"), ("last", "text_completion")):
        result = by_id[name]
        assert result["error"] is None and result["response"]["status_code"] == 200, result
        body = result["response"]["body"]
        assert body["object"] == kind and len(body["choices"]) == 1
        assert body["usage"]["completion_tokens"] == 4
    # the image reached the model: its placeholders make the prompt longer than the text's
    assert by_id["image"]["response"]["body"]["usage"]["prompt_tokens"] > \
        by_id["chat"]["response"]["body"]["usage"]["prompt_tokens"] + 4
    failures = {r["custom_id"]: (r["response"]["status_code"], r["error"]) for r in results
                if r["error"] is not None}
    assert set(failures) == {None, "embedding", "unknown-model", "streamed"}
    assert all(r["response"]["body"] is None for r in results if r["error"] is not None)
    status, error = failures[None]
    assert status == 400 and error["message"].startswith("line 4 is not JSON")
    status, error = failures["embedding"]
    assert status == 400 and error["code"] == "unsupported_url"
    assert "/v1/embeddings" in error["message"]
    status, error = failures["unknown-model"]
    assert status == 404 and "NonExistModel" in error["message"]  # the server's own answer
    assert failures["streamed"][1]["code"] == "stream_not_supported"
    assert "8 lines" in done.stderr and "4 answered 200, 4 errors" in done.stderr


def _open_writer(path, proc: subprocess.Popen, log_path, timeout_s: float = 180.0) -> int:
    """The write end of the named pipe at `path`, once run-batch has opened its read end."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "run-batch never opened its input"
        time.sleep(0.2)


def _wait_for_lines(path, n: int, timeout_s: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and len(lines := path.read_text().splitlines()) >= n:
            return [json.loads(x) for x in lines]
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} output lines after {timeout_s} s")


def test_metrics_are_served_while_it_runs_and_results_are_written_as_they_finish(tmp_path):
    """vLLM's test_metrics_exist_run_batch, during the run: the input is a named pipe kept
    open, so the batch is still running when the metrics are scraped."""
    source, target = tmp_path / "in.fifo", tmp_path / "out.jsonl"
    os.mkfifo(source)
    port = free_port()
    log = open(tmp_path / "run-batch.log", "w+")
    proc = subprocess.Popen(command("-i", str(source), "-o", str(target), "--enable-metrics",
                                    "--port", str(port)),
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        fd = _open_writer(source, proc, tmp_path / "run-batch.log")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "w") as pipe:
            pipe.write(request("first") + "\n")
            pipe.flush()
            # the first result is in the file while the input is still open
            assert _wait_for_lines(target, 1)[0]["custom_id"] == "first"
            base = f"http://127.0.0.1:{port}"
            assert httpx.get(base + "/", timeout=10).status_code == 200  # what vLLM's test polls
            scrape = httpx.get(base + "/metrics", timeout=10)
            assert scrape.status_code == 200
            for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                         "vllm:request_success_total", "vllm:num_requests_running",
                         "vllm:time_to_first_token_seconds_bucket",
                         "flatserve_process_rss_bytes"):
                assert name in scrape.text, name
            assert 'flatserve_requests_total{endpoint="chat",status="200"} 1.0' in scrape.text
            pipe.write(request("second", "/v1/completions", prompt="Hi") + "\n")
        assert proc.wait(timeout=60) == 0, (tmp_path / "run-batch.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    results = _wait_for_lines(target, 2)
    assert [r["custom_id"] for r in results] == ["first", "second"]
    assert all(r["response"]["status_code"] == 200 for r in results)


class _Files(BaseHTTPRequestHandler):
    store: dict = {}

    def log_message(self, *args):
        pass

    def do_GET(self):  # noqa: N802
        data = self.store.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.send_header("Content-Length", str(len(data or b"")))
        self.end_headers()
        self.wfile.write(data or b"")

    def do_PUT(self):  # noqa: N802
        self.store[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_input_and_output_may_be_http_urls(tmp_path):
    store = {"/in.jsonl": (request("a") + "\n" + request("b", "/v1/completions",
                                                       prompt="x")).encode()}
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Files", (_Files,), {"store": store}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    staging = tmp_path / "staging"
    staging.mkdir()
    try:
        done = run_batch("-i", base + "/in.jsonl", "-o", base + "/results/out.jsonl",
                         "--output-tmp-dir", str(staging))
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(x) for x in store["/results/out.jsonl"].decode().splitlines()]
    assert [(r["custom_id"], r["response"]["status_code"]) for r in results] == \
        [("a", 200), ("b", 200)]
    assert list(staging.iterdir()) == []  # the local copy is gone once uploaded


def test_flags_of_the_http_server_and_a_missing_input_fail_before_any_process(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(request("a") + "\n")
    done = run_batch("-i", str(source), "-o", str(tmp_path / "out"), "--host", "0.0.0.0",
                     "--api-key", "k")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "--host, --api-key" in last and "--url" in last
    done = run_batch("-i", str(source), "-o", str(tmp_path / "out"),
                     "--admission-timeout-s", "5")
    assert done.returncode != 0
    assert "--admission-timeout-s" in done.stderr and "as long as it takes" in done.stderr
    done = run_batch("-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out"))
    assert done.returncode != 0 and "missing.jsonl: no such file" in done.stderr
    assert not (tmp_path / "out").exists()


class _SlowHeadApp:
    """An ASGI app standing for the API (no engines): answers each completion with its
    prompt; the prompt "slow" waits until `release` is set."""

    def __init__(self) -> None:
        self.router = SimpleNamespace(lifespan_context=lambda app: contextlib.nullcontext())
        self.release: asyncio.Event | None = None
        self.running = self.max_running = 0
        self.hold_s = 0.0  # how long every request runs

    async def __call__(self, scope, receive, send) -> None:
        prompt = json.loads((await receive())["body"])["prompt"]
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        if prompt == "slow":
            await self.release.wait()
        await asyncio.sleep(self.hold_s)
        self.running -= 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps({"echo": prompt}).encode()})


def test_reading_stops_while_an_early_result_holds_the_output_back(tmp_path):
    """The read-ahead bound: with --max-in-flight 2, at most 4 lines are read and not yet
    written while the first request runs; the rest are read once it is done."""
    from flatserve.batch_file import Output
    from flatserve.run_batch import BatchRunner

    prompts = ["slow"] + [f"p{i}" for i in range(19)]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(request(p, "/v1/completions", prompt=p) + "\n" for p in prompts))
    app = _SlowHeadApp()
    runner = BatchRunner(app, str(source), Output(str(target), None), max_in_flight=2,
                         line_limit=1 << 20, drain_s=1.0, body_budget=1 << 30)

    async def scenario() -> int:
        app.release = asyncio.Event()
        run = asyncio.ensure_future(runner.run())
        for _ in range(200):  # until the reader has stopped
            await asyncio.sleep(0.005)
        assert runner.num_lines == 4 and target.read_bytes() == b""
        app.release.set()
        return await run

    assert asyncio.run(scenario()) == 0
    results = [json.loads(x) for x in target.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == prompts
    assert [r["response"]["body"]["echo"] for r in results] == prompts
    assert app.max_running <= 2


@pytest.mark.parametrize("budget,most_running", [(5000, 1), (1 << 30, 4)])
def test_running_bodies_stay_inside_the_image_budget(tmp_path, budget, most_running):
    """Lines wait on disk while the running requests' bodies fill the budget (one runs
    alone when each is most of it), instead of being read and waiting in memory for a 429:
    every line answers 200, in order. With room, --max-in-flight bounds them."""
    from flatserve.batch_file import Output
    from flatserve.run_batch import BatchRunner

    prompts = [f"{i:02d}" + "x" * 3000 for i in range(8)]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(request(p[:2], "/v1/completions", prompt=p) + "\n"
                              for p in prompts))
    app = _SlowHeadApp()
    app.hold_s = 0.02
    runner = BatchRunner(app, str(source), Output(str(target), None), max_in_flight=4,
                         line_limit=1 << 20, drain_s=1.0, body_budget=budget)
    assert asyncio.run(runner.run()) == 0
    results = [json.loads(x) for x in target.read_text().splitlines()]
    assert [r["response"]["body"]["echo"] for r in results] == prompts
    assert app.max_running == most_running and runner.num_ok == 8
