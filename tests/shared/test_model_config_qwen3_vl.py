"""Qwen3-VL configs as published (nested text_config with rope_scaling, preprocessor
min/max in `size`) parse to the settings the model code needs."""

from __future__ import annotations

import json

from shared.model_config import load_model_config

_VISION = {
    "deepstack_visual_indexes": [8, 16, 24],
    "depth": 27,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "in_channels": 3,
    "intermediate_size": 4304,
    "model_type": "qwen3_vl",
    "num_heads": 16,
    "num_position_embeddings": 2304,
    "out_hidden_size": 4096,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
_TEXT = {
    "attention_bias": False,
    "bos_token_id": 151643,
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_position_embeddings": 262144,
    "model_type": "qwen3_vl_text",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                     "rope_type": "default"},
    "rope_theta": 5000000,
    "vocab_size": 151936,
}
_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}


def _write(folder, architecture, text, vision=_VISION, tie=False):
    config = {
        "architectures": [architecture],
        "image_token_id": 151655,
        "model_type": "qwen3_vl_moe" if "Moe" in architecture else "qwen3_vl",
        "text_config": text,
        "tie_word_embeddings": tie,
        "video_token_id": 151656,
        "vision_config": vision,
        "vision_end_token_id": 151653,
        "vision_start_token_id": 151652,
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "preprocessor_config.json").write_text(json.dumps(_PREPROCESSOR))
    return load_model_config(folder)


def test_published_dense_config(tmp_path):
    cfg = _write(tmp_path, "Qwen3VLForConditionalGeneration", _TEXT)
    t, v, image = cfg.text, cfg.vision, cfg.image
    assert cfg.model_type == "qwen3_vl" and cfg.torch_dtype == "bfloat16"
    assert (t.hidden_size, t.head_dim, t.num_key_value_heads) == (4096, 128, 8)
    assert (t.rope_theta, t.mrope_section, t.mrope_interleaved) == (5e6, (24, 20, 20), True)
    assert (t.attention_bias, t.qk_norm, t.num_experts, t.tie_word_embeddings) == (
        False, True, 0, False)
    assert not any(t.is_moe_layer(i) for i in range(t.num_hidden_layers))
    assert (v.depth, v.hidden_size, v.num_heads, v.out_hidden_size) == (27, 1152, 16, 4096)
    assert (v.patch_size, v.num_position_embeddings, v.deepstack_visual_indexes) == (
        16, 2304, (8, 16, 24))
    assert (v.hidden_act, v.window_size, v.fullatt_block_indexes) == (
        "gelu_pytorch_tanh", 0, tuple(range(27)))
    assert (image.min_pixels, image.max_pixels, image.patch_size) == (65536, 16777216, 16)
    assert image.image_mean == image.image_std == (0.5, 0.5, 0.5)
    assert cfg.eos_token_ids == (151645,)


def test_published_moe_config(tmp_path):
    text = dict(_TEXT, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                num_attention_heads=32, num_key_value_heads=4, num_experts=128,
                num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1,
                mlp_only_layers=[], norm_topk_prob=True)
    cfg = _write(tmp_path, "Qwen3VLMoeForConditionalGeneration", text,
                 dict(_VISION, out_hidden_size=2048))
    t = cfg.text
    assert cfg.model_type == "qwen3_vl_moe"
    assert (t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size) == (128, 8, 768)
    assert t.norm_topk_prob and all(t.is_moe_layer(i) for i in range(48))


def test_transformers_5_moe_names_the_expert_count_num_local_experts(tmp_path):
    text = dict(_TEXT, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                mlp_only_layers=[1], decoder_sparse_step=1)
    text.pop("rope_scaling")
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6,
                               "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    t = _write(tmp_path, "Qwen3VLMoeForConditionalGeneration", text).text
    assert (t.num_experts, t.mrope_interleaved) == (4, True)
    assert [t.is_moe_layer(i) for i in range(3)] == [True, False, True]


def test_rope_defaults_follow_transformers(tmp_path):
    """transformers interleaves Qwen3-VL's frequencies whatever mrope_interleaved says and
    falls back to mrope_section (24, 20, 20) when none is named."""
    text = dict(_TEXT, rope_scaling={"rope_type": "default"})
    t = _write(tmp_path, "Qwen3VLForConditionalGeneration", text).text
    assert (t.mrope_section, t.mrope_interleaved) == ((24, 20, 20), True)
