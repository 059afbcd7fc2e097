"""transformers configs of the presets' families, with the shared tokenizer's special ids:
what `materialize` builds the random model from."""

from __future__ import annotations

from shared.model_config import TextConfig, VisionConfig
from shared.random_checkpoints.preset import Preset


def transformers_config(preset: Preset, special: dict[str, int]):
    return _CONFIG_BUILDERS[preset.architecture](preset, special)


def _text_config(t: TextConfig, special: dict[str, int]) -> dict:
    return dict(
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        max_position_embeddings=t.max_position_embeddings,
        rms_norm_eps=t.rms_norm_eps,
        rope_theta=t.rope_theta,
        hidden_act=t.hidden_act,
        vocab_size=t.vocab_size,
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|im_end|>"],
        rope_scaling={
            "type": "mrope",
            "mrope_section": list(t.mrope_section),
            "rope_theta": t.rope_theta,
        },
    )


def _token_ids(special: dict[str, int]) -> dict:
    return dict(
        image_token_id=special["<|image_pad|>"],
        video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"],
        vision_end_token_id=special["<|vision_end|>"],
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|im_end|>"],
    )


def _with_initializer_range(config, preset: Preset):
    config.text_config.initializer_range = preset.initializer_range
    config.vision_config.initializer_range = preset.initializer_range
    return config


def _qwen2_5_vl_config(preset: Preset, special: dict[str, int]):
    from transformers import Qwen2_5_VLConfig

    t, v = preset.text, preset.vision
    config = Qwen2_5_VLConfig(
        text_config=_text_config(t, special),
        vision_config=dict(
            depth=v.depth,
            hidden_size=v.hidden_size,
            intermediate_size=v.intermediate_size,
            num_heads=v.num_heads,
            out_hidden_size=v.out_hidden_size,
            patch_size=v.patch_size,
            spatial_merge_size=v.spatial_merge_size,
            temporal_patch_size=v.temporal_patch_size,
            window_size=v.window_size,
            fullatt_block_indexes=list(v.fullatt_block_indexes),
            in_channels=v.in_channels,
            hidden_act=v.hidden_act,
        ),
        **_token_ids(special),
        tie_word_embeddings=t.tie_word_embeddings,
        initializer_range=preset.initializer_range,
    )
    return _with_initializer_range(config, preset)


def _qwen2_vl_config(preset: Preset, special: dict[str, int]):
    from transformers import Qwen2VLConfig

    t, v = preset.text, preset.vision
    if v.intermediate_size % v.hidden_size:
        raise ValueError(f"{preset.name}: Qwen2-VL's MLP width is a whole mlp_ratio of its own")
    config = Qwen2VLConfig(
        text_config=_text_config(t, special),
        vision_config=dict(
            depth=v.depth,
            embed_dim=v.hidden_size,
            hidden_size=v.out_hidden_size,
            mlp_ratio=v.intermediate_size // v.hidden_size,
            num_heads=v.num_heads,
            patch_size=v.patch_size,
            spatial_merge_size=v.spatial_merge_size,
            temporal_patch_size=v.temporal_patch_size,
            in_channels=v.in_channels,
            hidden_act=v.hidden_act,
        ),
        **_token_ids(special),
        tie_word_embeddings=t.tie_word_embeddings,
        initializer_range=preset.initializer_range,
    )
    return _with_initializer_range(config, preset)


def _qwen3_vl_config(preset: Preset, special: dict[str, int]):
    import transformers

    t, v = preset.text, preset.vision
    moe = preset.architecture == "Qwen3VLMoeForConditionalGeneration"
    text = _qwen3_text(t, special, intermediate_size=t.intermediate_size)
    if moe:
        text.update(
            num_experts=t.num_experts,
            num_experts_per_tok=t.num_experts_per_tok,
            moe_intermediate_size=t.moe_intermediate_size,
            decoder_sparse_step=t.decoder_sparse_step,
            mlp_only_layers=list(t.mlp_only_layers),
            tie_word_embeddings=t.tie_word_embeddings,
        )
    config_class = transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig
    config = config_class(
        text_config=text,
        vision_config=_qwen3_vision(v, deepstack=True),
        image_token_id=special["<|image_pad|>"],
        video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"],
        vision_end_token_id=special["<|vision_end|>"],
        tie_word_embeddings=t.tie_word_embeddings,
    )
    config.text_config.initializer_range = preset.initializer_range
    config.vision_config.initializer_range = preset.initializer_range
    config.initializer_range = preset.initializer_range
    return config


