"""flatserve bench against a streaming OpenAI-like server on a real socket (in a thread of the
test process, so each test can read what it saw) and, once, against flatserve itself."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from flatserve.bench import main, parse_args
from flatserve.bench.config import DEFAULT_CONCURRENCY
from flatserve.bench.schedule import arrival_offsets
from flatserve.bench.workload import build_units

JSON_KEYS = {"label", "requests_per_s", "output_tokens_per_s", "ttft_ms", "tpot_ms", "itl_ms",
             "e2e_ms", "health_ms", "errors", "error_kinds", "first_error", "completed",
             "duration_s", "settings", "latency_unit"}


class FakeServer:
    """Streams max_tokens tokens per chat request, a chunk each (and usage when asked for);
    records the most chat requests in flight at once and the bodies it got.
    `visible_every` > 1: only every n-th token has text; the others go out as empty chunks
    with their usage where every chunk's usage was asked for (as vLLM and flatserve do), and
    not at all otherwise (as a server that only sends text)."""

    def __init__(self, token_delay: float = 0.005, fail_every: int = 0, usage: bool = True,
                 health: bool = True, done: bool = True, cut_after: int = 0,
                 continuous_usage: bool = True, visible_every: int = 1,
                 empty_chunks: bool = True):
        self.continuous_usage = continuous_usage
        self.empty_chunks = empty_chunks  # False: tokens with no text wait for the next text
        self.visible_every = visible_every
        self.done = done  # end with [DONE] (transformers serve does not)
        self.cut_after = cut_after  # close the stream after this many tokens, unfinished
        self.token_delay = token_delay
        self.fail_every = fail_every
        self.usage = usage
        self.health = health
        self.bodies: list[dict] = []
        self.arrivals: list[float] = []  # time.monotonic() of each chat request
        self.in_flight = 0
        self.max_in_flight = 0

    def chunk(self, delta: dict, finish: str | None = None, usage: dict | None = None,
              counted: dict | None = None) -> str:
        """A choice chunk (with `counted` as its usage), or with `usage` the usage chunk."""
        choices = [{"index": 0, "delta": delta, "finish_reason": finish}] if usage is None else []
        data = {"object": "chat.completion.chunk", "model": "fake", "choices": choices}
        usage = usage or counted
        return f"data: {json.dumps(data | ({'usage': usage} if usage else {}))}\n\n"

    async def events(self, body: dict):
        max_tokens = body["max_tokens"]
        options = body.get("stream_options", {})
        every_chunk = (self.usage and self.continuous_usage and options.get("include_usage")
                       and options.get("continuous_usage_stats"))
        yield self.chunk({"role": "assistant"})
        for i in range(max_tokens):
            if self.cut_after and i == self.cut_after:
                self.in_flight -= 1
                return
            await asyncio.sleep(self.token_delay)
            visible = (i + 1) % self.visible_every == 0
            if visible or (every_chunk and self.empty_chunks):
                yield self.chunk({"content": "x" if visible else ""},
                                 counted={"prompt_tokens": 10, "completion_tokens": i + 1}
                                 if every_chunk else None)
        yield self.chunk({}, "length")
        if self.usage and options.get("include_usage"):
            yield self.chunk({}, usage={"prompt_tokens": 10, "completion_tokens": max_tokens})
        # done before the client can see [DONE] and send its next request
        self.in_flight -= 1
        if self.done:
            yield "data: [DONE]\n\n"

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return JSONResponse({}, status_code=200 if self.health else 404)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.bodies.append(body)
            self.arrivals.append(time.monotonic())
            if self.fail_every and len(self.bodies) % self.fail_every == 0:
                return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return StreamingResponse(self.events(body), media_type="text/event-stream")

        return app


@pytest.fixture
def serve_fake():
    """serve_fake(FakeServer(...)) -> its base URL; the server stops after the test."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(fake: FakeServer) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(fake.app(), log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append((server, thread))
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.01)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(5)


def run_main(url: str, tmp_path, *args: str) -> tuple[int, dict | None]:
    path = tmp_path / "bench.json"
    code = main(["--base-url", url, "--json", str(path), "--no-progress", *args])
    return code, json.loads(path.read_text()) if path.exists() else None


