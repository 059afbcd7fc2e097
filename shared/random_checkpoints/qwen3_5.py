"""Random-weight Qwen3.5 checkpoints (dense and MoE), built by transformers from the
shared seed: tiny presets for the tests, a 0.8B-shaped one for benchmarks.

`tiny-qwen3.5`: two [linear, linear, linear, full] groups, two value heads per key head,
partial rotary (a quarter of head_dim), a 4-block vision tower without DeepStack.
`tiny-qwen3.5-moe`: the same pattern with 4 experts (top 2) and a shared expert.
`qwen3.5-0.8b`: the published Qwen3.5-0.8B shapes (24 layers, hidden 1024, 12-block
768-wide tower; tied embeddings), bf16 on disk. Their transformers config:
random_checkpoints/hf_configs.py.
"""

from __future__ import annotations

from shared.model_config import FULL_ATTENTION, LINEAR_ATTENTION, TextConfig, VisionConfig
from shared.random_checkpoints.preset import Preset

ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
MOE_ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"
L, F = LINEAR_ATTENTION, FULL_ATTENTION


def layer_pattern(num_groups: int) -> tuple[str, ...]:
    """Qwen3.5's published pattern: three linear layers, then one full-attention layer."""
    return (L, L, L, F) * num_groups


TINY_QWEN3_5 = Preset(
    name="tiny-qwen3.5",
    text=TextConfig(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=10000000.0,
        mrope_section=(2, 3, 3),
        tie_word_embeddings=False,
        head_dim=64,
        attention_bias=False,
        qk_norm=True,
        mrope_interleaved=True,
        layer_types=layer_pattern(2),
        partial_rotary_factor=0.25,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
    ),
    vision=VisionConfig(
        depth=4,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        out_hidden_size=128,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=0,
        fullatt_block_indexes=(0, 1, 2, 3),
        hidden_act="gelu_pytorch_tanh",
        num_position_embeddings=36,
    ),
    dtype="float32",
    initializer_range=0.1,
    materialize=True,
    architecture=ARCHITECTURE,
    perturb=0.05,  # the zero-centred and gated norms' weights off their init
)
TINY_QWEN3_5_MOE = Preset(
    name="tiny-qwen3.5-moe",
    text=TextConfig(
        **{**TINY_QWEN3_5.text.__dict__, "hidden_size": 96, "intermediate_size": 0,
           "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 48, "head_dim": 32,
           "mrope_section": (2, 1, 1), "linear_key_head_dim": 16, "linear_value_head_dim": 24}),
    vision=VisionConfig(**{**TINY_QWEN3_5.vision.__dict__, "out_hidden_size": 96}),
    dtype="float32",
    initializer_range=0.1,
    materialize=True,
    architecture=MOE_ARCHITECTURE,
    perturb=0.05,
)
QWEN3_5_0_8B = Preset(
    name="random-qwen3.5-0.8b",
    text=TextConfig(
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        rope_theta=10000000.0,
        mrope_section=(11, 11, 10),
        tie_word_embeddings=True,
        head_dim=256,
        attention_bias=False,
        qk_norm=True,
        mrope_interleaved=True,
        layer_types=layer_pattern(6),
        partial_rotary_factor=0.25,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    ),
    vision=VisionConfig(
        depth=12,
        hidden_size=768,
        intermediate_size=3072,
        num_heads=12,
        out_hidden_size=1024,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=0,
        fullatt_block_indexes=tuple(range(12)),
        hidden_act="gelu_pytorch_tanh",
        num_position_embeddings=2304,
    ),
    dtype="bfloat16",
    initializer_range=0.02,
    materialize=True,
    architecture=ARCHITECTURE,
)
