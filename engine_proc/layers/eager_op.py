"""The ops a mixed step's CUDA graphs leave out: attention and Gated DeltaNet's state update.

A step with prefill chunks beside its decodes cannot be one graph: how its attention and
its recurrent-state update run depends on the chunks' lengths, which change every step
(FlashAttention's varlen call, flash-linear-attention's chunked rule, their host offsets).
Everything else a layer does (projections, norms, rotary, MLP, MoE) depends on the step's
token count only. So engine_proc/piecewise_graphs.py captures a forward in pieces, one
graph between each pair of these ops, and runs the ops themselves eagerly between the
replays with the step's own layout: vLLM's piecewise graphs, without torch.compile.

A layer runs such an op as `eager_op(op, inputs, layout)`: `op(*inputs, layout)` at once,
unless a piecewise capture is recording (`recording`), which then cuts the graph there.
`layout` is the op's per-forward metadata (AttentionMetadata, StateMetadata): a replay
passes the step's own of the same type in its place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

_recorder: Recorder | None = None


class Recorder(Protocol):
    def cut(self, op: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
            layout: object) -> torch.Tensor:
        """End the graph being captured, run `op` outside it, start the next one; the tensor
        the next graph reads as the op's output."""


def eager_op(op: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
             layout: object) -> torch.Tensor:
    """`op(*inputs, layout)`; in a piecewise capture, a cut between two graphs."""
    if _recorder is None:
        return op(*inputs, layout)
    return _recorder.cut(op, inputs, layout)


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[None]:
    global _recorder
    if _recorder is not None:
        raise RuntimeError("a piecewise capture is already recording")
    _recorder = recorder
    try:
        yield
    finally:
        _recorder = None
