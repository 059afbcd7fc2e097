"""Qwen2-VL: the full-attention vision tower + the Qwen2 decoder."""

from __future__ import annotations

from engine_proc.models.qwen2_vl_vision import Qwen2VisionTransformer
from engine_proc.models.qwen_vl import QwenVLForConditionalGeneration


class Qwen2VLForConditionalGeneration(QwenVLForConditionalGeneration):
    vision_class = Qwen2VisionTransformer
