"""Perturbed Qwen3-VL checkpoints for the Qwen3-VL model and engine tests: the dense preset
(patch 16, merge 2), a second dense shape (other heads and head_dim, depths, patch 14,
merge 3, rope sections, DeepStack taps, tied embeddings), and the MoE preset with its
vision tower at patch 14, merge 3 (other heads, depths, rope sections, a dense MLP layer
among the MoE ones)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from shared.random_checkpoints import TINY_QWEN3_VL, TINY_QWEN3_VL_MOE, Preset, write_checkpoint

SHAPES = {
    "dense": TINY_QWEN3_VL,
    "dense-b": replace(
        TINY_QWEN3_VL,
        name="tiny-qwen3-vl-b",
        initializer_range=0.08,  # at 0.05 greedy decoding repeats one token: a weak check
        text=replace(TINY_QWEN3_VL.text, hidden_size=192, intermediate_size=384,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                     head_dim=32, mrope_section=(8, 4, 4), tie_word_embeddings=True),
        vision=replace(TINY_QWEN3_VL.vision, depth=4, hidden_size=96, intermediate_size=192,
                       num_heads=3, out_hidden_size=192, patch_size=14, spatial_merge_size=3,
                       num_position_embeddings=49, deepstack_visual_indexes=(0, 2)),
    ),
    "moe": replace(
        TINY_QWEN3_VL_MOE,
        name="moe-p14-m3",
        vision=replace(TINY_QWEN3_VL_MOE.vision, patch_size=14, spatial_merge_size=3),
    ),
}
_COPIED = ("preprocessor_config.json", "generation_config.json", "tokenizer.json",
           "tokenizer_config.json", "chat_template.jinja")


def hf_class(preset: Preset):
    import transformers

    return getattr(transformers, preset.architecture)


def perturbed_checkpoint(preset: Preset, tmp_path_factory) -> Path:
    """The preset written, then every tensor nudged (so norms and biases are not the
    trivial 1 / 0 of a fresh init) and saved by transformers."""
    src = write_checkpoint(tmp_path_factory.mktemp(f"{preset.name}-src"), preset)
    dst = tmp_path_factory.mktemp(preset.name)
    hf = hf_class(preset).from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    hf.save_pretrained(dst)
    for name in _COPIED:
        if (src / name).exists():
            (dst / name).write_bytes((src / name).read_bytes())
    return dst
