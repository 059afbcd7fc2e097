"""Which model class serves which architecture (ModelConfig.architecture)."""

from __future__ import annotations

import importlib

from torch import nn

from shared.model_config import ModelConfig

# architecture -> (module, class), for every key of shared.model_config.ARCHITECTURES (which
# refuses any other when the config loads); imported on first use: an engine loads its own
_CLASSES = {
    "Qwen2VLForConditionalGeneration": (
        "engine_proc.models.qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": (
        "engine_proc.models.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": (
        "engine_proc.models.qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": (
        "engine_proc.models.qwen3_vl", "Qwen3VLMoeForConditionalGeneration"),
    "Qwen3_5ForConditionalGeneration": (
        "engine_proc.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": (
        "engine_proc.models.qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    module, name = _CLASSES[config.architecture]
    return getattr(importlib.import_module(module), name)
