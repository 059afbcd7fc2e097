"""Sparse mixture-of-experts MLP of the Qwen3(-VL) MoE decoder.

A softmax router picks each token's top-k experts; their weights are renormalized to sum
to one (norm_topk_prob). Expert weights are fused per layer, in transformers 5's layout:
gate_up_proj [experts, 2 * inter, hidden], down_proj [experts, hidden, inter].

Under tensor parallelism every rank holds every expert's share of the intermediate rows
(gate/up column parallel, down row parallel) and routes alike (the router is whole); the
ranks' weighted sums are summed over the ranks.

Tokens are grouped by expert and every expert's rows go through one grouped GEMM
(torch.nn.functional.grouped_mm) with no host sync: float32 on the CPU, bfloat16 on CUDA
GPUs of compute capability 9.0 and up (torch's grouped kernels; on older GPUs grouped_mm
itself loops on the host) with 16-byte aligned rows. Elsewhere a loop over the experts that
received tokens, which reads the per-expert counts on the host once per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_proc.distributed import REPLICATED, Shard, all_reduce
from shared.model_config import TextConfig


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 shard: Shard = REPLICATED) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.shard = shard
        self.rows = shard.split(intermediate_size)  # this rank's intermediate rows
        local = self.rows[1] - self.rows[0]
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, local))

    def load_tensor(self, key: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
        """Published checkpoints store each expert's matrices transposed ([hidden, 2 * inter],
        [inter, hidden]); transformers 5 saves its own layout. A tensor that fits as it is
        is taken as it is, as transformers does. Split, a rank keeps its rows of gate and
        of up, and the same columns of down."""
        full = list(param.shape)
        full[1 if param is self.gate_up_proj else 2] *= self.shard.size
        if list(tensor.shape) != full:
            tensor = tensor.transpose(1, 2)
        if list(tensor.shape) != full:
            raise ValueError(f"{key}: shape {tuple(tensor.shape)} fits neither {tuple(full)} "
                             "nor its per-expert transpose")
        if self.shard.size > 1:
            start, end = self.rows
            if param is self.gate_up_proj:
                gate, up = tensor.chunk(2, dim=1)
                tensor = torch.cat([gate[:, start:end], up[:, start:end]], dim=1)
            else:
                tensor = tensor[:, :, start:end]
        param.copy_(tensor)

    def load_expert(self, key: str, param: torch.Tensor, expert: int, projection: str,
                    tensor: torch.Tensor) -> None:
        """One expert's matrix as transformers 5.24 saves Qwen3.5-MoE (`experts.{i}.gate_proj`
        [inter, hidden], `up_proj` likewise, `down_proj` [hidden, inter]): this rank's rows
        of gate and up, the same columns of down."""
        start, end = self.rows
        local = end - start
        if projection == "down_proj":
            part, target = tensor[:, start:end], param[expert]
        else:
            offset = 0 if projection == "gate_proj" else local
            part, target = tensor[start:end], param[expert, offset : offset + local]
        if part.shape != target.shape:
            raise ValueError(f"{key}: shape {tuple(tensor.shape)} does not fit expert {expert} "
                             f"of {tuple(param.shape)}")
        target.copy_(part)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], experts int64 [T, k], weights [T, k] -> weighted sum [T, hidden]."""
        if can_group(x, self.down_proj.shape[2]):
            return self.grouped(x, experts, weights)
        return self.looped(x, experts, weights)

    def grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert (a stable sort), two grouped GEMMs, weighted scatter-add."""
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        top_k = experts.shape[1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # counted by scatter_add: bincount reads its input's range back to the host on CUDA
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        tokens = order // top_k
        rows = x.index_select(0, tokens)
        gate, up = F.grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        h = F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offsets)
        h = h * weights.reshape(-1).index_select(0, order)[:, None]
        return torch.zeros_like(x).index_add_(0, tokens, h)

    def looped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each expert that got tokens runs one gate/up and one down matmul; the counts come
        to the host once per layer."""
        top_k = experts.shape[1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // top_k
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start : start + count]
            gate, up = F.linear(x[rows], self.gate_up_proj[expert]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.down_proj[expert])
            h = h * weights.reshape(-1)[order[start : start + count], None]
            out.index_add_(0, rows, h)
            start += count
        return out


def can_group(x: torch.Tensor, intermediate_size: int) -> bool:
    """Whether F.grouped_mm runs without a host sync for x's device, dtype and row widths."""
    if not hasattr(F, "grouped_mm"):
        return False
    if x.device.type == "cpu":
        return x.dtype == torch.float32
    if x.device.type == "cuda":
        aligned = x.shape[1] % 8 == 0 and intermediate_size % 8 == 0  # 16-byte bf16 rows
        return (x.dtype == torch.bfloat16 and aligned
                and torch.cuda.get_device_capability(x.device)[0] >= 9)
    return False


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: TextConfig, shard: Shard = REPLICATED) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.shard = shard
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                    shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.routed(x), self.shard)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the experts' weighted sum (whole on a single rank)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, experts, weights.to(x.dtype))
