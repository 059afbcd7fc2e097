"""Linear layers run through oneDNN with their weights packed once, on a CPU in float32.

MKL's GEMM behind `F.linear` re-packs the weight into its blocked panels on every call;
at the row counts a serving step has (a decode batch of 8-64 rows, prefill chunks of a few
thousand) that packing is a large share of the product. oneDNN's linear takes the weight
packed once, at load. Measured on the 2-core AVX2 machine against `F.linear` on weights
already stored transposed (`store_weights_transposed`): 32 x 256 x 1536 1.39x, 8 x 256 x
4096 2.7x, 4160 x 768 x 256 1.33x, 1 row 0.3-0.9x; the tiny model's text steps (32 in
flight, in-process) 1.10-1.18x. Results differ from `F.linear` by float32 rounding only
(another summation order: ~3e-6 relative).

The packed weight replaces the parameter (a buffer `packed_weight`; `weight` becomes None):
no second copy of the weights is kept. Layers whose weight other modules read (an LM head
tied to the embeddings, which need its row-major rows) and row-parallel layers of a
tensor-parallel group (their partial products are summed before the bias) keep their own
path.

oneDNN builds (and caches) a kernel for each row count it sees. A serving engine sees a new
row count almost every step, and building kernels between large activations fragments the
heap: fed random counts up to 3,600, a loop of six such products grew by ~1 GB over 900
steps and kept growing. Row counts are therefore rounded up to 5 significant bits (exact
below 32; at most 1/16 more rows), the padding rows zeros and their outputs dropped: a
bounded set of kernels, and the same loop levels off after ~300 steps (642 MB, from 637).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine_proc.layers.linear import MergedLinear, RowParallelLinear
from engine_proc.layers.vocab_parallel import ParallelLMHead

PACKABLE = (nn.Linear, MergedLinear, RowParallelLinear, ParallelLMHead)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and _onednn_linear_works()


@functools.cache
def _onednn_linear_works() -> bool:
    """Whether this torch build runs oneDNN's packed linear here (some CPU builds have the
    ops without a working kernel): one tiny product, checked against F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w, x = torch.randn(8, 4), torch.randn(3, 4)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return torch.allclose(y, torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-5)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


ROW_BITS = 5  # significant bits kept of a row count (see the module doc)


def bucket_rows(rows: int) -> int:
    """`rows` rounded up to ROW_BITS significant bits: 33 -> 34, 101 -> 104, 1000 -> 1024."""
    shift = rows.bit_length() - ROW_BITS
    if shift <= 0:
        return rows
    return -(-rows >> shift) << shift


def packed_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b through oneDNN on a weight packed by `_reorder_linear_weight`, the rows of x
    padded to their bucket (`bucket_rows`) so that few distinct kernels are ever built."""
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    padded = bucket_rows(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    flat = x.new_empty((padded, features))
    flat[:rows] = x.reshape(rows, features)
    flat[rows:] = 0  # zeros in the padding rows alone (F.pad fills every row, then copies)
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


class _Packed:
    """Forward of a packed layer: y = x W^T + b through oneDNN (mixed in before the layer's
    own class, so `partial` and `forward` of RowParallelLinear are both replaced)."""

    packed_weight: torch.Tensor
    bias: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight, self.bias)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight, None)


class _PackedHead:
    """The LM head's projection (this rank's vocabulary rows; the gather over the ranks
    stays the head's own): 2-3x its row-major `mm` at 1-64 rows, measured here for 4096 x
    256 and 151936 x 2048 heads."""

    packed_weight: torch.Tensor

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        return packed_linear(hidden, self.packed_weight, None)


_PACKED_CLASSES: dict[type, type] = {}


def _packed_class(cls: type) -> type:
    if cls not in _PACKED_CLASSES:
        mixin = _PackedHead if issubclass(cls, ParallelLMHead) else _Packed
        _PACKED_CLASSES[cls] = type(f"Packed{cls.__name__}", (mixin, cls), {})
    return _PACKED_CLASSES[cls]


def pack_linear_weights(model: nn.Module) -> int:
    """Pack every plain linear layer's float32 CPU weight for oneDNN (see the module doc);
    returns how many layers were packed."""
    shared = {id(p) for m in model.modules() if type(m) not in PACKABLE
              for p in m.parameters(recurse=False)}
    count = 0
    for module in model.modules():
        if type(module) not in PACKABLE:
            continue
        weight = module.weight
        if (weight is None or id(weight) in shared or weight.dim() != 2
                or not can_pack(weight.device, weight.dtype)
                or isinstance(module, RowParallelLinear) and module.shard.size > 1):
            continue
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        module.weight = None
        module.register_buffer("packed_weight", packed, persistent=False)
        module.__class__ = _packed_class(type(module))
        count += 1
    return count