def test_arrivals_are_poisson_at_the_rate():
    offsets = arrival_offsets(20_001, rate=4.0, seed=1)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and len(offsets) == 20_001 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: std == mean
    assert np.array_equal(offsets, arrival_offsets(20_001, rate=4.0, seed=1))
    assert not arrival_offsets(5, rate=float("inf"), seed=0).any()


def test_config_defaults_and_passthrough():
    closed = parse_args(["--", "--max-num-seqs", "8"])
    assert closed.concurrency == DEFAULT_CONCURRENCY and closed.request_rate is None
    assert closed.warmup_requests == min(DEFAULT_CONCURRENCY, 8)
    assert closed.start_command(9) == [sys.executable, "-m", "flatserve.cli", "serve",
                                       "--port", "9", "--max-num-seqs", "8"]
    opened = parse_args(["--request-rate", "2", "--base-url", "http://h:1/"])
    assert opened.concurrency is None and opened.base_url == "http://h:1"
    assert parse_args(["--concurrency", "2"]).warmup_requests == 2
    with pytest.raises(SystemExit):
        parse_args(["--base-url", "http://h:1", "--", "--max-num-seqs", "8"])


def test_bodies_are_deterministic_openai_and_unique():
    config = parse_args(["--workload", "mixed", "--image-size", "32", "--image-share", "0.5",
                         "--prompt-len", "20", "--prompt-len-range", "0.5",
                         "--output-len", "10", "--output-len-range", "0.5", "--no-progress"])
    units = build_units(config, "m", range(40))
    assert all(len(unit) == 1 for unit in units)
    bodies = [json.loads(unit[0]) for unit in units]
    assert bodies == [json.loads(u[0]) for u in build_units(config, "m", range(40))]
    images = [b for b in bodies if isinstance(b["messages"][0]["content"], list)]
    texts = [b for b in bodies if isinstance(b["messages"][0]["content"], str)]
    assert 8 <= len(images) <= 32 and texts
    urls = [p["image_url"]["url"] for b in images for p in b["messages"][0]["content"]
            if p["type"] == "image_url"]
    assert len(set(urls)) == len(urls) == len(images)
    assert all(10 <= len(b["messages"][0]["content"].split()) <= 30 for b in texts)
    assert all(5 <= b["max_tokens"] <= 15 for b in bodies)
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True,
                                                      "continuous_usage_stats": True}
               and b["temperature"] == 0.0 and "ignore_eos" not in b for b in bodies)
    eos = parse_args(["--ignore-eos", "--extra-body", '{"top_k": 5}', "--no-progress"])
    body = json.loads(build_units(eos, "m", range(1))[0][0])
    assert body["ignore_eos"] is True and body["top_k"] == 5


def test_distinct_images_bounds_the_set_of_images():
    config = parse_args(["--workload", "image", "--image-size", "32", "--images-per-request",
                         "2", "--distinct-images", "3", "--no-progress"])
    bodies = [json.loads(u[0]) for u in build_units(config, "m", range(6))]
    urls = [[p["image_url"]["url"] for p in b["messages"][0]["content"]
             if p["type"] == "image_url"] for b in bodies]
    slots = [url for pair in urls for url in pair]
    assert len(set(slots)) == 3 and slots[:3] == slots[3:6] == slots[6:9]
    with pytest.raises(SystemExit):
        parse_args(["--distinct-images", "-1"])


def test_multi_turn_conversations_resend_their_image_and_history():
    config = parse_args(["--workload", "multi-turn", "--turns", "3", "--image-size", "32",
                         "--prompt-len", "6", "--output-len", "4", "--num-requests", "6",
                         "--no-progress"])
    units = [[json.loads(b) for b in unit] for unit in build_units(config, "m", range(2))]
    assert [len(unit) for unit in units] == [3, 3]
    first_urls = []
    for unit in units:
        for turn, body in enumerate(unit):
            messages = body["messages"]
            assert [m["role"] for m in messages] == ["user"] + ["assistant", "user"] * turn
            # each turn is the one before plus a reply and a new question
            if turn:
                assert messages[:-2] == unit[turn - 1]["messages"]
            assert len(messages[-1]["content"].split() if turn else
                       messages[0]["content"][-1]["text"].split()) == 6
        first_urls.append(unit[0]["messages"][0]["content"][0]["image_url"]["url"])
    assert first_urls[0] != first_urls[1]  # a distinct image per conversation
    with pytest.raises(SystemExit):
        parse_args(["--workload", "multi-turn", "--turns", "4", "--num-requests", "6"])


