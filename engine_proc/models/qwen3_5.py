"""Qwen3.5, dense and MoE: Qwen3-VL's vision tower without DeepStack in front of a hybrid
decoder. Each layer's token mixer is the config's `layer_types[i]`: Gated DeltaNet
(layers/gated_delta_net.py, a state slot per sequence) or gated full attention over the
paged KV cache. The attention has per-head zero-centred q/k norms, rotary on the first
`rotary_dim` dimensions of each head (interleaved mRoPE) and a sigmoid gate, from q_proj,
on its output. Every decoder norm is zero-centred. MoE layers add a shared expert.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_proc.context import get_context
from engine_proc.distributed import Shard, all_reduce, tp_shard
from engine_proc.layers.attention import Attention, build_attention_metadata
from engine_proc.layers.gated_delta_net import GatedDeltaNet, build_state_metadata
from engine_proc.layers.linear import MergedLinear, RowParallelLinear
from engine_proc.layers.rms_norm import ZeroCenteredRMSNorm
from engine_proc.layers.rotary_embedding import apply_rotary_
from engine_proc.models.qwen2 import Qwen2MLP, Qwen2Model
from engine_proc.models.qwen3_moe import SparseMoeBlock
from engine_proc.models.qwen3_vl import Qwen3VLForConditionalGeneration
from shared.model_config import TextConfig


class Qwen3_5Attention(nn.Module):
    """q_proj yields, per head, the query and a gate of head_dim each."""

    def __init__(self, cfg: TextConfig, shard: Shard) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads // shard.size
        self.num_kv_heads = cfg.num_key_value_heads // shard.size
        self.head_dim = cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        q_size = cfg.num_attention_heads * self.head_dim
        kv_size = cfg.num_key_value_heads * self.head_dim
        bias = cfg.attention_bias
        self.qkv_proj = MergedLinear(cfg.hidden_size, [2 * q_size, kv_size, kv_size], bias=bias,
                                     shard=shard)
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, bias=bias, shard=shard)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta) -> torch.Tensor:
        num_tokens, d, rd = x.shape[0], self.head_dim, self.rotary_dim
        qkv = self.qkv_proj(x)
        q_gate = qkv[:, : 2 * self.num_heads * d].view(num_tokens, self.num_heads, 2 * d)
        k, v = qkv[:, 2 * self.num_heads * d :].view(num_tokens, 2 * self.num_kv_heads, d).split(
            self.num_kv_heads, dim=1)
        q = self.q_norm(q_gate[..., :d])
        k = self.k_norm(k)
        apply_rotary_(q[..., :rd], cos, sin)
        apply_rotary_(k[..., :rd], cos, sin)
        out = self.attn(q, k, v, meta)
        gate = q_gate[..., d:].reshape(num_tokens, -1)
        return self.o_proj(out * torch.sigmoid(gate))


class SharedExpertMoeBlock(SparseMoeBlock):
    """The routed experts plus a shared expert, scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: TextConfig, shard: Shard) -> None:
        super().__init__(cfg, shard)
        self.shared_expert = Qwen2MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size,
                                      shard=shard)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # each rank's parts of the routed and shared sums, summed over the ranks once
        expert = self.shared_expert
        shared = expert.down_proj.partial(expert.act(expert.gate_up_proj(x)))
        shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return all_reduce(self.routed(x) + shared, self.shard)


class Qwen3_5DecoderLayer(nn.Module):
    """Pre-norm token mixer (Gated DeltaNet or gated attention) + MLP or MoE block."""

    def __init__(self, cfg: TextConfig, index: int) -> None:
        super().__init__()
        shard = tp_shard()
        self.is_linear = cfg.is_linear_layer(index)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, shard)
        else:
            self.self_attn = Qwen3_5Attention(cfg, shard)
        if cfg.num_experts:
            self.mlp = SharedExpertMoeBlock(cfg, shard)
        else:
            self.mlp = Qwen2MLP(cfg.hidden_size, cfg.intermediate_size, shard=shard)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, attn_meta, state_meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.is_linear:
            x = self.linear_attn(x, state_meta)
        else:
            x = self.self_attn(x, cos, sin, attn_meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3_5Model(Qwen2Model):
    norm_class = ZeroCenteredRMSNorm

    def __init__(self, cfg: TextConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(cfg, device, dtype)
        # the KV cache's block size is read off the first full-attention layer
        self.first_attention_layer = next(
            i for i, layer in enumerate(self.layers) if not layer.is_linear)

    def make_layer(self, cfg: TextConfig, index: int) -> nn.Module:
        return Qwen3_5DecoderLayer(cfg, index)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                deepstack: torch.Tensor | None = None) -> torch.Tensor:
        """As Qwen2Model's (no DeepStack here); the Gated DeltaNet layers' layout is built
        once per forward beside the attention's."""
        ctx = get_context()
        num_tokens = inputs_embeds.shape[0]
        cache = self.layers[self.first_attention_layer].self_attn.attn.k_cache
        block_size = cache.shape[1] if cache.numel() else 0
        attn_meta = build_attention_metadata(ctx, num_tokens, block_size, inputs_embeds.dtype)
        state_meta = build_state_metadata(ctx, num_tokens)
        cos, sin = self.rotary_emb(positions)
        x, residual = inputs_embeds, None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, attn_meta, state_meta)
        x, _ = self.norm(x, residual)
        return x


class Qwen3_5ForConditionalGeneration(Qwen3VLForConditionalGeneration):
    decoder_class = Qwen3_5Model


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    """The same model: the config's experts make every decoder MLP sparse."""
