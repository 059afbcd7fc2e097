"""Settings of one engine process: one frozen dataclass, the single source of CLI defaults."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, dataclass, fields

from rpc.curve import FOLDER_HELP, check_plain_tcp, load_server_keys, uses_curve
from shared.config_args import opt, parse_human_int

# what --dtype takes (engine_proc/model_runner.py DTYPES maps them to torch dtypes)
DTYPE_NAMES = ("auto", "float32", "float", "fp32", "bfloat16", "bf16", "float16", "half", "fp16")


def parse_device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: cpu, cuda or cuda:N")
    return text


@dataclass(frozen=True)
class EngineConfig:
    model: str = opt("", "local checkpoint folder")
    address: str = opt("", "RPC address to bind (ipc://PATH or tcp://HOST:PORT)")
    curve_key_dir: str = opt(
        "", f"{FOLDER_HELP}; the engine reads server.key_secret and authorized/ and accepts "
        "only those API keys")
    insecure: bool = opt(
        False, "allow a tcp:// address beyond loopback without --curve-key-dir "
        "(unauthenticated, unencrypted)")
    rank: int = opt(0, "index of this engine among the server's engines")
    max_num_seqs: int = opt(64, "most sequences in one batch")
    max_num_batched_tokens: int = opt(8192, "token budget of one step (chunked prefill)")
    max_num_encoder_patches: int = opt(
        4096, "vision patches one step may encode over several images (a step's first image "
        "is encoded whatever its size)")
    encoder_stage_patches: int = opt(
        8192, "an image of more vision patches is encoded in stages, one per step, the "
        "vision tower cut at its full-attention blocks (keeps decodes going beside huge "
        "images)")
    decode_share: float = opt(
        0.0, "after a step that ran the vision tower, decode-only steps run until they took "
        "this share of its time: running requests decode faster through a burst of images, "
        "and new ones wait longer for their first token (0: off)")
    max_model_len: int = opt(0, "prompt + completion token limit (0: the model's own)",
                             parse=parse_human_int)
    block_size: int = opt(16, "tokens per KV cache block")
    enable_prefix_caching: bool = opt(
        True, "reuse the KV cache blocks of earlier requests with the same leading tokens "
        "and images")
    num_kv_blocks: int = opt(0, "KV cache blocks (0: from --kv-cache-memory-bytes)",
                             aliases=("--num-gpu-blocks-override",))
    gpu_memory_utilization: float | None = opt(
        None, "share of the GPU's total memory this engine may use, weights and activations "
        "included: the KV cache gets what is left of it after loading (vLLM's meaning; "
        "default: 80%% of the memory free after loading; GPUs only)")
    kv_cache_memory_bytes: int = opt(
        0, "KV cache bytes of each rank (0: 80%% of free GPU memory, 256 MiB on CPU); with "
        "--tensor-parallel-size N each rank holds its share of the heads in this many bytes, so "
        "an engine on a CPU holds N times it")
    max_waiting: int = opt(4096, "most requests queued in the engine before it refuses more")
    device: str | None = opt(None, "torch device (default: cuda if available, else cpu)",
                             parse=parse_device)
    dtype: str | None = opt(None, "weights and activations dtype (default: the checkpoint's)",
                            choices=DTYPE_NAMES)
    torch_threads: int = opt(
        0, "torch intra-op threads of each engine (0: torch's default, one per core, or "
        "OMP_NUM_THREADS when set)")
    engine_nice: int = opt(
        0, "niceness added to each engine process (e.g. 10: the API's event loop and image "
        "decoding preempt model math, for a steadier /health at a cost in throughput on a CPU)")
    seed: int = opt(0, "random seed of each engine: sampling without a per-request seed "
                       "repeats from one start to the next (vLLM's --seed)")
    tensor_parallel_size: int = opt(
        1, "processes (ranks) each engine's decoder is split over, one device each (vLLM's "
        "flag): attention heads, MLP rows and the vocabulary are split, the vision tower runs "
        "whole on the first rank. On a CPU the ranks share its cores: with few cores it is "
        "not faster than 1 (see docs/design.md, \"Tensor parallelism\")")
    enforce_eager: bool = opt(
        True, "run every step eagerly (vLLM's flag); --no-enforce-eager: on CUDA, steps "
        "replay CUDA graphs captured at start (see --cudagraph-mode; one rank; no effect on "
        "a CPU). Off by default until a GPU run has shown its tokens identical")
    cudagraph_mode: str = opt(
        "full_and_piecewise", "with --no-enforce-eager, which steps replay graphs (vLLM's "
        "compilation-config cudagraph_mode): full_and_piecewise: decode-only steps one "
        "graph each, steps with prompt chunks graphs in pieces around their attention and "
        "Gated DeltaNet state updates, which run eagerly (up to 512 tokens or "
        "--max-num-batched-tokens); full_decode_only: decode-only steps only; piecewise: "
        "every step in pieces", choices=("full_and_piecewise", "full_decode_only", "piecewise"))
    cudagraph_capture_sizes: tuple[int, ...] = opt(
        (), "batch sizes to capture decode graphs for (vLLM's flag; default: 1, 2, 4, then "
        "every 8 up to --max-cudagraph-capture-size)")
    max_cudagraph_capture_size: int = opt(
        0, "largest decode batch run as a graph (vLLM's flag; 0: the largest capture size, "
        "else 512), never above --max-num-seqs; and the most tokens of a step run in pieces "
        "(0: 512), never above --max-num-batched-tokens")
    pack_weights: bool = opt(
        False, "on a CPU in float32, pack the linear layers' weights once for oneDNN's GEMM "
        "(1.1-1.4x at serving batch sizes, float32 rounding apart; row counts rounded up to "
        "5 significant bits so that oneDNN builds a bounded set of kernels); off by default "
        "for now: the engine's RSS sits ~80 MB higher and takes a few hundred requests to "
        "level off")
    log_level: str = opt("info", "log level")
    mamba_ssm_cache_dtype: str = opt(
        "auto", "hybrid models (Qwen3.5): dtype of each sequence's recurrent state (auto: the "
        "checkpoint's mamba_ssm_dtype, float32 as published; vLLM's flag)",
        choices=("auto", "float32", "bfloat16", "float16"))
    mamba_cache_mode: str = opt(
        "align", "hybrid models' prefix caching (vLLM's flag): align keeps recurrent state "
        "snapshots at KV block boundaries (the prompt's last one and decoding's latest), so "
        "a request that repeats a cached prefix resumes there; none turns it off",
        choices=("align", "none"))
    state_snapshot_bytes: int = opt(
        -1, "hybrid models with prefix caching: bytes of recurrent state snapshots kept "
        "(least recently used go first; -1: one per --max-num-seqs, the slots' bytes again; "
        "counted in --kv-cache-memory-bytes when it is given)")
    encoder_cache_bytes: int = opt(
        -1, "bytes of vision embeddings kept for images seen again (skips the vision tower "
        "and, with the API's image keys, the pixels' trip); 0 turns it off; -1: an eighth of "
        "the KV cache's bytes (on CUDA at most a quarter of the memory left free after it): an "
        "image token's embedding is about an eighth of its KV (Qwen2.5-VL-7B: 7 of 56 KiB), "
        "so the cache then holds about as many image tokens as the KV cache holds tokens")

    mm_inflight_budget: int = opt(
        2 << 30, "image bytes the API processes keep in flight to this engine at most (their "
        "--mm-inflight-budget; flatserve serve sets it): pixels this engine may hold, counted "
        "in its memory plan", parse=parse_human_int)

    def __post_init__(self) -> None:
        try:  # strings from the command line, a list from JSON
            sizes = tuple(int(x) for x in self.cudagraph_capture_sizes)
        except ValueError:
            raise ValueError("cudagraph_capture_sizes must be whole numbers, got "
                             f"{' '.join(map(str, self.cudagraph_capture_sizes))}") from None
        if any(x < 1 for x in sizes):
            raise ValueError(f"cudagraph_capture_sizes must be at least 1, got {sizes}")
        object.__setattr__(self, "cudagraph_capture_sizes", sizes)
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_num_encoder_patches",
                     "encoder_stage_patches",
                     "block_size", "max_waiting", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory_bytes", "rank",
                     "torch_threads", "seed", "mm_inflight_budget",
                     "max_cudagraph_capture_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")

        if not 0 <= self.decode_share <= 1:
            raise ValueError(f"decode_share must be in [0, 1], got {self.decode_share}")
        if self.state_snapshot_bytes < -1:
            raise ValueError("state_snapshot_bytes must be -1 (auto), 0 (off) or a byte count, "
                             f"got {self.state_snapshot_bytes}")
        if self.encoder_cache_bytes < -1:
            raise ValueError("encoder_cache_bytes must be -1 (auto), 0 (off) or a byte count, "
                             f"got {self.encoder_cache_bytes}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.dtype is not None and self.dtype.removeprefix("torch.") not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.device is not None:
            try:
                parse_device(self.device)
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"device: {e}") from None
        if not 0 <= self.engine_nice <= 19:
            raise ValueError(f"engine_nice must be in 0-19, got {self.engine_nice}")
        if self.curve_key_dir:
            if not uses_curve(self.address):
                raise ValueError(f"curve_key_dir: keys apply to tcp:// addresses, not "
                                 f"{self.address!r}")
            load_server_keys(self.curve_key_dir)  # fails here, before the model loads
        else:
            check_plain_tcp(self.address, self.insecure)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
