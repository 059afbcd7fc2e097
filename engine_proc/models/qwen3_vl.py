"""Qwen3-VL, dense and MoE: vision tower with DeepStack + Qwen3 decoder, with the interface
the model runner calls (qwen_vl.py, whose loading, embedding and encoding code it shares).

An image's embeddings are [tokens, hidden * (1 + k)]: the embeddings that replace its
placeholder rows, then its k DeepStack features. The runner passes the DeepStack columns
of a step's rows to `forward` (zeros on text rows), so chunked prefill and R3 treat them
as part of the image.
"""

from __future__ import annotations

import torch

from engine_proc.models.qwen3 import Qwen3Model
from engine_proc.models.qwen3_vl_vision import Qwen3VisionTransformer
from engine_proc.models.qwen_vl import QwenVLForConditionalGeneration


class Qwen3VLForConditionalGeneration(QwenVLForConditionalGeneration):
    vision_class = Qwen3VisionTransformer
    decoder_class = Qwen3Model

    def encode_stage(
        self, hidden: torch.Tensor, grid: tuple[int, int, int], stage: int
    ) -> torch.Tensor:
        """One stage of one image's vision tower: patch embeddings (stage 0) or the tensor
        the previous stage carried (hidden states and DeepStack block outputs so far) in;
        the next carried tensor out, or after the last stage the image's embeddings with
        its DeepStack features [t*h*w / merge^2, hidden * (1 + k)]."""
        grids = (tuple(int(v) for v in grid),)
        if stage == 0:
            hidden = self.visual.add_position_embeddings(hidden, grids)
        first, end = self.visual.stages[stage]
        hidden = self.visual.run_blocks(hidden, grids, first, end)
        return self.visual.merge_all(hidden) if stage == self.num_vision_stages - 1 else hidden


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """The same model: the config's experts make the decoder's MLPs sparse."""
