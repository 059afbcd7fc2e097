"""Decode steps replayed as CUDA graphs: the capture sizes, the bucket a batch runs in, the
static input buffers, and capture/replay behind one object the model runner calls.

A graph replays the kernels it recorded on the tensors it recorded, so a decode step's
inputs are copied into buffers allocated once (`StaticDecodeInputs`), and a batch of n
sequences runs the graph captured for the smallest size >= n (its bucket), rows n.. being
padding. Model code never knows: the runner's forward reads the buffers through the
Context as it reads any step's tensors (vLLM's and SGLang's graph runners keep the same
split).

Padding rows must change nothing a real sequence reads. Each one is a decode of token 0 at
position 0 whose key and value go to `DecodePadding.slot`, in a block no sequence is ever
given (`DecodePadding.block`, the first column of its block table; seq_len 1, so attention
reads that slot only), and, in hybrid models, whose recurrent state is `state_slot`, a slot
no sequence owns. So the runner keeps one KV block and one state slot out of its pools.
Padding rows may all write the same slot: what lands there is never read as anyone's data.
Their outputs are sliced away.

On a CPU (or with `use_graphs=False`) `DecodeGraphs` runs the same copy-in, padding and
slicing with an eager call in place of the replay, so the CPU tests cover all of it but the
graph itself. It is not meant to serve there: padded batches only cost a CPU time.

The model runner (one rank) captures them at start with --no-enforce-eager on CUDA and
replays them for decode-only steps without state copies or prompt log-probs; the attention
layers' decodes read the paged cache through the Triton kernel there, Qwen3.5's states
advance in place by slot (layers/gated_delta_rule_triton.py). A capture that fails (an op
that waits on the host) leaves the engine eager, with one warning.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512  # vLLM's default cap on the batch sizes captured
NUM_POSITION_ROWS = 3  # mRoPE: every decoder here takes positions [3, T]
STEP_FIELDS = ("input_ids", "positions", "seq_lens", "slot_mapping", "block_tables",
               "state_slots")


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's list: 1, 2, 4, then every 8 below 256, then every 16 from 256, up to
    `max_size`; and `max_size` itself, so that every batch up to it has a graph (vLLM leaves
    the sizes between the last step and its cap eager)."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]
    return sorted({s for s in sizes if s <= max_size} | {max_size})


def capture_sizes(max_num_seqs: int, sizes: Sequence[int] = (),
                  max_size: int | None = None) -> tuple[int, ...]:
    """The batch sizes to capture: `sizes` (vLLM's --cudagraph-capture-sizes) or the defaults,
    none above `max_size` (vLLM's --max-cudagraph-capture-size; default: the largest of `sizes`, else
    MAX_CAPTURE_SIZE) nor above `max_num_seqs`, a batch's most sequences."""
    if max_size is None:
        max_size = max(sizes) if sizes else MAX_CAPTURE_SIZE
    limit = min(max_size, max_num_seqs)
    chosen = sizes if sizes else default_capture_sizes(limit)
    return tuple(sorted({s for s in chosen if 1 <= s <= limit}))


def graph_settings(sizes: Sequence[int], device: torch.device | str,
                   use_graphs: bool | None) -> tuple[tuple[int, ...], torch.device, bool]:
    """(the sorted sizes, the device, whether real graphs are captured: on CUDA unless
    `use_graphs` says otherwise; else the eager stand-in) for a set of graphs."""
    if not sizes:
        raise ValueError("no capture sizes")
    device = torch.device(device)
    use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
    if use_graphs and device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
    return tuple(sorted(set(sizes))), device, use_graphs


def bucket_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the (sorted) captured `sizes` that holds `num_seqs` sequences; None
    above the largest (that step runs eagerly)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) and num_seqs >= 1 else None


class DecodeStepInputs(Protocol):
    """A decode-only step's inputs on the host (engine_proc/step_inputs.py's StepInputs has
    them), n sequences of one token each."""

    input_ids: np.ndarray  # int64 [n]
    positions: np.ndarray  # int64 [3, n]
    seq_lens: np.ndarray  # int32 [n]
    slot_mapping: np.ndarray  # int64 [n]
    block_tables: np.ndarray  # int32 [n, w], w <= max_num_blocks
    state_slots: np.ndarray | None  # int64 [n], hybrid models only


@dataclass(frozen=True)
class DecodePadding:
    """What padding rows point at: a KV cache slot and a block that no sequence is given,
    and a recurrent state slot that no sequence owns (hybrid models)."""

    slot: int
    block: int
    state_slot: int = -1  # -1: none (models without recurrent state)

    @classmethod
    def reserved_block(cls, block: int, block_size: int, state_slot: int = -1) -> DecodePadding:
        """Padding in KV block `block` (its first slot), and state slot `state_slot`."""
        return cls(slot=block * block_size, block=block, state_slot=state_slot)


