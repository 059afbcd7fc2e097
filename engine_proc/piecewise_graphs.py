"""Mixed steps (prefill chunks beside decodes) as CUDA graphs in pieces, cut around the ops
whose work depends on the chunks' lengths (layers/eager_op.py: attention, Gated DeltaNet's
state update), which run eagerly between the replays with the step's own layout.

Under staggered arrivals and mixed lengths about half the steps carry a prompt chunk
(docs/performance.md: 49% at c=128 with outputs of 64-192 tokens), and a decode graph
cannot replay them: eagerly, each of a 3B model's 36 layers launches ~15 kernels from
Python. In pieces a layer launches its graph and its attention's few kernels. vLLM's
default (FULL_AND_PIECEWISE) keeps the same split: full graphs for decode-only steps,
piecewise ones for the rest.

A step of n tokens runs the pieces captured for the smallest size >= n (its bucket). The
graphs read the step's input embeddings (token embeddings with its image rows written over
their placeholders, computed eagerly before: steps with images replay too), positions and,
in DeepStack models, the image rows' DeepStack features (zeros on text rows) from static
buffers, rows n.. padding (zeros); every row is computed independently between the cuts,
so padding rows change no real row. At each cut the piece ends by copying the op's inputs into static buffers
(shared by every cut with inputs of that shape: one at a time is in use), the op runs on
their first n rows with the step's layout, and its n rows are copied into the static
buffer the next piece reads (rows n.. keep an earlier step's values, finite, never read
into a real row). So nothing the op sees is padded, and the KV cache and recurrent states
are written for the step's real tokens only.

Capture, per size, largest first: an eager run that compiles the kernels and allocates the
static buffers (at the largest size), then the capture, on a layout of one sequence of
`size` fresh tokens whose keys all go to the padding slot (the decode graphs' reserved
block) and with no recurrent state kept, built before the capture begins (a layout built
inside a graph would only be recorded, never run). During a capture each cut's op runs
between the graphs for its output's shape, on inputs the graph has only recorded (the
warm-up's values: finite). All sizes share one memory pool: their pieces replay in the
order they were captured and never overlap.

On a CPU (or with `use_graphs=False`) `replay` runs the same pieces, static buffers,
padding and cuts eagerly: the CPU tests cover all of it but the graphs themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine_proc.cuda_graphs import bucket_for, graph_settings
from engine_proc.layers.eager_op import recording

logger = logging.getLogger(__name__)

MAX_MIXED_SIZE = 512  # vLLM's default cap on the sizes captured: larger steps are compute


def mixed_capture_sizes(max_num_batched_tokens: int, max_size: int = MAX_MIXED_SIZE
                        ) -> tuple[int, ...]:
    """Token counts to capture mixed steps at: 8, 16, then every 32 up to the smaller of
    `max_size` and a step's most tokens, and that one (a step's chunks fill its token budget
    or end a prompt, so sizes past the small ones are spread evenly)."""
    limit = min(max_size, max_num_batched_tokens)
    sizes = {s for s in (8, 16, *range(32, limit + 1, 32)) if s <= limit}
    return tuple(sorted(sizes | {limit})) if limit >= 1 else ()


# forward(inputs_embeds [size, hidden], positions [3, size], deepstack [size, k * hidden] or
# None, layout) -> hidden states [size, hidden], run on the capture layout that
# layout_for(size) built (the caller's: a Context)
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, object], torch.Tensor]
LayoutFor = Callable[[int], object]


@dataclass
class _Cut:
    op: Callable[..., torch.Tensor]
    inputs: tuple[torch.Tensor, ...]  # static, [size, ...]
    layout_type: type
    out: torch.Tensor  # static, [size, ...]: what the next piece reads


@dataclass
class _Pieces:
    """One size's graphs: len(cuts) + 1, a cut after each but the last."""

    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    cuts: list[_Cut] = field(default_factory=list)
    output: torch.Tensor | None = None


class _StaticBuffers:
    """The cuts' static buffers at the largest size, by (role, shape after the first
    dimension, dtype): `view` gives the first `size` rows."""

    def __init__(self, max_size: int, device: torch.device) -> None:
        self.max_size = max_size
        self.device = device
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.frozen = False  # during a capture nothing may be allocated

    def view(self, role: object, like: torch.Tensor, size: int) -> torch.Tensor:
        key = (role, tuple(like.shape[1:]), like.dtype)
        buffer = self.buffers.get(key)
        if buffer is None:
            if self.frozen:
                raise RuntimeError(f"a cut at {key} was not seen in the warm-up run")
            buffer = torch.zeros((self.max_size, *like.shape[1:]), dtype=like.dtype,
                                 device=self.device)
            self.buffers[key] = buffer
        return buffer[:size]


