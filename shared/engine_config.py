"""Settings of one engine process: one frozen dataclass, the single source of CLI defaults."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class EngineConfig:
    model: str
    address: str
    rank: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: derived from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 0  # 0: 80% of free device memory on CUDA, 256 MiB on CPU
    max_waiting: int = 4096
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str | None = None  # None: the checkpoint's dtype
    log_level: str = "info"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_kv_blocks < 0 or self.kv_cache_memory_bytes < 0:
            raise ValueError("KV cache size must be positive")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
