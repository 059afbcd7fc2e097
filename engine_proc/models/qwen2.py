"""Qwen2 decoder with multimodal RoPE (the language model of Qwen2.5-VL).

Under tensor parallelism (engine_proc/distributed.py) each rank holds its share of the
attention heads (q/k/v column parallel, o_proj row parallel) and of the MLP's intermediate
rows (gate/up column parallel, down_proj row parallel), and its part of the vocabulary;
the layers sum the ranks' partial outputs themselves.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_proc.context import get_context
from engine_proc.distributed import REPLICATED, Shard, tp_shard
from engine_proc.layers.activation import SiluAndMul
from engine_proc.layers.attention import Attention, build_attention_metadata
from engine_proc.layers.linear import MergedLinear, RowParallelLinear
from engine_proc.layers.rms_norm import RMSNorm
from engine_proc.layers.rotary_embedding import MRotaryEmbedding, apply_rotary_
from engine_proc.layers.vocab_parallel import VocabParallelEmbedding
from shared.model_config import TextConfig


class Qwen2Attention(nn.Module):
    def __init__(self, cfg: TextConfig, shard: Shard = REPLICATED) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads // shard.size  # this rank's heads
        self.num_kv_heads = cfg.num_key_value_heads // shard.size
        self.head_dim = cfg.head_dim
        q_size = cfg.num_attention_heads * self.head_dim
        kv_size = cfg.num_key_value_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=True,
                                     shard=shard)
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, bias=False, shard=shard)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, -1, self.head_dim)
        apply_rotary_(qkv[:, : self.num_heads + self.num_kv_heads], cos, sin)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(q, k, v, meta))


class Qwen2MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 shard: Shard = REPLICATED) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                         shard=shard)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                           shard=shard)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Qwen2DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block. Qwen3 passes its own attention and MLP (or MoE)."""

    def __init__(
        self, cfg: TextConfig, self_attn: nn.Module | None = None, mlp: nn.Module | None = None
    ) -> None:
        super().__init__()
        shard = tp_shard()
        self.self_attn = self_attn if self_attn is not None else Qwen2Attention(cfg, shard)
        self.mlp = mlp if mlp is not None else Qwen2MLP(cfg.hidden_size, cfg.intermediate_size,
                                                        shard=shard)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen2Model(nn.Module):
    """The decoder stack. Subclasses give their own layers (`make_layer`); DeepStack
    features (Qwen3-VL) are added to the hidden states after the first k layers."""

    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, cfg: TextConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_shard())
        self.layers = nn.ModuleList(
            [self.make_layer(cfg, i) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(
            cfg.rotary_dim,
            cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.mrope_section,
            device=device,
            dtype=dtype,
            interleaved=cfg.mrope_interleaved,
        )

    def make_layer(self, cfg: TextConfig, index: int) -> nn.Module:
        return Qwen2DecoderLayer(cfg)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        deepstack: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """inputs_embeds [T, H], positions int64 [3, T], deepstack [T, k * H] or None: added
        to the hidden states after each of the first k layers (zeros on text rows, so those
        rows stay exactly as they were). Attention layout from the Context."""
        first = self.layers[0].self_attn.attn
        block_size = first.k_cache.shape[1] if first.k_cache.numel() else 0
        meta = build_attention_metadata(
            get_context(), inputs_embeds.shape[0], block_size, inputs_embeds.dtype
        )
        cos, sin = self.rotary_emb(positions)
        h = self.hidden_size
        num_deepstack = 0 if deepstack is None else deepstack.shape[1] // h
        x, residual = inputs_embeds, None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, meta)
            if i < num_deepstack:
                x, residual = x + residual + deepstack[:, i * h : (i + 1) * h], None
        x, _ = self.norm(x, residual)
        return x
