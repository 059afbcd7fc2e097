"""Linear layers whose weight is several checkpoint tensors stacked along the output axis.

q/k/v and gate/up projections run as one matmul; `load_shard` copies each checkpoint
tensor into its rows, so checkpoints keep their per-projection names.
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
