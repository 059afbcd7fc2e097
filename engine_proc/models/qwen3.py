"""Qwen3 decoder with interleaved multimodal RoPE and DeepStack (the language model of
Qwen3-VL, dense or MoE)."""

from __future__ import annotations

import torch
from torch import nn

from engine_proc.distributed import Shard, tp_shard
from engine_proc.layers.attention import Attention
from engine_proc.layers.linear import MergedLinear, RowParallelLinear
from engine_proc.layers.rms_norm import RMSNorm
from engine_proc.layers.rotary_embedding import apply_rotary_
from engine_proc.models.qwen2 import Qwen2DecoderLayer, Qwen2MLP, Qwen2Model
from engine_proc.models.qwen3_moe import SparseMoeBlock
from shared.model_config import TextConfig


class Qwen3Attention(nn.Module):
    """Qwen2's attention with an RMSNorm over each head of q and k (before the rotary) and
    no q/k/v biases by default."""

    def __init__(self, cfg: TextConfig, shard: Shard) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads // shard.size  # this rank's heads
        self.num_kv_heads = cfg.num_key_value_heads // shard.size
        self.head_dim = cfg.head_dim
        q_size = cfg.num_attention_heads * self.head_dim
        kv_size = cfg.num_key_value_heads * self.head_dim
        bias = cfg.attention_bias
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=bias,
                                     shard=shard)
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, bias=bias, shard=shard)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta) -> torch.Tensor:
        heads = self.num_heads + 2 * self.num_kv_heads
        qkv = self.qkv_proj(x).view(x.shape[0], heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        q = apply_rotary_(self.q_norm(q), cos, sin)
        k = apply_rotary_(self.k_norm(k), cos, sin)
        return self.o_proj(self.attn(q, k, v, meta))


def _mlp(cfg: TextConfig, index: int, shard: Shard) -> nn.Module:
    if cfg.is_moe_layer(index):
        return SparseMoeBlock(cfg, shard)
    return Qwen2MLP(cfg.hidden_size, cfg.intermediate_size, shard=shard)


class Qwen3Model(Qwen2Model):
    def make_layer(self, cfg: TextConfig, index: int) -> nn.Module:
        shard = tp_shard()
        return Qwen2DecoderLayer(cfg, Qwen3Attention(cfg, shard), _mlp(cfg, index, shard))