def test_multi_turn_turns_go_in_order_and_are_timed_apart(serve_fake, tmp_path, capsys):
    fake = FakeServer(token_delay=0.002)
    code, data = run_main(serve_fake(fake), tmp_path, "--workload", "multi-turn", "--turns",
                          "3", "--num-requests", "12", "--concurrency", "2", "--image-size",
                          "32", "--output-len", "3", "--prompt-len", "5", "--warmup-requests",
                          "0")
    assert code == 0 and data["completed"] == 12
    # a conversation's turn t arrives only after its turn t - 1 has been answered
    seen: dict[str, int] = {}
    for body in fake.bodies:
        url = body["messages"][0]["content"][0]["image_url"]["url"]
        turn = (len(body["messages"]) - 1) // 2
        assert seen.get(url, -1) == turn - 1
        seen[url] = turn
    assert len(seen) == 4 and set(seen.values()) == {2}
    assert data["ttft_first_turn_ms"]["p50"] > 0 and data["ttft_later_turns_ms"]["p50"] > 0
    out = capsys.readouterr().out
    assert "TTFT later turns" in out and "multi-turn workload (3 turns each)" in out


def test_closed_loop_figures_and_concurrency(serve_fake, tmp_path, capsys):
    fake = FakeServer(token_delay=0.01)
    code, data = run_main(serve_fake(fake), tmp_path, "--num-requests", "12", "--concurrency",
                          "3", "--output-len", "5", "--prompt-len", "16", "--label", "tiny")
    assert code == 0
    assert JSON_KEYS <= data.keys() and data["label"] == "tiny"
    assert data["completed"] == 12 and data["errors"] == 0 and data["first_error"] is None
    assert len(fake.bodies) == 12 + 3  # and the warm-up
    assert fake.max_in_flight == 3
    assert data["output_tokens"] == 12 * 5 and data["prompt_tokens"] == 12 * 10
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = data[key]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"], key
    assert data["ttft_ms"]["max"] <= data["e2e_ms"]["max"]
    assert data["ttft_ms"]["p50"] < data["e2e_ms"]["p50"]
    assert data["requests_per_s"] > 0 and data["output_tokens_per_s"] > data["requests_per_s"]
    assert data["health_path"] == "/health" and data["health_ms"]["p50"] > 0
    assert data["settings"]["concurrency"] == 3 and data["settings"]["model"] == "fake"
    out = capsys.readouterr().out
    assert "flatserve bench: tiny" in out and "TTFT" in out and "health /health" in out


def test_open_loop_keeps_its_cap(serve_fake, tmp_path):
    fake = FakeServer(token_delay=0.01)
    code, data = run_main(serve_fake(fake), tmp_path, "--num-requests", "10", "--request-rate",
                          "inf", "--concurrency", "2", "--output-len", "4",
                          "--warmup-requests", "0")
    assert code == 0 and data["completed"] == 10
    assert fake.max_in_flight == 2
    assert data["settings"]["request_rate"] == float("inf")


def test_errors_are_counted_with_the_first_text(serve_fake, tmp_path, capsys):
    url = serve_fake(FakeServer(fail_every=3))
    code, data = run_main(url, tmp_path, "--num-requests", "9", "--concurrency", "1",
                          "--output-len", "2", "--warmup-requests", "0")
    assert code == 0  # the run completed; its errors are reported
    assert data["completed"] == 6 and data["errors"] == 3
    assert data["error_kinds"] == {"HTTP 500": 3}
    assert data["first_error"].startswith("HTTP 500: ") and "injected failure" in data["first_error"]
    assert "injected failure" in capsys.readouterr().out


def test_all_failed_or_unreachable_is_nonzero(serve_fake, tmp_path):
    url = serve_fake(FakeServer(fail_every=1))
    code, data = run_main(url, tmp_path, "--num-requests", "3", "--warmup-requests", "0")
    assert code == 1 and data["completed"] == 0 and data["errors"] == 3
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    assert run_main(closed, tmp_path / "x", "--num-requests", "1")[0] == 2


