"""Tensor parallelism inside one engine: this process's rank in its engine's group, and the
collectives the parallel layers call.

One engine is `size` processes, one per rank: rank 0 is the engine process (socket,
scheduler, sampler, vision tower), ranks 1.. are workers that only run the decoder's
forward (engine_proc/tp_worker.py). The group is torch.distributed's default group of each
process: gloo on the CPU, NCCL on CUDA. Outside a group (size 1) every collective here is
the identity, so a single-process engine runs exactly the code it ran before.

Parallel layers take their `Shard` when they are built; the model is built after
`init_group`, so the decoder's layers see this process's shard and the vision tower
(which stays whole, on rank 0) is built with `REPLICATED`.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A collective that waits longer than this inside a step fails (the peer is alive but
# stuck); a dead peer is noticed at once by its process (tensor_parallel.py), not by this,
# and in an engine process, also while the engine is being built.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class Shard:
    """Which part of a split layer this process holds: part `rank` of `size`."""

    rank: int = 0
    size: int = 1

    def split(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's equal part of `total` (which `size` divides)."""
        if total % self.size:
            raise ValueError(f"{total} does not split into {self.size} equal parts")
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part

    def split_padded(self, total: int) -> tuple[int, int, int]:
        """(start, end, part) of this rank's rows when `total` rows are cut into `size`
        parts of ceil(total / size) rows (the last part may be short or empty): the
        vocabulary, which no size is made to divide."""
        part = -(-total // self.size)
        start = min(self.rank * part, total)
        return start, min(start + part, total), part


REPLICATED = Shard()
_SHARD = REPLICATED


def tp_shard() -> Shard:
    """This process's shard of the decoder (REPLICATED outside a group)."""
    return _SHARD


def init_group(rank: int, size: int, store: dist.Store, device: torch.device) -> None:
    """Join the engine's group (every rank calls this with the same store and size)."""
    global _SHARD
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT, **kwargs)
    _SHARD = Shard(rank, size)


def destroy_group() -> None:
    global _SHARD
    if dist.is_initialized():
        dist.destroy_process_group()
    _SHARD = REPLICATED


def all_reduce(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Sum `x` over the ranks, in place (the identity at size 1)."""
    if shard.size > 1:
        dist.all_reduce(x)
    return x


def all_reduce_min(value: int, shard: Shard, device: torch.device) -> int:
    if shard.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def gather_columns(x: torch.Tensor, shard: Shard) -> torch.Tensor | None:
    """Every rank's [N, part] -> [N, size * part] on rank 0 (None on the others): the
    vocabulary-parallel logits, which only rank 0 samples from."""
    if shard.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(shard.size)] if shard.rank == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else None


def broadcast_from_first(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Rank 0's `x` into every rank's `x` (same shape and dtype on every rank)."""
    if shard.size > 1:
        dist.broadcast(x, src=0)
    return x
