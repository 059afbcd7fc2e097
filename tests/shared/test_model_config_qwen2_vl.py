"""load_model_config on Qwen2-VL folders: the published flat config.json and the nested
one transformers 5 writes for the same model parse to the same settings."""

from __future__ import annotations

import json

import pytest

from shared.model_config import load_model_config

# config.json and preprocessor_config.json as published for Qwen/Qwen2-VL-2B-Instruct
PUBLISHED_2B = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 1536,
    "initializer_range": 0.02,
    "intermediate_size": 8960,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2_vl",
    "num_attention_heads": 12,
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.41.2",
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "embed_dim": 1280,
        "mlp_ratio": 4,
        "num_heads": 16,
        "in_chans": 3,
        "hidden_size": 1536,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 151936,
}
PUBLISHED_PREPROCESSOR = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}
# Qwen2-VL-7B-Instruct differs in these
PUBLISHED_7B = {
    **PUBLISHED_2B,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "vocab_size": 152064,
    "vision_config": {**PUBLISHED_2B["vision_config"], "hidden_size": 3584},
}


def _folder(path, config: dict):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    (path / "preprocessor_config.json").write_text(json.dumps(PUBLISHED_PREPROCESSOR))
    return path


@pytest.mark.parametrize("published", [PUBLISHED_2B, PUBLISHED_7B], ids=["2b", "7b"])
def test_published_flat_config(tmp_path, published):
    cfg = load_model_config(_folder(tmp_path / "m", published))
    assert (cfg.architecture, cfg.model_type) == ("Qwen2VLForConditionalGeneration", "qwen2_vl")
    t, v = cfg.text, cfg.vision
    assert t.hidden_size == published["hidden_size"] and t.head_dim == 128
    assert (t.num_attention_heads, t.num_key_value_heads) == (
        published["num_attention_heads"], published["num_key_value_heads"])
    assert (t.mrope_section, t.rope_theta, t.rms_norm_eps) == ((16, 24, 24), 1e6, 1e-6)
    assert t.tie_word_embeddings == published["tie_word_embeddings"]
    assert t.attention_bias and not t.qk_norm and not t.mrope_interleaved
    # the tower is embed_dim wide; its hidden_size is what the merger hands the decoder
    assert (v.depth, v.hidden_size, v.intermediate_size, v.num_heads) == (32, 1280, 5120, 16)
    assert (v.out_hidden_size, v.head_dim) == (published["hidden_size"], 80)
    assert v.fullatt_block_indexes == tuple(range(32)) and v.window_size == 0
    assert (v.patch_size, v.spatial_merge_size, v.hidden_act) == (14, 2, "quick_gelu")
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.eos_token_ids) == (
        151655, 151652, (151645,))
    assert (cfg.image.min_pixels, cfg.image.max_pixels, cfg.image.factor) == (
        3136, 12845056, 28)
    assert cfg.torch_dtype == "bfloat16"


@pytest.mark.parametrize("published", [PUBLISHED_2B, PUBLISHED_7B], ids=["2b", "7b"])
def test_transformers_5_nested_layout_parses_the_same(tmp_path, published):
    from transformers import Qwen2VLConfig

    flat = _folder(tmp_path / "flat", published)
    nested = tmp_path / "nested"
    Qwen2VLConfig.from_pretrained(flat).save_pretrained(nested)
    (nested / "preprocessor_config.json").write_text(json.dumps(PUBLISHED_PREPROCESSOR))
    saved = json.loads((nested / "config.json").read_text())
    assert "text_config" in saved and "rope_parameters" in saved["text_config"]
    assert "hidden_size" not in saved  # really nested
    a, b = load_model_config(flat), load_model_config(nested)
    assert (a.architecture, a.text, a.vision, a.image) == (b.architecture, b.text, b.vision, b.image)
    assert (a.image_token_id, a.vision_start_token_id, a.vision_end_token_id) == (
        b.image_token_id, b.vision_start_token_id, b.vision_end_token_id)
    assert a.eos_token_ids == b.eos_token_ids and a.torch_dtype == b.torch_dtype


def test_widths_agree_with_transformers(tmp_path):
    """Our VisionConfig names the widths transformers builds the Qwen2-VL tower with."""
    from transformers import Qwen2VLConfig

    flat = _folder(tmp_path / "m", {**PUBLISHED_2B, "vision_config": {
        **PUBLISHED_2B["vision_config"], "embed_dim": 96, "mlp_ratio": 3}})
    v = load_model_config(flat).vision
    hf = Qwen2VLConfig.from_pretrained(flat).vision_config
    assert v.hidden_size == hf.embed_dim
    assert v.intermediate_size == hf.embed_dim * hf.mlp_ratio == 288
    assert v.out_hidden_size == hf.hidden_size
