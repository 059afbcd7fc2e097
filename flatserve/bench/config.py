"""Benchmark settings: one frozen dataclass, validated once, the only source of CLI defaults."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import secrets
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from flatserve.soak.config import serve_command, split_passthrough
from shared.config_args import opt

WORKLOADS = ("text", "image", "mixed", "multi-turn", "video")
DEFAULT_CONCURRENCY = 8  # closed loop when neither --concurrency nor --request-rate is given
MAX_DEFAULT_WARMUP = 8
# what the JSON output records of the run's settings (never the API key)
SETTINGS = ("workload", "num_requests", "warmup_requests", "prompt_len",
            "prompt_len_range", "output_len", "output_len_range", "image_size",
            "images_per_request", "distinct_images", "image_share", "turns", "video_frames",
            "temperature", "ignore_eos", "token_usage", "extra_body", "concurrency", "request_rate", "seed",
            "rounds")


@dataclass(frozen=True)
class BenchConfig:
    base_url: str | None = opt(None, "attach to this OpenAI-compatible server (e.g. "
                                     "http://127.0.0.1:8000) instead of starting flatserve")
    model: str | None = opt(None, "model name (default: the first id from GET /v1/models)")
    api_key: str | None = opt(None, "API key sent as 'Authorization: Bearer KEY'")
    workload: str = opt("text", "request mix: text, image (every request), video (every "
                                "request a distinct clip, --video-frames), mixed, or "
                                "multi-turn (conversations of --turns requests, each turn "
                                "re-sending the conversation's image and history)")
    prompt_len: int = opt(256, "prompt length of text requests, in words of a short-word list "
                               "(about one token each)")
    prompt_len_range: float = opt(0.0, "draw prompt lengths uniformly in "
                                       "[len*(1-r), len*(1+r)] (0: all the same)")
    output_len: int = opt(128, "max_tokens of each request")
    output_len_range: float = opt(0.0, "draw max_tokens uniformly in [len*(1-r), len*(1+r)]")
    image_size: int = opt(448, "side of the square generated images, in pixels")
    images_per_request: int = opt(1, "images in each image request")
    distinct_images: int = opt(0, "draw the run's images (or clips) from a set of this many, "
                                  "so that a server's caches can hit after the first use of "
                                  "each (0: every request and slot its own)")
    image_share: float = opt(0.5, "share of requests with images in the mixed workload")
    video_frames: int = opt(16, "frames of each generated clip in the video workload (H.264, "
                                "4 fps, --image-size square; a distinct clip per request)")
    turns: int = opt(4, "turns of each multi-turn conversation, sent one after another")
    baseline_args: tuple[str, ...] = opt(
        (), "also run the same load against a server started with these arguments added "
            "(e.g. '--no-enable-prefix-caching --encoder-cache-bytes 0'; one flag alone as "
            "--baseline-args=--pack-weights), first, and print both side by side with "
            "ratios")
    peer_url: str | None = opt(None, "also measure this OpenAI-compatible server (e.g. vLLM at "
                                     "http://127.0.0.1:8200) with the same requests, in "
                                     "alternating rounds, and print both with ratios")
    peer_model: str | None = opt(None, "the peer's model name (default: the first id from its "
                                       "GET /v1/models)")
    peer_api_key: str | None = opt(None, "the peer's API key")
    peer_label: str = opt("peer", "the peer's name in the tables")
    rounds: int | None = opt(None, "measured rounds against each server (default: 2 with "
                                   "--peer-url, else 1); round r draws fresh prompts and images "
                                   "from seed + r, and the servers take turns going first")
    temperature: float = opt(0.0, "sampling temperature")
    ignore_eos: bool = opt(False, "send 'ignore_eos': true (a vLLM extension) so every "
                                  "request generates exactly max_tokens")
    token_usage: bool = opt(True, "ask for usage in every streamed chunk (stream_options' "
                                  "continuous_usage_stats, as vLLM, SGLang and flatserve "
                                  "answer it), so that TTFT, ITL and TPOT are per token "
                                  "whatever text the tokens decode to; --no-token-usage for a "
                                  "server that refuses the field (latencies are then per "
                                  "content chunk, and the table says so)")
    extra_body: dict | None = opt(None, "JSON object merged into every request body")
    concurrency: int | None = opt(None, "requests in flight: the closed loop's workers (default "
                                        f"{DEFAULT_CONCURRENCY}), or a cap on the open loop's "
                                        "(default: no cap)")
    request_rate: float | None = opt(None, "open loop: Poisson arrivals at this many requests "
                                           "per second ('inf': all at once)")
    num_requests: int = opt(200, "measured requests")
    warmup_requests: int | None = opt(None, "requests sent and waited for before the measured "
                                            f"run (default: concurrency, at most "
                                            f"{MAX_DEFAULT_WARMUP})")
    seed: int | None = opt(None, "seed of prompts, lengths, images and arrivals (default: drawn "
                                 "afresh for each run and printed, so that no cache a server "
                                 "kept from an earlier run can hit)")
    request_timeout_s: float = opt(600.0, "timeout of each connect and each read of a "
                                          "request, seconds")
    health_interval_s: float = opt(0.1, "seconds between GET /health probes during the run")
    label: str | None = opt(None, "text printed in the header and stored in the JSON")
    json_path: str | None = opt(None, "write the results as JSON here")
    progress: bool = opt(True, "show progress bars")
    # starting the server itself
    server_args: tuple[str, ...] = opt((), "arguments after '--', passed to flatserve serve")
    server_command: tuple[str, ...] = opt((), "command that starts the server before "
                                               "'--port N' (default: python -m flatserve.cli serve)")
    server_env: dict[str, str] | None = opt(None, "extra environment of the started server")
    server_log: str | None = opt(None, "log file of the started server "
                                       "(default out/bench-<timestamp>-server.log)")
    server_timeout_s: float = opt(600.0, "seconds to wait for the started server's /health")
    stop_timeout_s: float = opt(15.0, "seconds between SIGINT and SIGKILL when stopping it")

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, "
                             f"got {self.workload!r}")
        if self.concurrency is None and self.request_rate is None:
            object.__setattr__(self, "concurrency", DEFAULT_CONCURRENCY)
        if self.seed is None:
            object.__setattr__(self, "seed", secrets.randbelow(1 << 30))
        if self.rounds is None:
            object.__setattr__(self, "rounds", 2 if self.peer_url else 1)
        if self.rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {self.rounds}")
        if self.peer_url is not None:
            if self.baseline_args:
                raise ValueError("compare with either a peer (peer_url) or a second flatserve "
                                 "(baseline_args), not both")
            object.__setattr__(self, "peer_url", self.peer_url.rstrip("/"))
        elif self.rounds > 1 and self.baseline_args:
            raise ValueError("rounds > 1 alternate with a peer (peer_url); a baseline run "
                             "starts its own server and runs once")
        if self.warmup_requests is None:
            warmup = min(self.concurrency or MAX_DEFAULT_WARMUP, MAX_DEFAULT_WARMUP)
            object.__setattr__(self, "warmup_requests", warmup)
        for name in ("prompt_len", "output_len", "image_size", "num_requests", "video_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.turns < 1:
            raise ValueError(f"turns must be at least 1, got {self.turns}")
        if self.workload == "multi-turn" and self.num_requests % self.turns:
            raise ValueError(f"the multi-turn workload sends whole conversations: num_requests "
                             f"({self.num_requests}) must be a multiple of turns ({self.turns})")
        if self.baseline_args and self.base_url is not None:
            raise ValueError("baseline_args start a second server; they make no sense with "
                             "base_url")
        for name in ("images_per_request", "distinct_images", "warmup_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.workload != "text" and self.images_per_request < 1:
            raise ValueError(f"the {self.workload} workload needs images_per_request >= 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        for name in ("prompt_len_range", "output_len_range"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 <= self.image_share <= 1.0:
            raise ValueError(f"image_share must be in [0, 1], got {self.image_share}")
        if self.temperature < 0:
            raise ValueError(f"temperature must not be negative, got {self.temperature}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive, got {self.request_rate}")
        for name in ("request_timeout_s", "health_interval_s", "server_timeout_s",
                     "stop_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.extra_body is not None and not isinstance(self.extra_body, dict):
            raise ValueError("extra_body must be a JSON object")
        if self.base_url is not None and self.server_args:
            raise ValueError("arguments after '--' start a server; they make no sense with "
                             "base_url")
        for name in ("server_args", "server_command", "baseline_args"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.base_url is not None:
            object.__setattr__(self, "base_url", self.base_url.rstrip("/"))

    @property
    def image_probability(self) -> float:
        return {"text": 0.0, "image": 1.0, "mixed": self.image_share,
                "multi-turn": 1.0, "video": 1.0}[self.workload]

    @property
    def unit_size(self) -> int:
        """Requests sent one after another as one unit: a conversation's turns, or one."""
        return self.turns if self.workload == "multi-turn" else 1

    @property
    def num_units(self) -> int:
        return self.num_requests // self.unit_size

    @property
    def num_warmup_units(self) -> int:
        return -(-self.warmup_requests // self.unit_size)

    def with_server_args(self, extra: tuple[str, ...], label: str) -> BenchConfig:
        """The same run against a server started with `extra` arguments added."""
        return dataclasses.replace(self, server_args=(*self.server_args, *extra), label=label,
                                   baseline_args=())

    def start_command(self, port: int | None) -> list[str]:
        return serve_command(self.server_command, self.server_args, port)

    def server_log_path(self) -> Path:
        return Path(self.server_log or time.strftime("out/bench-%Y%m%d-%H%M%S-server.log"))

    def settings(self) -> dict:
        return {name: getattr(self, name) for name in SETTINGS}


def _field(name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(BenchConfig) if f.name == name)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Measure TTFT, TPOT, ITL, end-to-end latency, throughput and /health "
                    "latency of an OpenAI-compatible server under a closed-loop (--concurrency) "
                    "or Poisson (--request-rate) load of streamed chat requests. Without "
                    "--base-url, starts flatserve serve with the arguments after '--'.",
    )

    def add(flag: str, name: str, **kwargs) -> None:
        field = _field(name)
        kwargs.setdefault("default", field.default)
        help = field.metadata["help"]
        if kwargs["default"] not in (None, ()) and kwargs["default"] is not False \
                and "default" not in help:
            help += " (default: %(default)s)"
        parser.add_argument(flag, dest=name, help=help, **kwargs)

    add("--base-url", "base_url", metavar="URL")
    add("--model", "model", metavar="NAME")
    add("--api-key", "api_key", metavar="KEY")
    add("--workload", "workload", choices=WORKLOADS)
    add("--prompt-len", "prompt_len", type=int, metavar="WORDS")
    add("--prompt-len-range", "prompt_len_range", type=float, metavar="R")
    add("--output-len", "output_len", type=int, metavar="TOKENS")
    add("--output-len-range", "output_len_range", type=float, metavar="R")
    add("--image-size", "image_size", type=int, metavar="PIXELS")
    add("--images-per-request", "images_per_request", type=int, metavar="N")
    add("--distinct-images", "distinct_images", type=int, metavar="N")
    add("--image-share", "image_share", type=float, metavar="F")
    add("--video-frames", "video_frames", type=int, metavar="N")
    add("--turns", "turns", type=int, metavar="N")
    add("--baseline-args", "baseline_args", type=shlex.split, metavar="ARGS")
    add("--peer-url", "peer_url", metavar="URL")
    add("--peer-model", "peer_model", metavar="NAME")
    add("--peer-api-key", "peer_api_key", metavar="KEY")
    add("--peer-label", "peer_label", metavar="TEXT")
    add("--rounds", "rounds", type=int, metavar="N")
    add("--temperature", "temperature", type=float, metavar="T")
    add("--ignore-eos", "ignore_eos", action="store_true")
    add("--token-usage", "token_usage", action=argparse.BooleanOptionalAction)
    add("--extra-body", "extra_body", type=json.loads, metavar="JSON")
    add("--concurrency", "concurrency", type=int, metavar="N")
    add("--request-rate", "request_rate", type=float, metavar="R")
    add("--num-requests", "num_requests", type=int, metavar="N")
    add("--warmup-requests", "warmup_requests", type=int, metavar="N")
    add("--seed", "seed", type=int, metavar="N")
    add("--request-timeout", "request_timeout_s", type=float, metavar="S")
    add("--health-interval", "health_interval_s", type=float, metavar="S")
    add("--label", "label", metavar="TEXT")
    add("--json", "json_path", metavar="PATH")
    add("--progress", "progress", action=argparse.BooleanOptionalAction)
    add("--server-command", "server_command", type=shlex.split, metavar="CMD")
    add("--server-log", "server_log", metavar="PATH")
    add("--server-timeout", "server_timeout_s", type=float, metavar="S")
    add("--stop-timeout", "stop_timeout_s", type=float, metavar="S")
    return parser


def parse_args(argv: list[str], prog: str | None = None) -> BenchConfig:
    """argv (without the program name) -> BenchConfig; exits with status 2 on bad arguments."""
    parser = build_parser(prog)
    argv, passthrough = split_passthrough(argv)
    values = vars(parser.parse_args(argv))
    values["server_command"] = tuple(values["server_command"] or ())
    values["baseline_args"] = tuple(values["baseline_args"] or ())
    try:
        return BenchConfig(**values, server_args=tuple(passthrough))
    except ValueError as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits
