"""API process settings: one frozen dataclass, validated once, the only source of CLI defaults."""

from __future__ import annotations

import argparse
import json
import os
import ssl
from dataclasses import dataclass, replace
from pathlib import Path

from api_proc.protocol import check_template_kwargs
from rpc.curve import FOLDER_HELP, ClientKeys, check_plain_tcp, load_client_keys
from shared.config_args import add_dataclass_args, dataclass_from_args, opt, parse_human_int
from shared.model_config import ImageProcessorConfig, load_model_config
from shared.sampling_params import MAX_LOGPROBS

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
# Qwen's `<tool_call>` JSON (api_proc/tool_parser.py); vLLM names it after the Hermes models
TOOL_CALL_PARSERS = ("hermes", "qwen3_coder")
# `<think>...</think>` read out as message.reasoning (api_proc/reasoning_parser.py)
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def parse_json_list(text: str) -> list[str]:
    """vLLM's JSON list of strings ('["http://a.example", "http://b.example"]'); a bare
    string is a list of one."""
    if not text.lstrip().startswith("["):
        return [text]
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list") from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list of strings")
    return value


DEFAULT_IMAGE_LIMIT = 8
DEFAULT_VIDEO_LIMIT = 1


def parse_mm_limit(text: str) -> tuple[int, int]:
    """--limit-mm-per-prompt: '8' (images) or vLLM's '{"image": 8, "video": 1}' ->
    (images, videos); a modality left out keeps its default (audio must be 0)."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count nor a JSON object") \
            from None
    if isinstance(value, int) and not isinstance(value, bool):
        value = {"image": value}
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count nor a JSON object")
    unknown = set(value) - {"image", "video", "audio"}
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown modality {sorted(unknown)[0]!r}")
    if value.get("audio"):
        raise argparse.ArgumentTypeError("audio is not supported: its limit must be 0")
    counts = []
    for name, default in (("image", DEFAULT_IMAGE_LIMIT), ("video", DEFAULT_VIDEO_LIMIT)):
        count = value.get(name, default)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise argparse.ArgumentTypeError(f"the {name} limit must be a count, got {count!r}")
        counts.append(count)
    return counts[0], counts[1]


VIDEO_IO_KWARGS = ("num_frames", "fps")
DEFAULT_VIDEO_NUM_FRAMES = 32  # vLLM's: frames sampled uniformly over the whole clip


def check_media_io_kwargs(value) -> dict:
    """vLLM's media_io_kwargs ({"video": {"num_frames": N, "fps": F}}) checked; ValueError
    names what is wrong. num_frames: frames sampled uniformly; fps > 0: at most that many
    frames a second of the clip (and at most num_frames). Other keys are refused by name."""
    if not isinstance(value, dict):
        raise ValueError("media_io_kwargs must be a JSON object")
    for modality in value:
        if modality != "video":
            raise ValueError(f"media_io_kwargs: {modality!r} takes no settings here (only "
                             "video: num_frames, fps)")
    video = value.get("video") or {}
    if not isinstance(video, dict):
        raise ValueError("media_io_kwargs.video must be a JSON object")
    for key, v in video.items():
        if key not in VIDEO_IO_KWARGS:
            raise ValueError(f"media_io_kwargs.video: unknown setting {key!r} (flatserve "
                             f"takes {', '.join(VIDEO_IO_KWARGS)})")
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"media_io_kwargs.video.{key} must be a number, got {v!r}")
    num_frames = video.get("num_frames")
    if num_frames is not None and (not isinstance(num_frames, int) or num_frames < 1):
        raise ValueError(f"media_io_kwargs.video.num_frames must be a positive count, got "
                         f"{num_frames!r} (every frame, -1, is not taken: it would decode and "
                         "keep the whole clip)")
    fps = video.get("fps")
    if fps is not None and not fps > 0:
        raise ValueError(f"media_io_kwargs.video.fps must be positive, got {fps!r}")
    return {"video": dict(video)} if video else {}


def parse_media_io_kwargs(text: str) -> str:
    """--media-io-kwargs: vLLM's JSON ('{"video": {"num_frames": 32, "fps": 2}}'), kept as
    canonical JSON text (a frozen config holds no dict)."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object") from None
    try:
        return json.dumps(check_media_io_kwargs(value), sort_keys=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


IMAGE_SIZE_KWARGS = ("min_pixels", "max_pixels")
REASONING_CONFIG_KEYS = ("reasoning_start_str", "reasoning_end_str")


def parse_reasoning_config(text: str) -> str:
    """--reasoning-config: vLLM's JSON object naming the thinking markers
    ('{"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}'), as canonical
    JSON text; other keys are refused by name."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    for key, marker in value.items():
        if key not in REASONING_CONFIG_KEYS:
            raise argparse.ArgumentTypeError(
                f"unknown reasoning setting {key!r}: flatserve takes "
                f"{', '.join(REASONING_CONFIG_KEYS)}")
        if not isinstance(marker, str) or not marker:
            raise argparse.ArgumentTypeError(f"{key} must be a non-empty string")
    return json.dumps(value)


def template_kwargs_json(text: str) -> str:
    """A JSON object of chat template variables, checked as a request's chat_template_kwargs
    are, as canonical JSON text (a frozen config holds no dict); ValueError with the reason."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"{text!r} is not a JSON object")
    return json.dumps(check_template_kwargs(value))


def parse_template_kwargs(text: str) -> str:
    """--default-chat-template-kwargs: vLLM's JSON object of chat template variables."""
    try:
        return template_kwargs_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_mm_processor_kwargs(text: str) -> tuple[tuple[str, int], ...]:
    """--mm-processor-kwargs: vLLM's JSON object of image processor settings. Qwen-VL's
    resize bounds are what apply here: '{"min_pixels": N, "max_pixels": M}', or the newer
    processors' '{"size": {"shortest_edge": N, "longest_edge": M}}' (the same two pixel
    counts); anything else is refused by name."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    size = value.pop("size", None)
    if size is not None:
        if not isinstance(size, dict) or set(size) - {"shortest_edge", "longest_edge"}:
            raise argparse.ArgumentTypeError(
                "size takes shortest_edge and longest_edge (the min and max pixel counts)")
        for key, name in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
            if key in size:
                if name in value:
                    raise argparse.ArgumentTypeError(f"{name} is given twice (and as size.{key})")
                value[name] = size[key]
    for key, count in value.items():
        if key not in IMAGE_SIZE_KWARGS:
            raise argparse.ArgumentTypeError(
                f"unknown processor setting {key!r}: flatserve takes the resize bounds "
                f"{', '.join(IMAGE_SIZE_KWARGS)} (how videos are sampled: --media-io-kwargs)")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise argparse.ArgumentTypeError(f"{key} must be a positive pixel count, got {count!r}")
    return tuple(sorted(value.items()))


@dataclass(frozen=True)
class ApiConfig:
    model: str = opt("", "local checkpoint folder (tokenizer, chat template, preprocessor)")
    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(8000, "port to listen on")
    served_model_name: tuple[str, ...] = opt(
        (), "model ids clients may use, the first one in responses (default: the folder's name)")
    api_key: str | None = opt(None, "require 'Authorization: Bearer KEY' on /v1 routes and "
                                    "/metrics (/health answers without it, status only)")
    allow_unauthenticated_metrics: bool = opt(
        False, "with --api-key: serve /metrics without the key (a scraper that holds none)")
    root_path: str = opt("", "the path prefix a proxy serves this API under (FastAPI's "
                             "root_path): both /PREFIX/v1/... and /v1/... are served")
    allowed_origins: tuple[str, ...] = opt(
        (), "CORS: origins browsers may call from, vLLM's JSON list ('[\"*\"]': any) (default: "
        "none, no CORS headers; vLLM's default is any)", parse=parse_json_list)
    allowed_methods: tuple[str, ...] = opt(("*",), "CORS: allowed methods, a JSON list",
                                           parse=parse_json_list)
    allowed_headers: tuple[str, ...] = opt(("*",), "CORS: allowed request headers, a JSON list",
                                           parse=parse_json_list)
    allow_credentials: bool = opt(False, "CORS: let browsers send cookies and credentials")
    max_model_len: int = opt(0, "prompt + completion token limit, as 4096, 32k or 32K (0: the "
                                "model's own, at most 8192)", parse=parse_human_int)
    limit_mm_per_prompt: tuple[int, int] = opt(
        (DEFAULT_IMAGE_LIMIT, DEFAULT_VIDEO_LIMIT), "most images (and videos) in one request: "
        "N images, or vLLM's JSON form '{\"image\": N, \"video\": M}' (default 8 and 1)",
        parse=parse_mm_limit)
    media_io_kwargs: str = opt(
        "{}", "how videos are sampled, vLLM's JSON form '{\"video\": {\"num_frames\": 32, "
        "\"fps\": 2}}': num_frames spread uniformly over the clip (default 32), at most fps a "
        "second when given; a request's media_io_kwargs override it within --max-video-frames",
        parse=parse_media_io_kwargs)
    max_video_bytes: int = opt(64 * MiB, "most encoded bytes per video (a frame list: all "
                                         "its frames)")
    max_video_frames: int = opt(64, "most frames sampled from one video (num_frames above it "
                                    "is refused)")
    max_video_decode_frames: int = opt(
        7200, "most frames the decoder may walk through in one video (its whole length: "
        "decoding is sequential), 4 minutes at 30 fps")
    max_video_pixels: int = opt(4096 * 2160, "most pixels a video frame may declare")
    max_video_duration_s: float = opt(600.0, "longest video a request may send, in seconds")
    video_fetch_timeout_s: float = opt(30.0, "deadline for downloading one video (vLLM's)")
    ssl_keyfile: str | None = opt(None, "TLS: the server's private key file (PEM)")
    ssl_certfile: str | None = opt(None, "TLS: the server's certificate chain file (PEM); with "
                                         "--ssl-keyfile the API serves https://")
    ssl_ca_certs: str | None = opt(None, "TLS: CA certificates that client certificates must "
                                         "chain to (with --ssl-cert-reqs)")
    ssl_cert_reqs: int = opt(0, "TLS: client certificates: 0 not asked for, 1 optional, 2 "
                                "required (Python's ssl.CERT_* values, as vLLM)",
                             choices=(0, 1, 2))
    mm_processor_kwargs: tuple[tuple[str, int], ...] = opt(
        (), "image resize bounds over the model's preprocessor_config.json, vLLM's JSON form: "
        "'{\"min_pixels\": N, \"max_pixels\": M}' (or '{\"size\": {\"shortest_edge\": N, "
        "\"longest_edge\": M}}'): every image is resized to between N and M pixels",
        parse=parse_mm_processor_kwargs)
    max_image_pixels: int = opt(40_000_000, "most pixels an image header may declare")
    max_image_bytes: int = opt(20 * MiB, "most encoded bytes per image")
    max_body_bytes: int = opt(200 * MiB, "most bytes in one HTTP request body")
    shutdown_timeout_s: float = opt(
        30.0, "on SIGTERM/SIGINT: seconds the requests in flight may take to finish (no new "
        "ones are accepted); those still running then end with an error", aliases=(
            "--shutdown-timeout",))
    max_header_bytes: int = opt(64 * KiB, "most bytes in a request's line and headers (431 "
                                          "past it)")
    body_read_timeout_s: float = opt(60.0, "seconds a request body may take to arrive, not "
                                           "counting waits for budget (408 past it)")
    max_unread_bodies: int = opt(64, "most request bodies being received at once; more wait "
                                     "for a turn (429 after --body-read-timeout-s)")
    header_read_timeout_s: float = opt(10.0, "seconds a request's line and headers may take "
                                             "to arrive (408 past it, and the connection "
                                             "closes)")
    mm_inflight_budget: int = opt(
        2 * GiB, "most image bytes in flight: request bodies, decoding and resizing, and "
        "resized pixels until their engine has prefilled them")
    # Waiting for budget includes waiting behind images queued in the engines, which is
    # where a request would otherwise wait; so the default is long, like an engine queue.
    admission_timeout_s: float = opt(300.0, "how long a request waits for budget before 429")
    allowed_media_domains: tuple[str, ...] | None = opt(
        None, "hosts image URLs may name (default: any public host)"
    )
    allowed_local_media_path: str | None = opt(
        None, "folder file:// image URLs may read from (default: none)"
    )
    allow_private_media_addresses: bool = opt(
        False, "let image URLs reach loopback/private/link-local addresses"
    )
    media_fetch_timeout_s: float = opt(10.0, "deadline for downloading one image")
    media_workers: int = opt(0, "threads decoding and resizing images (0: min(4, cpus))")
    max_n: int = opt(16, "most choices (n) per request")
    max_logprobs: int = opt(20, "most top_logprobs (chat) or logprobs (completions) a request "
                                "may ask for; -1: the whole vocabulary (requests may then ask "
                                "for -1, as in vLLM)")
    generation_config: str = opt(
        "auto", "default sampling settings for requests that leave them out: 'auto' reads the "
        "model folder's generation_config.json (temperature, top_p, top_k, "
        "repetition_penalty), 'vllm' uses none, or a folder holding a generation_config.json")
    enable_log_requests: bool = opt(False, "log each request's id, prompt length and settings "
                                           "(never its text or images)")
    engine_addresses: tuple[str, ...] = opt(
        (), "engine RPC addresses (ipc:// or tcp://), of engines started with `flatserve "
        "engine`; none is spawned then")
    curve_key_dir: str | None = opt(
        None, f"{FOLDER_HELP}; the API reads client.key_secret and server.key")
    insecure: bool = opt(
        False, "allow plain tcp:// to engines beyond loopback without --curve-key-dir "
        "(unauthenticated, unencrypted)")
    chat_template: str | None = opt(
        None, "a Jinja chat template file used instead of the model's own")
    enable_auto_tool_choice: bool = opt(
        False, "let the model decide to call tools (tool_choice auto); needs "
        "--tool-call-parser")
    tool_call_parser: str | None = opt(
        None, f"how tool calls are read from the output: {', '.join(TOOL_CALL_PARSERS)}")
    reasoning_parser: str | None = opt(
        None, "read the model's <think>...</think> out of chat completions into "
        "message.reasoning (and reasoning_content)", choices=REASONING_PARSERS)
    return_tokens_as_token_ids: bool = opt(
        False, "write log-probability tokens as 'token_id:ID' (a request's "
        "return_tokens_as_token_ids overrides it), as vLLM does")
    skip_tokenizer_init: bool = opt(
        False, "token in, token out (vLLM's): /v1/completions takes token id prompts only and "
        "answers with ids (return_token_ids), no text; chat and text prompts are refused")
    enable_force_include_usage: bool = opt(
        False, "usage in every streamed chunk, whatever stream_options say (vLLM's)")
    stream_interval: int = opt(
        1, "tokens per streamed chunk (vLLM's): a choice's first token is written at once, "
        "then a chunk once N tokens have come since the last, and its end; fewer, larger "
        "chunks cost the API process less per token at high concurrency")
    sse_keep_alive_interval: float = opt(
        0.0, "seconds (0.1 or more): a streamed response that has written nothing for this "
        "long since its headers (queued in an engine, a long prefill, slow tokens) writes an "
        "SSE comment line, so that proxies with read timeouts keep the connection (vLLM's); "
        "0: never")
    enable_server_load_tracking: bool = opt(
        False, "count the requests being served, for GET /load (vLLM's server_load)")
    uds: str | None = opt(None, "listen on this Unix domain socket instead of --host and "
                                "--port (vLLM's --uds)")
    reasoning_config: str | None = opt(
        None, "the thinking markers thinking_token_budget counts between and forces, vLLM's "
        "JSON object '{\"reasoning_start_str\": \"<think>\", \"reasoning_end_str\": "
        "\"</think>\"}' (default: the reasoning parser's)", parse=parse_reasoning_config)
    default_chat_template_kwargs: str | None = opt(
        None, "chat template variables for every chat request, a JSON object such as "
        "'{\"enable_thinking\": false}'; a request's chat_template_kwargs override them",
        parse=parse_template_kwargs)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: a local checkpoint folder is required")
        if not Path(self.model).is_dir():
            raise ValueError(f"model: {self.model} is not a folder")
        names = self.served_model_name
        names = (names,) if isinstance(names, str) else tuple(names)
        if any(not n for n in names):
            raise ValueError("served_model_name: names must not be empty")
        object.__setattr__(self, "served_model_name",
                           names or (Path(self.model).resolve().name,))
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (use None to disable)")
        if self.allow_unauthenticated_metrics and self.api_key is None:
            raise ValueError("allow_unauthenticated_metrics applies with api_key only "
                             "(without one every route is open)")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path == "/"
                               or self.root_path.endswith("/")):
            raise ValueError(f"root_path must look like /prefix, got {self.root_path!r}")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        if not self.allowed_origins and (self.allow_credentials or self.allowed_methods != ("*",)
                                         or self.allowed_headers != ("*",)):
            raise ValueError("allowed_methods, allowed_headers and allow_credentials apply to "
                             "the origins in allowed_origins: give it too")
        for name in ("max_model_len", "media_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        limits = self.limit_mm_per_prompt
        if isinstance(limits, int):  # a count of images, the video limit its default
            limits = (limits, DEFAULT_VIDEO_LIMIT)
        limits = tuple(limits)
        if len(limits) != 2 or min(limits) < 0:
            raise ValueError(f"limit_mm_per_prompt must be (images, videos) counts, got {limits}")
        object.__setattr__(self, "limit_mm_per_prompt", limits)
        try:
            kwargs = check_media_io_kwargs(json.loads(self.media_io_kwargs))
        except ValueError as e:
            raise ValueError(f"media_io_kwargs: {e}") from None
        object.__setattr__(self, "media_io_kwargs", json.dumps(kwargs, sort_keys=True))
        if self.video_num_frames > self.max_video_frames:
            raise ValueError(f"media_io_kwargs: num_frames {self.video_num_frames} is above "
                             f"max_video_frames={self.max_video_frames}")
        for name in ("max_image_pixels", "max_image_bytes", "max_body_bytes", "max_video_bytes",
                     "max_video_frames", "max_video_decode_frames", "max_video_pixels",
                     "max_header_bytes", "max_unread_bodies", "mm_inflight_budget", "max_n",
                     "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not (self.sse_keep_alive_interval == 0
                or 0.1 <= self.sse_keep_alive_interval < float("inf")):
            raise ValueError(f"sse_keep_alive_interval must be 0 (off) or at least 0.1 "
                             f"seconds, got {self.sse_keep_alive_interval}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must not be negative, got "
                             f"{self.shutdown_timeout_s}")
        for name in ("admission_timeout_s", "media_fetch_timeout_s", "header_read_timeout_s",
                     "body_read_timeout_s", "video_fetch_timeout_s", "max_video_duration_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.allowed_media_domains is not None:
            domains = tuple(d.strip().lower().rstrip(".") for d in self.allowed_media_domains)
            if not all(domains):
                raise ValueError("allowed_media_domains must not contain empty names")
            object.__setattr__(self, "allowed_media_domains", domains)
        if self.allowed_local_media_path is not None:
            root = Path(self.allowed_local_media_path)
            if not root.is_dir():
                raise ValueError(f"allowed_local_media_path: {root} is not a folder")
            object.__setattr__(self, "allowed_local_media_path", str(root.resolve()))
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ValueError(f"chat_template: {self.chat_template} is not a file")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_config is not None and self.reasoning_parser is None:
            raise ValueError("reasoning_config applies with a reasoning_parser (which reads "
                             "the thinking out)")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.default_chat_template_kwargs is not None:
            try:
                text = template_kwargs_json(self.default_chat_template_kwargs)
            except ValueError as e:
                raise ValueError(f"default_chat_template_kwargs: {e}") from None
            object.__setattr__(self, "default_chat_template_kwargs", text)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser")
        if not -1 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [-1, {MAX_LOGPROBS}], got "
                             f"{self.max_logprobs}")
        if self.generation_config not in ("auto", "vllm") and not (
                Path(self.generation_config) / "generation_config.json").is_file():
            raise ValueError(f"generation_config: {self.generation_config} is not 'auto', 'vllm' "
                             "or a folder holding a generation_config.json")
        object.__setattr__(self, "engine_addresses", tuple(self.engine_addresses))
        for addr in self.engine_addresses:
            if not addr.startswith(("ipc://", "tcp://")):
                raise ValueError(f"engine address {addr!r} must start with ipc:// or tcp://")
            if self.curve_key_dir is None:
                check_plain_tcp(addr, self.insecure)
        self.client_keys()  # a missing or unreadable key fails here, before any process starts
        self.ssl_context()  # unreadable or mismatched TLS files fail here too
        object.__setattr__(self, "mm_processor_kwargs", tuple(self.mm_processor_kwargs))
        if self.mm_processor_kwargs and self.model:
            self.image_config(load_model_config(self.model).image)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS settings loaded as uvicorn will load them, or None for plain HTTP."""
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together")
        if self.ssl_certfile is None:
            if self.ssl_ca_certs is not None or self.ssl_cert_reqs:
                raise ValueError("ssl_ca_certs and ssl_cert_reqs need ssl_keyfile and "
                                 "ssl_certfile")
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
            if self.ssl_ca_certs is not None:
                context.load_verify_locations(self.ssl_ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"TLS files cannot be loaded: {exc}") from None
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ValueError("ssl_cert_reqs needs ssl_ca_certs (what client certificates chain to)")
        return context

    @property
    def scheme(self) -> str:
        return "http" if self.ssl_certfile is None else "https"

    def image_config(self, model_image: ImageProcessorConfig) -> ImageProcessorConfig:
        """The model's image processor settings with --mm-processor-kwargs over them."""
        cfg = replace(model_image, **dict(self.mm_processor_kwargs))
        if cfg.min_pixels > cfg.max_pixels:
            raise ValueError(f"mm_processor_kwargs: min_pixels {cfg.min_pixels} is above "
                             f"max_pixels {cfg.max_pixels}")
        if cfg.max_pixels < cfg.factor ** 2:
            raise ValueError(f"mm_processor_kwargs: max_pixels {cfg.max_pixels} is below one "
                             f"merged patch ({cfg.factor}x{cfg.factor} pixels)")
        return cfg

    def client_keys(self) -> ClientKeys | None:
        """The CURVE keys of connections to tcp:// engines."""
        return None if self.curve_key_dir is None else load_client_keys(self.curve_key_dir)

    def default_sampling(self) -> dict:
        """The sampling defaults --generation-config names (vLLM's meaning)."""
        if self.generation_config == "vllm":
            return {}
        folder = Path(self.model if self.generation_config == "auto" else self.generation_config)
        path = folder / "generation_config.json"
        if not path.is_file():
            return {}
        data = json.loads(path.read_text())
        keys = ("temperature", "top_p", "top_k", "repetition_penalty")
        return {k: data[k] for k in keys if isinstance(data.get(k), int | float)}

    @property
    def reasoning_markers(self) -> tuple[str, str]:
        """The thinking start and end markers (--reasoning-config, else the parsers')."""
        given = json.loads(self.reasoning_config) if self.reasoning_config else {}
        return (given.get("reasoning_start_str", "<think>"),
                given.get("reasoning_end_str", "</think>"))

    @property
    def template_defaults(self) -> dict:
        """--default-chat-template-kwargs as a dict (a new one each time: callers merge)."""
        text = self.default_chat_template_kwargs
        return {} if text is None else json.loads(text)

    @property
    def model_name(self) -> str:
        """The served name responses carry: the first of served_model_name."""
        return self.served_model_name[0]

    @property
    def max_images_per_prompt(self) -> int:
        return self.limit_mm_per_prompt[0]

    @property
    def max_videos_per_prompt(self) -> int:
        return self.limit_mm_per_prompt[1]

    @property
    def video_num_frames(self) -> int:
        """Frames sampled from a video unless its request says otherwise."""
        video = json.loads(self.media_io_kwargs).get("video", {})
        return int(video.get("num_frames", DEFAULT_VIDEO_NUM_FRAMES))

    @property
    def video_fps(self) -> float | None:
        return json.loads(self.media_io_kwargs).get("video", {}).get("fps")

    @property
    def num_media_workers(self) -> int:
        return self.media_workers or min(4, os.cpu_count() or 1)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one --flag per field; defaults and help come from the fields themselves."""
        add_dataclass_args(parser, cls)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides) -> ApiConfig:
        return dataclass_from_args(cls, args, **overrides)
