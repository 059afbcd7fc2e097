"""A Qwen-VL model: vision tower + decoder, with the interface the model runner calls.
Each family (qwen2_vl.py, qwen2_5_vl.py, qwen3_vl.py) names its tower and decoder classes.

The runner embeds tokens, encodes a step's images in one vision forward, writes the image
embeddings over the placeholder rows, and runs `forward` with the attention Context set.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from engine_proc.distributed import tp_shard
from engine_proc.image_processor import pixels_to_patch_chunks
from engine_proc.layers.vocab_parallel import ParallelLMHead
from engine_proc.models.qwen2 import Qwen2Model
from engine_proc.models.weight_loader import default_dtype, load_checkpoint
from shared.model_config import ModelConfig

PATCH_CHUNK = 4096  # patches normalized and embedded at once (~19 MB of float32 patches)


class QwenVLForConditionalGeneration(nn.Module):
    """Published checkpoints name the tower visual.* and the decoder model.*; transformers 5
    saves model.visual.* and model.language_model.* (both load)."""

    vision_class: type[nn.Module]  # set by each family
    decoder_class: type[nn.Module] = Qwen2Model

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 vision: bool = True) -> None:
        """vision=False leaves the vision tower out (tensor-parallel workers: the tower
        runs on rank 0 only, see engine_proc/tensor_parallel.py)."""
        super().__init__()
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        text, image = config.text, config.image
        # Longest grid side the processor can produce (aspect ratio <= 200), for the
        # vision rotary table; it grows on demand past that.
        max_side = (
            math.ceil(math.sqrt(200 * image.max_pixels) / image.patch_size) + image.merge_size
        )
        # Parameters are created uninitialized on the device: load_weights fills them.
        with default_dtype(dtype), torch.device("meta"):
            if vision:
                self.visual = self.vision_class(config.vision, self.device, max_side)
            self.model = self.decoder_class(text, self.device, dtype)
            self.lm_head = ParallelLMHead(text.hidden_size, text.vocab_size, tp_shard())
        # Module.to_empty's empty_like on meta tensors runs torch's Python reference, whose
        # first call imports sympy (0.3 s of every engine start): plain empty instead
        device = self.device
        self._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
        if text.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.eval()

    def load_weights(self, path: str | Path) -> None:
        """Load the checkpoint in `path` by tensor name (see weight_loader)."""
        skip = () if hasattr(self, "visual") else ("visual.",)
        load_checkpoint(self, path, tied=self.config.text.tie_word_embeddings,
                        skip_prefixes=skip)

    @torch.no_grad()
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int [T] -> [T, hidden]."""
        return self.model.embed_tokens(input_ids)

    @torch.no_grad()
    def encode_images(
        self, pixels: list[torch.Tensor], grids: list[tuple[int, int, int]]
    ) -> list[torch.Tensor]:
        """Resized uint8 images [h, w, 3] (host or device) with their (t, h, w) patch grids
        -> per image embeddings [t*h*w / merge^2, hidden] (Qwen3-VL: hidden * (1 + k), the
        DeepStack features as further columns), from one vision forward."""
        if not pixels:
            return []
        if len(pixels) != len(grids):
            raise ValueError(f"{len(pixels)} images but {len(grids)} grids")
        grids = [tuple(int(v) for v in g) for g in grids]
        hidden = torch.cat([self.embed_patches(p, g) for p, g in zip(pixels, grids, strict=True)])
        embeds = self.visual.forward_embedded(hidden, tuple(grids))
        del hidden
        unit = self.config.vision.spatial_merge_size**2
        outs = embeds.split([t * h * w // unit for t, h, w in grids])
        if len(outs) == 1:
            return list(outs)
        # R3: separate storage per image, so each is freed once its own prefill used it
        # (views would keep the whole batch's buffer alive until the last one goes).
        return [out.clone() for out in outs]

    def embed_patches(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One resized uint8 image [h, w, 3] -> its patch embeddings [t*h*w, vision hidden].
        Patches are embedded piece by piece: float patches are 4x the uint8 pixels (float32;
        8x with the temporal copies, in bf16 or for a video's frame pairs), ~50-100 MB for
        one 2048px image; the embeddings are a tenth of that."""
        embed = self.visual.patch_embed
        return torch.cat([
            embed(chunk)
            for chunk in pixels_to_patch_chunks(
                pixels.to(self.device, non_blocking=True), grid, self.config.image, PATCH_CHUNK,
                still=embed.takes_still)
        ])

    @property
    def num_vision_stages(self) -> int:
        return len(self.visual.stages)

    def encode_stage(
        self, hidden: torch.Tensor, grid: tuple[int, int, int], stage: int
    ) -> torch.Tensor:
        """One stage of one image's vision tower (`visual.stages`): patch embeddings or the
        previous stage's output in; the next hidden states out, or, after the last stage,
        the merged embeddings [t*h*w / merge^2, hidden]."""
        first, end = self.visual.stages[stage]
        hidden = self.visual.run_blocks(hidden, (grid,), first, end)
        return self.visual.merger(hidden) if stage == self.num_vision_stages - 1 else hidden

    @torch.no_grad()
    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        deepstack: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """inputs_embeds [T, hidden], positions int64 [3, T], deepstack [T, k * hidden] (a
        Qwen3-VL step's image rows' DeepStack features, zeros elsewhere) or None -> hidden
        [T, hidden]. Attention layout and KV cache slots come from engine_proc.context."""
        return self.model(inputs_embeds, positions, deepstack)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in the model dtype (tensor parallel:
        on rank 0; None on the other ranks)."""
        return self.lm_head(hidden)