@dataclass
class DecodeBuffers:
    """The step tensors a decode graph reads. `query_start_loc` (0, 1, .., size) never
    changes; the rest are written by every step's copy-in."""

    input_ids: torch.Tensor  # int64 [size]
    positions: torch.Tensor  # int64 [3, size]
    query_start_loc: torch.Tensor  # int32 [size + 1]
    seq_lens: torch.Tensor  # int32 [size]
    slot_mapping: torch.Tensor  # int64 [size]
    block_tables: torch.Tensor  # int32 [size, max_num_blocks]
    state_slots: torch.Tensor | None  # int64 [size]

    @classmethod
    def allocate(cls, size: int, max_num_blocks: int, state_slots: bool,
                 device: torch.device, pin: bool = False) -> DecodeBuffers:
        def new(shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

        return cls(
            input_ids=new((size,), torch.int64),
            positions=new((NUM_POSITION_ROWS, size), torch.int64),
            query_start_loc=torch.arange(size + 1, dtype=torch.int32).to(device),
            seq_lens=new((size,), torch.int32),
            slot_mapping=new((size,), torch.int64),
            block_tables=new((size, max_num_blocks), torch.int32),
            state_slots=new((size,), torch.int64) if state_slots else None,
        )

    def rows(self, size: int) -> DecodeBuffers:
        """Views of the first `size` rows (sequences) of every buffer."""
        return DecodeBuffers(
            input_ids=self.input_ids[:size],
            positions=self.positions[:, :size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            state_slots=None if self.state_slots is None else self.state_slots[:size],
        )

    def step_tensors(self) -> dict[str, torch.Tensor]:
        """The buffers a step writes (all but query_start_loc), by name."""
        return {name: t for name in STEP_FIELDS if (t := getattr(self, name)) is not None}


class StaticDecodeInputs:
    """The device buffers a graph reads and their host staging copy (pinned on CUDA): a
    step's inputs are written into the staging rows with numpy, padded to the bucket, then
    copied over in one non-blocking copy per buffer.

    The staging buffers are reused by the next step: the runner's one sync per step (the
    sampled ids, after the forward the copies feed) keeps a copy from being overwritten
    while in flight. Block tables cross at the step's width only (staged packed, then
    spread into the buffer's rows on the device): the buffer is max_model_len wide (16,384
    columns for a 262,144-token model), a step's tables mostly a few. Columns past a step's
    width keep earlier steps' entries: the paged kernels never read past a sequence's
    length."""

    def __init__(self, max_size: int, max_num_blocks: int, padding: DecodePadding, *,
                 state_slots: bool, device: torch.device) -> None:
        if state_slots and padding.state_slot < 0:
            raise ValueError("padding rows need a state slot of their own (no sequence's)")
        self.max_size = max_size
        self.max_num_blocks = max_num_blocks
        self.padding = padding
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        self.buffers = DecodeBuffers.allocate(max_size, max_num_blocks, state_slots, self.device)
        # the tables are staged packed (_tables_host), not in rows max_num_blocks wide
        self.staging = DecodeBuffers.allocate(max_size, 0, state_slots, torch.device("cpu"), pin)
        self._host = {name: t.numpy() for name, t in self.staging.step_tensors().items()
                      if name != "block_tables"}
        self._tables_host = torch.zeros(max_size * max_num_blocks, dtype=torch.int32,
                                        pin_memory=pin)
        self._tables_packed = torch.zeros(max_size * max_num_blocks, dtype=torch.int32,
                                          device=self.device)
        self._pad_rows(0, max_size)
        self._copy(max_size, self._write_tables(np.zeros((0, max_num_blocks), np.int32),
                                                max_size))

    def load(self, inputs: DecodeStepInputs, size: int) -> DecodeBuffers:
        """Copy a step of n <= size sequences into the buffers, rows n..size as padding;
        the first `size` rows of the device buffers."""
        n = len(inputs.input_ids)
        width = inputs.block_tables.shape[1]
        if not n <= size <= self.max_size:
            raise ValueError(f"{n} sequences do not fit a bucket of {size} (at most "
                             f"{self.max_size})")
        if width > self.max_num_blocks:
            raise ValueError(f"block tables of {width} blocks, buffers hold {self.max_num_blocks}")
        if (inputs.state_slots is None) != (self.buffers.state_slots is None):
            raise ValueError("state slots given to buffers without them, or the other way")
        host = self._host
        host["input_ids"][:n] = inputs.input_ids
        host["positions"][:, :n] = inputs.positions
        host["seq_lens"][:n] = inputs.seq_lens
        host["slot_mapping"][:n] = inputs.slot_mapping
        if inputs.state_slots is not None:
            host["state_slots"][:n] = inputs.state_slots
        self._pad_rows(n, size)
        self._copy(size, self._write_tables(inputs.block_tables, size))
        return self.buffers.rows(size)

    def padding_only(self, size: int) -> DecodeBuffers:
        """The first `size` rows, all padding (what a graph is captured on)."""
        self._pad_rows(0, size)
        self._copy(size, self._write_tables(np.zeros((0, 1), np.int32), size))
        return self.buffers.rows(size)

    def _write_tables(self, tables: np.ndarray, size: int) -> torch.Tensor:
        """The step's tables [n, w] and padding rows (the padding block first) packed
        [size, w] into the host staging; that staging's view."""
        n, width = tables.shape
        packed = self._tables_host[: size * width].view(size, width)
        rows = packed.numpy()
        rows[:n] = tables
        rows[n:] = self.padding.block
        return packed

    def _pad_rows(self, start: int, end: int) -> None:
        host, pad = self._host, self.padding
        host["input_ids"][start:end] = 0
        host["positions"][:, start:end] = 0
        host["seq_lens"][start:end] = 1
        host["slot_mapping"][start:end] = pad.slot
        if "state_slots" in host:
            host["state_slots"][start:end] = pad.state_slot

    def _copy(self, size: int, tables: torch.Tensor) -> None:
        """Each buffer's first `size` rows in one contiguous copy. positions [3, max_size] is
        copied whole: its first `size` columns are not contiguous, and torch would stage such a
        copy through pageable memory, which waits for the device. The packed tables [size, w]
        cross contiguous too, then fill the buffer's first w columns on the device."""
        staging = self.staging.rows(size).step_tensors()
        for name, dst in self.buffers.rows(size).step_tensors().items():
            if name == "positions":
                self.buffers.positions.copy_(self.staging.positions, non_blocking=True)
            elif name == "block_tables":
                packed = self._tables_packed[: tables.numel()]
                packed.copy_(tables.view(-1), non_blocking=True)
                dst[:, : tables.shape[1]].copy_(packed.view(tables.shape))
            else:
                dst.copy_(staging[name], non_blocking=True)


class DecodeGraphs:
    """Decode steps as CUDA graphs, one per capture size, sharing one memory pool.

    `capture(forward)` at start: `forward(buffers)` runs the model's decode step on
    `DecodeBuffers` of one size and returns a tensor with a row per sequence (the logits, or
    the hidden states); it is recorded for every size, largest first, on padding only.
    `replay(inputs)` per decode-only step of at most `max_size` sequences: the inputs are
    copied into the buffers, padded to their bucket, the bucket's graph replays, and the
    first n rows of its output come back: a view of the graph's output memory, valid until
    the next replay (the runner samples from it within the step).

    Without CUDA (or with `use_graphs=False`, to test the stand-in on a GPU too) `replay`
    runs `forward` eagerly on the same buffers. `capture_bytes`: the device memory the
    graphs took (for the memory plan and /metrics)."""

    def __init__(self, sizes: Sequence[int], max_num_blocks: int, padding: DecodePadding, *,
                 state_slots: bool, device: torch.device | str,
                 use_graphs: bool | None = None) -> None:
        self.sizes, self.device, self.use_graphs = graph_settings(sizes, device, use_graphs)
        self.inputs = StaticDecodeInputs(self.sizes[-1], max_num_blocks, padding,
                                         state_slots=state_slots, device=self.device)
        self.forward: Callable[[DecodeBuffers], torch.Tensor] | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_bytes = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def bucket(self, num_seqs: int) -> int | None:
        """The size a step of `num_seqs` decodes replays at; None: it runs eagerly."""
        return bucket_for(num_seqs, self.sizes)

    @torch.inference_mode()
    def capture(self, forward: Callable[[DecodeBuffers], torch.Tensor]) -> None:
        self.forward = forward
        if not self.use_graphs:
            return
        torch.cuda.synchronize(self.device)
        free_before, _ = torch.cuda.mem_get_info(self.device)
        pool = torch.cuda.graph_pool_handle()
        # largest first: the smaller graphs then fit in the pool the largest left
        for size in reversed(self.sizes):
            buffers = self.inputs.padding_only(size)
            forward(buffers)  # warm-up outside the graph: kernels compiled, lazy inits done
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = forward(buffers)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        self.capture_bytes = max(0, free_before - free_after)
        logger.info("captured decode graphs for %d batch sizes (1-%d) in %.1f MiB",
                    len(self.sizes), self.max_size, self.capture_bytes / (1 << 20))

    def replay(self, inputs: DecodeStepInputs) -> torch.Tensor:
        """The forward's output rows of the step's n sequences (n <= max_size)."""
        if self.forward is None:
            raise RuntimeError("replay before capture")
        n = len(inputs.input_ids)
        size = self.bucket(n)
        if size is None:
            raise ValueError(f"a step of {n} sequences has no graph (sizes up to "
                             f"{self.max_size}): run it eagerly")
        buffers = self.inputs.load(inputs, size)
        if not self.use_graphs:
            with torch.inference_mode():
                return self.forward(buffers)[:n]
        self.graphs[size].replay()
        return self.outputs[size][:n]
