"""Which model class serves which architecture (ModelConfig.architecture)."""

from __future__ import annotations

import importlib

from torch import nn

from shared.model_config import ARCHITECTURES, ModelConfig, UnsupportedModelError

# architecture -> (module, class); imported on first use, so an engine loads only its own
_CLASSES = {
    "Qwen2VLForConditionalGeneration": (
        "engine_proc.models.qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": (
        "engine_proc.models.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": (
        "engine_proc.models.qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": (
        "engine_proc.models.qwen3_vl", "Qwen3VLMoeForConditionalGeneration"),
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    entry = _CLASSES.get(config.architecture)
    if entry is None:
        served = [name for name in ARCHITECTURES if name in _CLASSES]
        raise UnsupportedModelError(
            f"architecture {config.architecture} is not implemented yet; this build serves "
            f"{', '.join(served)}")
    module, name = entry
    return getattr(importlib.import_module(module), name)
