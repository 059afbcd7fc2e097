"""Soak-run settings: one frozen dataclass, validated once, the only source of CLI defaults."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shared.config_args import opt

DEFAULT_REQUESTS = 1000


@dataclass(frozen=True)
class SoakConfig:
    # stop condition: whichever comes first; neither given means DEFAULT_REQUESTS requests
    requests: int | None = opt(None, f"requests to send (default {DEFAULT_REQUESTS} unless "
                                      "--duration-min is given)")
    duration_min: float | None = opt(None, "minutes to run (stops at --requests too, if given)")
    concurrency: int = opt(16, "requests in flight at once (also the connection pool size)")
    image_size: int = opt(448, "side of the square generated images, in pixels")
    images_per_request: int = opt(1, "images (or videos) in each multimodal request")
    workload: str = opt("image", "what multimodal requests send: image, or video (a distinct "
                                 "H.264 clip of --video-frames frames, --image-size square, "
                                 "per request)", choices=("image", "video"))
    video_frames: int = opt(16, "frames of each clip of the video workload (4 fps)")
    max_tokens: int = opt(32, "max_tokens of each request")
    stream: bool = opt(True, "stream responses (SSE)")
    disconnect_share: float = opt(0.1, "share of requests whose client disconnects mid-response")
    text_only_share: float = opt(0.1, "share of requests (of conversations, with --turns) "
                                      "without images")
    turns: int = opt(1, "requests per conversation: with N > 1 each worker sends a "
                        "conversation's N turns one after another, each re-sending its "
                        "image(s) and the earlier turns (the multi-turn load the prefix and "
                        "encoder caches serve)")
    warmup_share: float = opt(0.2, "share of requests before the slope fit starts")
    interval_s: float = opt(1.0, "seconds between RSS samples")
    uss_every: int = opt(5, "read USS every Nth sample (slow; 0: never)")
    max_slope: float = opt(2.0, "most RSS growth allowed, MB per 1,000 requests, per process")
    out: str | None = opt(None, "output folder (default out/soak-<timestamp>)")
    json_path: str | None = opt(None, "also write the JSON summary here ('-': stdout)")
    url: str | None = opt(None, "attach to this running server instead of starting one")
    pids: tuple[int, ...] = opt((), "processes to sample when attaching (default: the one "
                                     "listening on --url's port and its children)")
    api_key: str | None = opt(None, "API key sent as 'Authorization: Bearer KEY'")
    model: str | None = opt(None, "model name (default: the first id from GET /v1/models)")
    budget_mb: float | None = opt(None, "in-flight multimodal budget to draw, MB (default: "
                                         "--mm-inflight-budget of a started server)")
    allow_status: tuple[int, ...] = opt((), "HTTP statuses counted as expected rejections, "
                                             "not errors (e.g. 429 503)")
    extra_body: dict | None = opt(None, "JSON object merged into every request body")
    request_timeout_s: float = opt(300.0, "per-request read timeout, seconds")
    max_errors: int = opt(100, "stop sending after this many unexpected errors")
    seed: int = opt(0, "seed of images and per-request choices")
    pool_size: int = opt(8, "base images generated up front (fewer when they are huge)")
    progress: bool = opt(True, "show a progress bar")
    # starting the server itself
    server_args: tuple[str, ...] = opt((), "arguments after '--', passed to flatserve serve")
    server_command: tuple[str, ...] = opt((), "command that starts the server before "
                                               "'--port N' (default: python -m flatserve.cli serve)")
    server_env: dict[str, str] | None = opt(None, "extra environment of the started server")
    server_timeout_s: float = opt(300.0, "seconds to wait for the started server's /health")
    stop_timeout_s: float = opt(15.0, "seconds between SIGINT and SIGKILL when stopping it")
    idle_samples: int = opt(3, "RSS samples taken before the load starts")

    def __post_init__(self) -> None:
        if self.requests is None and self.duration_min is None:
            object.__setattr__(self, "requests", DEFAULT_REQUESTS)
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be at least 1, got {self.requests}")
        if self.duration_min is not None and not self.duration_min > 0:
            raise ValueError(f"duration_min must be positive, got {self.duration_min}")
        for name in ("concurrency", "image_size", "max_tokens", "pool_size", "max_errors",
                     "turns", "video_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("images_per_request", "uss_every", "idle_samples"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        for name in ("disconnect_share", "text_only_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0.0 <= self.warmup_share < 1.0:
            raise ValueError(f"warmup_share must be in [0, 1), got {self.warmup_share}")
        for name in ("interval_s", "max_slope", "request_timeout_s", "server_timeout_s",
                     "stop_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.budget_mb is not None and not self.budget_mb > 0:
            raise ValueError(f"budget_mb must be positive, got {self.budget_mb}")
        if self.url is None and self.pids:
            raise ValueError("pids need url: they name processes of a running server")
        if self.url is not None and self.server_args:
            raise ValueError("arguments after '--' start a server; they make no sense with url")
        if self.extra_body is not None and not isinstance(self.extra_body, dict):
            raise ValueError("extra_body must be a JSON object")
        for name in ("pids", "allow_status", "server_args", "server_command"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.url is not None:
            object.__setattr__(self, "url", self.url.rstrip("/"))

    @property
    def duration_s(self) -> float | None:
        return None if self.duration_min is None else self.duration_min * 60.0

    def out_dir(self) -> Path:
        return Path(self.out or time.strftime("out/soak-%Y%m%d-%H%M%S"))

    def start_command(self, port: int | None) -> list[str]:
        return serve_command(self.server_command, self.server_args, port)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def serve_command(server_command: tuple[str, ...], server_args: tuple[str, ...],
                  port: int | None) -> list[str]:
    """The command that starts a server: `server_command` (default: flatserve serve), then
    '--port N' unless `port` is None, then `server_args`."""
    base = list(server_command) or [sys.executable, "-m", "flatserve.cli", "serve"]
    return [*base, *([] if port is None else ["--port", str(port)]), *server_args]


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'2147483648', '2GiB', '512M', '1.5GB' -> bytes (suffixes are powers of 1024)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a byte size: {text!r}")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** "_kmgt".index(unit or "_"))


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """argv -> (the tool's own arguments, those after '--' that go to the server)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def passthrough_value(args: tuple[str, ...] | list[str], flag: str) -> str | None:
    """The value of `flag` in argv-style `args` ('--flag V' or '--flag=V'; the last one wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def _default(name: str):
    return next(f.default for f in dataclasses.fields(SoakConfig) if f.name == name)


def _help(name: str) -> str:
    return next(f.metadata["help"] for f in dataclasses.fields(SoakConfig) if f.name == name)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Send image chat requests at a set concurrency and check that the RSS of "
                    "every server process stays flat. Arguments after '--' go to "
                    "'flatserve serve' when the server is started here.",
    )

    def add(flag: str, name: str, **kwargs) -> None:
        kwargs.setdefault("default", _default(name))
        shown = kwargs["default"] not in (None, ()) and "default" not in _help(name)
        help = _help(name) + (" (default: %(default)s)" if shown else "")
        parser.add_argument(flag, dest=name, help=help, **kwargs)

    add("--requests", "requests", type=int)
    add("--duration-min", "duration_min", type=float)
    add("--concurrency", "concurrency", type=int)
    add("--image-size", "image_size", type=int, metavar="PIXELS")
    add("--images-per-request", "images_per_request", type=int)
    add("--workload", "workload", choices=("image", "video"))
    add("--video-frames", "video_frames", type=int)
    add("--max-tokens", "max_tokens", type=int)
    add("--stream", "stream", action=argparse.BooleanOptionalAction)
    add("--disconnect-share", "disconnect_share", type=float)
    add("--text-only-share", "text_only_share", type=float)
    add("--turns", "turns", type=int)
    add("--warmup-share", "warmup_share", type=float)
    add("--interval", "interval_s", type=float, metavar="S")
    add("--uss-every", "uss_every", type=int)
    add("--max-slope", "max_slope", type=float, metavar="MB")
    add("--out", "out", metavar="DIR")
    add("--json", "json_path", metavar="PATH")
    add("--url", "url")
    add("--pid", "pids", type=int, nargs="+", action="extend", default=None)
    add("--api-key", "api_key")
    add("--model", "model", metavar="NAME")
    add("--budget-mb", "budget_mb", type=float)
    add("--allow-status", "allow_status", type=int, nargs="+", action="extend", default=None)
    add("--extra-body", "extra_body", type=json.loads, metavar="JSON")
    add("--request-timeout", "request_timeout_s", type=float, metavar="S")
    add("--max-errors", "max_errors", type=int)
    add("--seed", "seed", type=int)
    add("--pool-size", "pool_size", type=int)
    add("--progress", "progress", action=argparse.BooleanOptionalAction)
    add("--server-command", "server_command", type=shlex.split, metavar="CMD")
    add("--server-timeout", "server_timeout_s", type=float, metavar="S")
    add("--stop-timeout", "stop_timeout_s", type=float, metavar="S")
    return parser


def parse_args(argv: list[str], prog: str | None = None) -> SoakConfig:
    """argv (without the program name) -> SoakConfig; exits with status 2 on bad arguments."""
    parser = build_parser(prog)
    argv, passthrough = split_passthrough(argv)
    args = parser.parse_args(argv)
    values = vars(args)
    for name in ("pids", "allow_status"):
        values[name] = tuple(values[name] or ())
    values["server_command"] = tuple(values["server_command"] or ())
    try:
        return SoakConfig(**values, server_args=tuple(passthrough))
    except ValueError as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits
