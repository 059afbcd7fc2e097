"""Settings of one engine process: one frozen dataclass, the single source of CLI defaults."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, dataclass, fields

from shared.config_args import opt

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
    rank: int = opt(0, "index of this engine among the server's engines")
    max_num_seqs: int = opt(64, "most sequences in one batch")
    max_num_batched_tokens: int = opt(8192, "token budget of one step (chunked prefill)")
    max_num_encoder_patches: int = opt(
        4096, "vision patches one step may encode (a larger image is encoded in stages, one "
        "per step, the vision tower cut at its full-attention blocks)")
    max_model_len: int = opt(0, "prompt + completion token limit (0: the model's own)")
    block_size: int = opt(16, "tokens per KV cache block")
    enable_prefix_caching: bool = opt(
        True, "reuse the KV cache blocks of earlier requests with the same leading tokens "
        "and images")
    num_kv_blocks: int = opt(0, "KV cache blocks (0: from --kv-cache-memory-bytes)")
    gpu_memory_utilization: float | None = opt(
        None, "share of the GPU's total memory this engine may use, weights and activations "
        "included: the KV cache gets what is left of it after loading (vLLM's meaning; "
        "default: 80%% of the memory free after loading; GPUs only)")
    kv_cache_memory_bytes: int = opt(0, "KV cache bytes (0: 80%% of free GPU memory, 256 MiB on CPU)")
    max_waiting: int = opt(4096, "most requests queued in the engine before it refuses more")
    device: str | None = opt(None, "torch device (default: cuda if available, else cpu)",
                             parse=parse_device)
    dtype: str | None = opt(None, "weights and activations dtype (default: the checkpoint's)",
                            choices=DTYPE_NAMES)
    torch_threads: int = opt(
        0, "torch intra-op threads of each engine (0: torch's default, one per core, or "
        "OMP_NUM_THREADS when set)")
    engine_nice: int = opt(
        -1, "niceness added to each engine process (-1: 10 when it computes on the CPU, so "
        "the API's event loop and image decoding preempt model math; 0 on a GPU)")
    tensor_parallel_size: int = opt(
        1, "processes (ranks) each engine's decoder is split over, one device each (vLLM's "
        "flag): attention heads, MLP rows and the vocabulary are split, the vision tower runs "
        "whole on the first rank. On a CPU the ranks share its cores: with few cores it is "
        "not faster than 1 (see README)")
    log_level: str = opt("info", "log level")
    encoder_cache_bytes: int = opt(
        -1, "bytes of vision embeddings kept for images seen again (skips the vision tower "
        "and, with the API's image keys, the pixels' trip); 0 turns it off; -1: an eighth of "
        "the KV cache's bytes (on CUDA at most a quarter of the memory left free after it): an "
        "image token's embedding is about an eighth of its KV (Qwen2.5-VL-7B: 7 of 56 KiB), "
        "so the cache then holds about as many image tokens as the KV cache holds tokens")

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_num_encoder_patches",
                     "block_size", "max_waiting", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory_bytes", "rank",
                     "torch_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")

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
        if not -1 <= self.engine_nice <= 19:
            raise ValueError(f"engine_nice must be -1 (auto) or 0-19, got {self.engine_nice}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