class _Eager:
    """Runs a forward's cuts eagerly: the warm-up before a capture (the layouts the forward
    passes), and the stand-in replay (the step's layouts, on its first `rows` rows)."""

    def __init__(self, static: _StaticBuffers, size: int, rows: int,
                 layouts: dict[type, object] | None) -> None:
        self.static, self.size, self.rows, self.layouts = static, size, rows, layouts

    def cut(self, op, inputs, layout):
        n = self.rows
        static_in = _copy_inputs(self.static, inputs, self.size)
        if self.layouts is not None:
            layout = self.layouts[type(layout)]
        out = op(*(t[:n] for t in static_in), layout)
        static_out = self.static.view("out", out, self.size)
        static_out[:n].copy_(out)
        return static_out


class _Capture:
    """Records a forward as graphs cut at its eager ops (which run between them on the
    capture's layouts, for their outputs' shapes)."""

    def __init__(self, static: _StaticBuffers, size: int, pool) -> None:
        self.static, self.size, self.pool = static, size, pool
        self.pieces = _Pieces()
        self._begin()

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.pieces.graphs.append(graph)

    def cut(self, op, inputs, layout):
        static_in = _copy_inputs(self.static, inputs, self.size)  # recorded: the piece's end
        self.pieces.graphs[-1].capture_end()
        out = op(*static_in, layout)
        static_out = self.static.view("out", out, self.size)
        static_out.copy_(out)
        self.pieces.cuts.append(_Cut(op, static_in, type(layout), static_out))
        self._begin()
        return static_out

    def finish(self, output: torch.Tensor) -> _Pieces:
        self.pieces.graphs[-1].capture_end()
        self.pieces.output = output
        return self.pieces

    def abort(self, device: torch.device) -> None:
        """End the capture under way after a failure, so that the stream and the caching
        allocator leave capture mode (the engine then runs these steps eagerly). An
        invalidated capture's capture_end raises before it gives the pool back: then the
        allocator is told directly."""
        if not torch.cuda.is_current_stream_capturing():
            return  # the failure came in an op between two graphs
        try:
            self.pieces.graphs[-1].capture_end()
        except RuntimeError:
            end_allocate = getattr(torch._C, "_cuda_endAllocateToPool", None)
            if end_allocate is not None:
                end_allocate(device.index, self.pool)


def _copy_inputs(static: _StaticBuffers, inputs: tuple[torch.Tensor, ...],
                 size: int) -> tuple[torch.Tensor, ...]:
    copies = []
    for i, t in enumerate(inputs):
        buffer = static.view(("in", i), t, size)
        buffer.copy_(t)
        copies.append(buffer)
    return tuple(copies)


