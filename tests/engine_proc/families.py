"""The model cases the parity tests run over (engine-level in test_engine.py: CASES;
model-level through conftest's harness: MODEL_CASES): one tiny checkpoint each, named by its Preset.

A family joins by adding its tiny preset(s) to CASES: `preset.architecture` is both the
transformers class the tests compare against and the key of engine_proc/models/registry.py.
Shapes are written in merge units by the tests, so any patch/merge size works; keep
min_pixels (56*56) at most 4 merge units of the preset's patches.
"""

from __future__ import annotations

from dataclasses import replace

from shared.model_config import TextConfig, VisionConfig
from shared.random_checkpoints import (
    TINY,
    TINY_QWEN2_VL,
    TINY_QWEN3_5,
    TINY_QWEN3_5_MOE,
    TINY_QWEN3_VL,
    TINY_QWEN3_VL_MOE,
    Preset,
)
from shared.random_checkpoints.qwen3_5 import F, L
from tests.engine_proc.qwen3_vl_checkpoints import SHAPES as QWEN3_VL_SHAPES

# Qwen2-VL in another shape: other head counts (and GQA ratio), depths, patch and merge
# sizes, rope sections; tied embeddings. Test-only, so not in PRESETS.
TINY_QWEN2_VL_B = Preset(
    name="tiny-qwen2-vl-b",
    text=TextConfig(
        vocab_size=4096,
        hidden_size=192,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        mrope_section=(8, 8, 8),
        tie_word_embeddings=True,
    ),
    vision=VisionConfig(
        depth=5,
        hidden_size=96,
        intermediate_size=288,
        num_heads=2,
        out_hidden_size=192,
        patch_size=10,
        spatial_merge_size=3,
        temporal_patch_size=2,
        window_size=0,
        fullatt_block_indexes=(0, 1, 2, 3, 4),
        hidden_act="quick_gelu",
    ),
    dtype="float32",
    initializer_range=0.07,  # at 0.05 greedy tokens repeat one id; bf16 drifts at 0.1
    materialize=True,
    architecture="Qwen2VLForConditionalGeneration",
)

QWEN3_VL_B = QWEN3_VL_SHAPES["dense-b"]

# Qwen3.5 in another shape: the pattern starts with a full-attention layer and has two in a
# row, one value head per key head, other head sizes and rope sections, tied embeddings.
TINY_QWEN3_5_B = replace(
    TINY_QWEN3_5,
    name="tiny-qwen3.5-b",
    text=replace(TINY_QWEN3_5.text, num_hidden_layers=6, layer_types=(F, L, L, F, L, F),
                 hidden_size=96, intermediate_size=160, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=48, partial_rotary_factor=0.5,
                 mrope_section=(4, 4, 4), linear_num_key_heads=3, linear_num_value_heads=3,
                 linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=3,
                 tie_word_embeddings=True),
    vision=replace(TINY_QWEN3_5.vision, out_hidden_size=96, depth=3),
)

CASES = [TINY, TINY_QWEN2_VL, TINY_QWEN2_VL_B, TINY_QWEN3_VL, QWEN3_VL_B, TINY_QWEN3_VL_MOE,
         TINY_QWEN3_5, TINY_QWEN3_5_MOE, TINY_QWEN3_5_B]
CASE_IDS = [preset.name for preset in CASES]
# Model-level parity through conftest's VLHarness (test_model_parity.py, test_model_vision.py,
# test_model_mrope.py). Qwen3-VL's tower and DeepStack have their own model-level checks in
# test_model_qwen3_vl.py; its engine-level parity runs over CASES like every family.
MODEL_CASES = [TINY, TINY_QWEN2_VL, TINY_QWEN2_VL_B]
MODEL_CASE_IDS = [preset.name for preset in MODEL_CASES]

# The families served end to end in the e2e and soak tests, beside the default model.
SERVED_FAMILIES = [TINY_QWEN2_VL, TINY_QWEN3_VL, TINY_QWEN3_VL_MOE, TINY_QWEN3_5, TINY_QWEN3_5_MOE]
# The short soak (about 30 s each) runs once per way an engine holds a request: the default
# model (Qwen2.5-VL) for the Qwen2 family's images, Qwen3-VL for its DeepStack embeddings,
# Qwen3.5 for its state slots and snapshots. The others hold and free what one of those does
# (the same model runner, KV blocks, images and slots): Qwen2-VL is Qwen2.5-VL's runner
# without window attention, and a MoE differs from its dense model only in the feed-forward,
# which keeps nothing across steps. They are served end to end above, not soaked again.
SOAKED_FAMILIES = [TINY_QWEN3_VL, TINY_QWEN3_5]