def test_peer_without_health_or_usage(serve_fake, tmp_path, capsys):
    url = serve_fake(FakeServer(usage=False, health=False))
    code, data = run_main(url, tmp_path, "--num-requests", "4", "--concurrency", "2",
                          "--output-len", "3")
    assert code == 0 and data["completed"] == 4
    assert data["output_tokens"] == 4 * 3  # counted from the content chunks
    assert data["prompt_tokens"] is None and data["total_tokens_per_s"] is None
    assert data["health_path"] == "/v1/models" and data["health_ms"]["p50"] > 0
    assert "no /health" in capsys.readouterr().out


def _image_urls(body: dict) -> list[str]:
    return [p["image_url"]["url"] for p in body["messages"][0]["content"]
            if p["type"] == "image_url"]


def test_peer_rounds_alternate_with_the_same_fresh_requests(serve_fake, tmp_path, capsys):
    this, peer = FakeServer(), FakeServer(token_delay=0.01)
    this_url, peer_url = serve_fake(this), serve_fake(peer)
    code, data = run_main(this_url, tmp_path, "--peer-url", peer_url + "/", "--peer-label",
                          "vllm", "--workload", "image", "--image-size", "32", "--seed", "7",
                          "--num-requests", "3", "--warmup-requests", "1", "--concurrency", "1",
                          "--output-len", "4")
    assert code == 0
    assert [r["seed"] for r in data["rounds"]] == [7, 8]
    for r in data["rounds"]:
        assert r["this"]["completed"] == r["peer"]["completed"] == 3
        assert r["this"]["label"] == "flatserve" and r["peer"]["label"] == "vllm"
    # per round: 1 warm-up + 3 measured requests each, the same bodies to both servers
    assert len(this.bodies) == len(peer.bodies) == 8
    assert this.bodies == peer.bodies
    first, second = ({u for b in bodies[i:i + 4] for u in _image_urls(b)}
                     for i, bodies in ((0, this.bodies), (4, this.bodies)))
    assert len(first) == len(second) == 4 and not first & second  # fresh images each round
    # round 1: this server first; round 2: the peer first
    assert this.arrivals[3] < peer.arrivals[0] and peer.arrivals[7] < this.arrivals[4]
    out = capsys.readouterr().out
    assert "flatserve vs vllm, 2 round(s)" in out and "flatserve better by" in out
    table = out[out.index("flatserve vs vllm"):]
    row = next(line for line in table.splitlines() if line.startswith("requests/s"))
    ratio = float(row.split()[-1].rstrip("x"))
    assert ratio > 1.2  # the peer streams at half the speed


def test_seed_is_fresh_for_each_run_unless_given():
    assert len({parse_args([]).seed for _ in range(4)}) > 1
    assert parse_args(["--seed", "3"]).seed == 3
    with pytest.raises(SystemExit):
        parse_args(["--peer-url", "http://h:1", "--baseline-args", "--x"])
    assert parse_args(["--peer-url", "http://h:1"]).rounds == 2
    assert parse_args([]).rounds == 1


def test_streams_without_done_end_at_their_finish_reason(serve_fake, tmp_path, capsys):
    # transformers serve ends its streams after the finish_reason chunk, with no [DONE]
    code, data = run_main(serve_fake(FakeServer(done=False)), tmp_path, "--num-requests", "4",
                          "--output-len", "3", "--warmup-requests", "0")
    assert code == 0 and data["completed"] == 4 and data["errors"] == 0
    assert data["output_tokens"] == 4 * 3
    # a stream that stops before any finish_reason is still an incomplete one
    code, data = run_main(serve_fake(FakeServer(done=False, cut_after=2)), tmp_path,
                          "--num-requests", "2", "--output-len", "3", "--warmup-requests", "0")
    assert data["completed"] == 0 and data["error_kinds"] == {"incomplete stream": 2}
    assert "after 2 content chunks without [DONE] or a finish_reason" in data["first_error"]


