"""The random checkpoints flatserve makes (`flatserve make-model --preset NAME`), by name."""

from __future__ import annotations

from dataclasses import replace

from shared.model_config import TextConfig, VisionConfig
from shared.random_checkpoints.preset import Preset
from shared.random_checkpoints.qwen3_5 import QWEN3_5_0_8B, TINY_QWEN3_5, TINY_QWEN3_5_MOE

TINY = Preset(
    name="tiny-qwen2.5-vl",
    text=TextConfig(
        vocab_size=4096,  # the tokenizer's 4014 ids rounded up to a multiple of 128
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        mrope_section=(4, 6, 6),
        tie_word_embeddings=False,
    ),
    vision=VisionConfig(
        depth=4,
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        out_hidden_size=256,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=(1, 3),
    ),
    dtype="float32",
    initializer_range=0.05,
    materialize=True,
)

# Shapes from the published config.json of Qwen/Qwen2.5-VL-{3B,7B}-Instruct.
_QWEN2_5_VL_VISION = VisionConfig(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=2048,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=(7, 15, 23, 31),
)
QWEN2_5_VL_3B = Preset(
    name="random-qwen2.5-vl-3b",
    text=TextConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        max_position_embeddings=128000,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        mrope_section=(16, 24, 24),
        tie_word_embeddings=True,
    ),
    vision=_QWEN2_5_VL_VISION,
    dtype="bfloat16",
    initializer_range=0.02,
)
QWEN2_5_VL_7B = Preset(
    name="random-qwen2.5-vl-7b",
    text=TextConfig(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=128000,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        mrope_section=(16, 24, 24),
        tie_word_embeddings=False,
    ),
    vision=replace(_QWEN2_5_VL_VISION, out_hidden_size=3584),
    dtype="bfloat16",
    initializer_range=0.02,
)
TINY_QWEN2_VL = Preset(
    name="tiny-qwen2-vl",
    text=replace(TINY.text, mrope_section=(8, 4, 4)),
    vision=VisionConfig(
        depth=4,
        hidden_size=128,  # embed_dim
        intermediate_size=256,  # embed_dim * mlp_ratio
        num_heads=4,
        out_hidden_size=256,  # the vision config's hidden_size
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=0,
        fullatt_block_indexes=(0, 1, 2, 3),
        hidden_act="quick_gelu",
    ),
    dtype="float32",
    initializer_range=0.05,
    materialize=True,
    architecture="Qwen2VLForConditionalGeneration",
)
# Qwen3-VL: head_dim set apart from hidden / heads, interleaved mRoPE, learned position
# table smaller than most grids (so it is resampled), two DeepStack taps.
TINY_QWEN3_VL = Preset(
    name="tiny-qwen3-vl",
    text=TextConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=5000000.0,
        mrope_section=(10, 7, 7),
        tie_word_embeddings=False,
        head_dim=48,
        attention_bias=False,
        qk_norm=True,
        mrope_interleaved=True,
    ),
    vision=VisionConfig(
        depth=5,
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        out_hidden_size=256,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=0,
        fullatt_block_indexes=(0, 1, 2, 3, 4),
        hidden_act="gelu_pytorch_tanh",
        num_position_embeddings=64,
        deepstack_visual_indexes=(1, 3),
    ),
    dtype="float32",
    initializer_range=0.05,
    materialize=True,
    architecture="Qwen3VLForConditionalGeneration",
)
# Qwen3-VL-MoE: 4 experts, top 2, layer 1 a dense MLP (mlp_only_layers).
TINY_QWEN3_VL_MOE = Preset(
    name="tiny-qwen3-vl-moe",
    text=TextConfig(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=5000000.0,
        mrope_section=(6, 5, 5),
        tie_word_embeddings=False,
        head_dim=32,
        attention_bias=False,
        qk_norm=True,
        mrope_interleaved=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,  # 2 * 48 != 128: the two expert layouts differ in shape
        mlp_only_layers=(1,),
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
        deepstack_visual_indexes=(0, 2),
    ),
    dtype="float32",
    initializer_range=0.1,  # at 0.05 greedy decoding repeats one token (a weak test)
    materialize=True,
    architecture="Qwen3VLMoeForConditionalGeneration",
)
PRESETS = {
    "tiny": TINY,
    "tiny-qwen2-vl": TINY_QWEN2_VL,
    "3b": QWEN2_5_VL_3B,
    "7b": QWEN2_5_VL_7B,
    "tiny-qwen3-vl": TINY_QWEN3_VL,
    "tiny-qwen3-vl-moe": TINY_QWEN3_VL_MOE,
    "tiny-qwen3.5": TINY_QWEN3_5,
    "tiny-qwen3.5-moe": TINY_QWEN3_5_MOE,
    "qwen3.5-0.8b": QWEN3_5_0_8B,
}
