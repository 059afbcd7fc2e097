"""Qwen2.5-VL: the windowed vision tower + the Qwen2 decoder."""

from __future__ import annotations

from engine_proc.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer
from engine_proc.models.qwen_vl import QwenVLForConditionalGeneration


class Qwen2_5_VLForConditionalGeneration(QwenVLForConditionalGeneration):
    vision_class = Qwen2_5_VisionTransformer