def test_latencies_are_per_token_whatever_text_the_tokens_have(serve_fake, tmp_path, capsys):
    # one token in 5 has text; the others come as empty chunks carrying their usage
    fake = FakeServer(token_delay=0.02, visible_every=5)
    code, data = run_main(serve_fake(fake), tmp_path, "--num-requests", "3", "--concurrency",
                          "1", "--output-len", "15", "--warmup-requests", "0")
    assert code == 0 and data["completed"] == 3 and data["latency_unit"] == "token"
    assert fake.bodies[0]["stream_options"] == {"include_usage": True,
                                                "continuous_usage_stats": True}
    assert data["output_tokens"] == 3 * 15
    # Timed per visible piece of text, a gap would span ~8 tokens (ITL ~8x TPOT); timed as
    # one burst, ITL would be ~0. The band is wide enough for a loaded machine's skew (a few
    # long gaps raise TPOT's per-request mean, not ITL's median: 1.7x seen under load).
    tpot = data["tpot_ms"]["p50"]
    assert tpot / 3 <= data["itl_ms"]["p50"] <= tpot * 3
    assert data["ttft_ms"]["p50"] < 2.5 * tpot  # the first token, not the first text
    assert "TTFT, TPOT and ITL per token" in capsys.readouterr().out
    # a server that holds tokens without text back: they come in bursts, and show so
    url = serve_fake(FakeServer(token_delay=0.02, visible_every=5, empty_chunks=False))
    code, data = run_main(url, tmp_path, "--num-requests", "3", "--concurrency", "1",
                          "--output-len", "15", "--warmup-requests", "0")
    assert code == 0 and data["latency_unit"] == "token"
    assert data["itl_ms"]["p50"] == 0 and data["itl_ms"]["p99"] > 3 * data["tpot_ms"]["p50"]


def test_a_server_without_usage_in_every_chunk_is_timed_per_content_chunk(serve_fake, tmp_path,
                                                                          capsys):
    url = serve_fake(FakeServer(token_delay=0.02, visible_every=5, continuous_usage=False))
    code, data = run_main(url, tmp_path, "--num-requests", "3", "--concurrency", "1",
                          "--output-len", "15", "--warmup-requests", "0")
    assert code == 0 and data["completed"] == 3 and data["latency_unit"] == "chunk"
    assert data["output_tokens"] == 3 * 15  # from the last chunk's usage all the same
    assert data["itl_ms"]["p50"] > 3 * data["tpot_ms"]["p50"]  # a chunk every 5 tokens
    assert "per content chunk" in capsys.readouterr().out
    # --no-token-usage: the field is not sent, to a server that would answer it
    fake = FakeServer(token_delay=0.001)
    code, data = run_main(serve_fake(fake), tmp_path, "--num-requests", "2", "--output-len",
                          "3", "--warmup-requests", "0", "--no-token-usage")
    assert code == 0 and data["latency_unit"] == "chunk"
    assert fake.bodies[0]["stream_options"] == {"include_usage": True}


def test_rounds_say_when_the_two_servers_are_timed_in_unlike_units(serve_fake, tmp_path,
                                                                   capsys):
    this, peer = FakeServer(), FakeServer(continuous_usage=False)
    code, _ = run_main(serve_fake(this), tmp_path, "--peer-url", serve_fake(peer),
                       "--num-requests", "2", "--output-len", "3", "--warmup-requests", "0",
                       "--rounds", "1")
    assert code == 0
    assert "latencies per: flatserve token, peer chunk" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_flatserve_bench_against_the_tiny_model(tmp_path):
    path = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "flatserve.cli", "bench", "--num-requests", "6", "--output-len",
         "4", "--concurrency", "2", "--workload", "mixed", "--image-size", "64",
         "--no-progress", "--json", str(path), "--server-log", str(tmp_path / "server.log"),
         "--", "--max-num-seqs", "8"],
        capture_output=True, text=True, timeout=170)
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(path.read_text())
    assert data["completed"] == 6 and data["errors"] == 0
    assert 0 < data["output_tokens"] <= 6 * 4
    assert data["ttft_ms"]["max"] <= data["e2e_ms"]["max"]
    assert data["health_path"] == "/health" and data["health_ms"]["p50"] > 0
    assert "TTFT" in run.stdout
    # the server it started is on this machine: its API process and its engine both worked
    cpu = data["server_cpu_us_per_token"]
    assert cpu["api"] > 0 and cpu["others"] > 0
    assert "server CPU per token" in run.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_multi_turn_against_a_baseline_without_caches(tmp_path):
    path = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "flatserve.cli", "bench", "--workload", "multi-turn", "--turns",
         "3", "--num-requests", "6", "--output-len", "4", "--concurrency", "2",
         "--image-size", "64", "--prompt-len", "8", "--no-progress", "--json", str(path),
         "--server-log", str(tmp_path / "server.log"),
         "--baseline-args", "--no-enable-prefix-caching --encoder-cache-bytes 0",
         "--", "--max-num-seqs", "8"],
        capture_output=True, text=True, timeout=230)
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(path.read_text())
    assert data["completed"] == data["baseline"]["completed"] == 6
    assert data["baseline"]["label"] == "--no-enable-prefix-caching --encoder-cache-bytes 0"
    assert (tmp_path / "server-baseline.log").exists() and (tmp_path / "server.log").exists()
    assert "TTFT p50, later turns" in run.stdout and "better by" in run.stdout