def _qwen3_text(t: TextConfig, special: dict[str, int], partial_rotary_factor: float | None = None,
                **extra) -> dict:
    """The text config Qwen3-VL and Qwen3.5 share (interleaved mRoPE, q/k norms), plus
    `extra` fields; `partial_rotary_factor` joins the rope parameters when given."""
    rope = {"rope_type": "default", "rope_theta": t.rope_theta,
            "mrope_section": list(t.mrope_section), "mrope_interleaved": t.mrope_interleaved}
    if partial_rotary_factor is not None:
        rope["partial_rotary_factor"] = partial_rotary_factor
    return dict(
        hidden_size=t.hidden_size,
        num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=t.head_dim,
        max_position_embeddings=t.max_position_embeddings,
        rms_norm_eps=t.rms_norm_eps,
        hidden_act=t.hidden_act,
        vocab_size=t.vocab_size,
        attention_bias=t.attention_bias,
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|im_end|>"],
        rope_parameters=rope,
        **extra,
    )


def _qwen3_vision(v: VisionConfig, deepstack: bool) -> dict:
    """Qwen3-VL's tower (Qwen3.5's is the same without DeepStack taps)."""
    config = dict(
        depth=v.depth,
        hidden_size=v.hidden_size,
        intermediate_size=v.intermediate_size,
        num_heads=v.num_heads,
        out_hidden_size=v.out_hidden_size,
        patch_size=v.patch_size,
        spatial_merge_size=v.spatial_merge_size,
        temporal_patch_size=v.temporal_patch_size,
        in_channels=v.in_channels,
        hidden_act=v.hidden_act,
        num_position_embeddings=v.num_position_embeddings,
    )
    if deepstack:
        config["deepstack_visual_indexes"] = list(v.deepstack_visual_indexes)
    return config


def qwen3_5_config(preset: Preset, special: dict[str, int]):
    """transformers' Qwen3.5 (or Qwen3.5-MoE) config of `preset`, with the shared
    tokenizer's special ids."""
    import transformers

    t, v = preset.text, preset.vision
    moe = preset.architecture == "Qwen3_5MoeForConditionalGeneration"
    text = _qwen3_text(
        t, special, partial_rotary_factor=t.partial_rotary_factor,
        layer_types=list(t.layer_types), linear_num_key_heads=t.linear_num_key_heads,
        linear_num_value_heads=t.linear_num_value_heads,
        linear_key_head_dim=t.linear_key_head_dim,
        linear_value_head_dim=t.linear_value_head_dim,
        linear_conv_kernel_dim=t.linear_conv_kernel_dim,
        tie_word_embeddings=t.tie_word_embeddings)
    if moe:
        text.update(num_experts=t.num_experts, num_experts_per_tok=t.num_experts_per_tok,
                    moe_intermediate_size=t.moe_intermediate_size,
                    shared_expert_intermediate_size=t.shared_expert_intermediate_size)
    else:
        text.update(intermediate_size=t.intermediate_size)
    config_class = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    config = config_class(
        text_config=text,
        vision_config=_qwen3_vision(v, deepstack=False),
        image_token_id=special["<|image_pad|>"],
        video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"],
        vision_end_token_id=special["<|vision_end|>"],
        tie_word_embeddings=t.tie_word_embeddings,
    )
    for c in (config, config.text_config, config.vision_config):
        c.initializer_range = preset.initializer_range
    return config


_CONFIG_BUILDERS = {
    "Qwen2VLForConditionalGeneration": _qwen2_vl_config,
    "Qwen2_5_VLForConditionalGeneration": _qwen2_5_vl_config,
    "Qwen3VLForConditionalGeneration": _qwen3_vl_config,
    "Qwen3VLMoeForConditionalGeneration": _qwen3_vl_config,
    "Qwen3_5ForConditionalGeneration": qwen3_5_config,
    "Qwen3_5MoeForConditionalGeneration": qwen3_5_config,
}