class PiecewiseGraphs:
    """Mixed steps of up to `max_size` tokens as pieces of CUDA graphs, one set per size.

    `capture(forward, layout_for)` at start: `forward(embeds, positions, deepstack,
    layout)` runs the model on a size's static buffers under `layout_for(size)` (the
    runner's capture Context, built once per size outside any graph). `replay(embeds,
    positions, deepstack, layouts)` per step, on the device: copied into the buffers,
    padded to their bucket, the pieces replayed with the cuts' ops run on `layouts` (the
    step's AttentionMetadata and, in hybrid models, StateMetadata, by type) and the first n
    rows of the output back (valid until the next replay). `hidden` and `dtype`: the
    embeddings'; `deepstack_width`: DeepStack features' columns (0: none). `capture_bytes`:
    the device memory the graphs and the static buffers took."""

    def __init__(self, sizes: Sequence[int], *, hidden: int, dtype: torch.dtype,
                 deepstack_width: int = 0, device: torch.device | str,
                 use_graphs: bool | None = None) -> None:
        self.sizes, self.device, self.use_graphs = graph_settings(sizes, device, use_graphs)
        self.embeds = torch.zeros(self.max_size, hidden, dtype=dtype, device=self.device)
        self.positions = torch.zeros(3, self.max_size, dtype=torch.int64, device=self.device)
        self.deepstack = (torch.zeros(self.max_size, deepstack_width, dtype=dtype,
                                      device=self.device) if deepstack_width else None)
        self._input_bytes = sum(t.numel() * t.element_size() for t in self._buffers())
        self._rows_held = 0  # rows of the input buffers the last step wrote
        self.static = _StaticBuffers(self.max_size, self.device)
        self.forward: Forward | None = None
        self.layouts: dict[int, object] = {}  # the capture layout of each size
        self.pieces: dict[int, _Pieces] = {}
        self.capture_bytes = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def bucket(self, num_tokens: int) -> int | None:
        """The size a step of `num_tokens` tokens replays at; None: it runs eagerly."""
        return bucket_for(num_tokens, self.sizes)

    @torch.inference_mode()
    def capture(self, forward: Forward, layout_for: LayoutFor) -> None:
        self.forward = forward
        sizes = list(reversed(self.sizes))  # largest first: the static buffers at full size
        for size in sizes:
            self.layouts[size] = layout_for(size)
        if not self.use_graphs:
            for size in sizes:  # the warm-up alone: it allocates the static buffers
                self._run_eager(size, size, None)
            return
        torch.cuda.synchronize(self.device)
        free_before, _ = torch.cuda.mem_get_info(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)  # capture needs a stream other than the default
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                for size in sizes:
                    self._capture(size, pool)
        finally:
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            # what the warm-ups and the capture-time ops cached on the side stream
            torch.cuda.empty_cache()
        free_after, _ = torch.cuda.mem_get_info(self.device)
        self.capture_bytes = max(0, free_before - free_after) + self._input_bytes
        logger.info("captured mixed-step graphs for %d token counts (%d-%d), %d pieces each, "
                    "in %.1f MiB", len(self.sizes), self.sizes[0], self.max_size,
                    len(self.pieces[self.max_size].graphs), self.capture_bytes / (1 << 20))

    def _capture(self, size: int, pool) -> None:
        """One size: its warm-up, then its pieces. Before the capture the allocator's cache
        is emptied (torch.cuda.graph does so): a cudaMalloc the capture needs has room."""
        self._run_eager(size, size, None)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.static.frozen = True
        capture = _Capture(self.static, size, pool)
        try:
            with recording(capture):
                output = self.forward(*self._inputs(size), self.layouts[size])
        except BaseException:
            capture.abort(self.device)
            raise
        finally:
            self.static.frozen = False
        self.pieces[size] = capture.finish(output)

    def _run_eager(self, size: int, rows: int, layouts: dict[type, object] | None
                   ) -> torch.Tensor:
        with recording(_Eager(self.static, size, rows, layouts)):
            return self.forward(*self._inputs(size), self.layouts[size])

    def _buffers(self) -> list[torch.Tensor]:
        return [t for t in (self.embeds, self.positions, self.deepstack) if t is not None]

    def _inputs(self, size: int) -> tuple:
        return (self.embeds[:size], self.positions[:, :size],
                None if self.deepstack is None else self.deepstack[:size])

    def replay(self, embeds: torch.Tensor, positions: torch.Tensor,
               deepstack: torch.Tensor | None, layouts: dict[type, object]) -> torch.Tensor:
        """Hidden states [n, hidden] of a step's n tokens (embeds [n, hidden], positions
        int64 [3, n], deepstack [n, k * hidden] or None for a step without image rows, on
        the device)."""
        if self.forward is None:
            raise RuntimeError("replay before capture")
        n = embeds.shape[0]
        size = self.bucket(n)
        if size is None:
            raise ValueError(f"a step of {n} tokens has no graphs (sizes up to "
                             f"{self.max_size}): run it eagerly")
        self._load(embeds, positions, deepstack, size)
        if not self.use_graphs:
            with torch.inference_mode():
                return self._run_eager(size, n, layouts)[:n]
        pieces = self.pieces[size]
        for graph, cut in zip(pieces.graphs, pieces.cuts, strict=False):
            graph.replay()
            out = cut.op(*(t[:n] for t in cut.inputs), layouts[cut.layout_type])
            cut.out[:n].copy_(out)
        pieces.graphs[-1].replay()
        return pieces.output[:n]

    def _load(self, embeds: torch.Tensor, positions: torch.Tensor,
              deepstack: torch.Tensor | None, size: int) -> None:
        """The step's inputs (already on the device: the runner embeds the tokens, and
        stages the positions with the rest of its inputs) into the buffers, rows n..size
        padding. Device copies: no host buffer here that a step which samples nothing (so
        does not sync) could overwrite while it is read. Rows an earlier, larger step wrote
        past this bucket are zeroed too: no copy of an image's embeddings stays behind its
        step (R3), not even in these fixed buffers."""
        n = embeds.shape[0]
        if (deepstack is not None) and self.deepstack is None:
            raise ValueError("DeepStack features for pieces captured without them")
        end = max(size, self._rows_held)
        for buffer, rows in ((self.embeds, embeds), (self.deepstack, deepstack)):
            if buffer is None:
                continue
            if rows is None:  # no image rows: no DeepStack features
                buffer[:end].zero_()
            else:
                buffer[:n].copy_(rows)
                buffer[n:end].zero_()
        self.positions[:, :n].copy_(positions)
        self.positions[:, n:size].zero_()
        self._rows_held = n