def test_comparison_rows_are_ratios_in_the_better_direction():
    from flatserve.bench.report import format_comparison
    from flatserve.bench.request import RequestResult
    from flatserve.bench.stats import summarize

    def run(ttft: float, label: str):
        results = []
        for i in range(4):
            r = RequestResult(sent_at=float(i), ended_at=i + 1.0, ok=True, ttft_s=ttft,
                              content_chunks=3, turn=i % 2)
            results.append(r)
        return summarize(results, [0.001], "/health", label=label)

    text = format_comparison(run(0.4, "no cache"), run(0.1, "cache"))
    assert "no cache vs cache" in text
    row = next(line for line in text.splitlines() if line.startswith("TTFT p50 (ms)"))
    assert row.split()[-1] == "4.00x"  # 400 ms before, 100 ms now: 4x better


def test_video_bodies_carry_a_distinct_clip_each():
    config = parse_args(["--workload", "video", "--image-size", "32", "--video-frames", "4",
                         "--num-requests", "3", "--no-progress"])
    bodies = [json.loads(b) for [b] in build_units(config, "m", range(3))]
    urls = [b["messages"][0]["content"][0]["video_url"]["url"] for b in bodies]
    assert all(u.startswith("data:video/mp4;base64,") for u in urls)
    assert len(set(urls)) == 3
    assert bodies[0]["messages"][0]["content"][1]["text"] == "Request 0: describe the video."


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_video_workload_against_the_tiny_model(tmp_path):
    path = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "flatserve.cli", "bench", "--num-requests", "4", "--output-len",
         "4", "--concurrency", "2", "--workload", "video", "--image-size", "64",
         "--video-frames", "4", "--no-progress", "--json", str(path),
         "--server-log", str(tmp_path / "server.log"), "--", "--max-num-seqs", "8"],
        capture_output=True, text=True, timeout=170)
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(path.read_text())
    assert data["completed"] == 4 and data["errors"] == 0
    assert "4-frame 64px video" in run.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tokens_without_text_are_timed_as_they_come(tmp_path):
    """A vocabulary far larger than its tokenizer (most ids decode to no text, as in a
    real-shape preset before its fillers): served by flatserve, every token is still seen
    when it comes, so ITL is per token, not one gap per visible piece of text."""
    from dataclasses import replace

    from shared.random_checkpoints import TINY, write_checkpoint

    preset = replace(TINY, name="tiny-wide-vocab", fill_vocab=False,
                     text=replace(TINY.text, vocab_size=32768))  # ~88% of ids have no text
    model = write_checkpoint(tmp_path / "model", preset)
    path = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "flatserve.cli", "bench", "--num-requests", "6", "--output-len",
         "32", "--concurrency", "1", "--temperature", "1.0", "--ignore-eos", "--seed", "3",
         "--no-progress", "--json", str(path), "--server-log", str(tmp_path / "server.log"),
         "--", "--model", str(model), "--max-num-seqs", "4"],
        capture_output=True, text=True, timeout=230)
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(path.read_text())
    assert data["completed"] == 6 and data["output_tokens"] == 6 * 32
    assert data["latency_unit"] == "token"
    # Timed per visible piece of text, a gap would span ~8 tokens (ITL ~8x TPOT); timed as
    # one burst, ITL would be ~0. The band is wide enough for a loaded machine's skew (a few
    # long gaps raise TPOT's per-request mean, not ITL's median: 1.7x seen under load).
    tpot = data["tpot_ms"]["p50"]
    assert tpot / 3 <= data["itl_ms"]["p50"] <= tpot * 3
