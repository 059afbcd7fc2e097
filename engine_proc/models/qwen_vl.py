"""A Qwen-VL model: vision tower + decoder, with the interface the model runner calls, and
its checkpoint loading. Each family (qwen2_vl.py, qwen2_5_vl.py) names its tower class.

The runner embeds tokens, encodes a step's images in one vision forward, writes the image
embeddings over the placeholder rows, and runs `forward` with the attention Context set.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine_proc.image_processor import pixels_to_patch_chunks
from engine_proc.layers.linear import MergedLinear, store_weights_transposed
from engine_proc.models.qwen2 import Qwen2Model
from engine_proc.models.vision_tower import VisionTower
from shared.model_config import ModelConfig

# checkpoint projection name -> (merged module name, shard)
_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
PATCH_CHUNK = 4096  # patches normalized and embedded at once (~19 MB of float32 patches)

# transformers 5 may save the inner model's children under model.*; published checkpoints
# (and this module) use model.* for the decoder and visual.* for the tower.
_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _local_name(name: str) -> tuple[str, int | None]:
    """Checkpoint tensor name -> (this module's parameter name, shard of a merged layer)."""
    for old, new in _PREFIXES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _PACKED:
        merged, shard = _PACKED[parts[-2]]
        parts[-2] = merged
        return ".".join(parts), shard
    return name, None


INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / name for name in names]
        absent = [name for name in names if not (folder / name).is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names shards that are not there: {absent[:3]}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    return files


class QwenVLForConditionalGeneration(nn.Module):
    """Published checkpoints name the tower visual.* and the decoder model.*; transformers 5
    saves model.visual.* and model.language_model.* (both load)."""

    vision_class: type[VisionTower]  # set by each family

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
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
        with _default_dtype(dtype), torch.device("meta"):
            self.visual = self.vision_class(config.vision, self.device, max_side)
            self.model = Qwen2Model(text, self.device, dtype)
            self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.to_empty(device=self.device)
        if text.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.eval()

    def load_weights(self, path: str | Path) -> None:
        """Load the checkpoint in `path` by tensor name: the shards that
        model.safetensors.index.json names when it is there (as transformers does: other
        *.safetensors beside them, such as a consolidated copy, are not this checkpoint),
        else every *.safetensors file."""
        files = checkpoint_files(Path(path))
        params = dict(self.named_parameters())
        tied = self.config.text.tie_word_embeddings
        needed: set[tuple[str, int | None]] = set()
        for module_name, module in self.named_modules():
            shards = range(len(module.offsets) - 1) if isinstance(module, MergedLinear) else [None]
            for leaf, _ in module.named_parameters(recurse=False):
                name = f"{module_name}.{leaf}" if module_name else leaf
                if not (tied and name == "lm_head.weight"):
                    needed.update((name, shard) for shard in shards)
        loaded: set[tuple[str, int | None]] = set()
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    name, shard = _local_name(key)
                    if tied and name == "lm_head.weight":
                        continue
                    if name not in params:
                        if key.endswith("rotary_emb.inv_freq"):
                            continue
                        raise KeyError(f"checkpoint tensor {key} has no place in the model")
                    tensor = f.get_tensor(key)
                    param = params[name]
                    with torch.no_grad():
                        if shard is None:
                            if tensor.shape != param.shape:
                                raise ValueError(
                                    f"{key}: shape {tuple(tensor.shape)} != {tuple(param.shape)}"
                                )
                            param.copy_(tensor)
                        else:
                            module = self.get_submodule(name.rsplit(".", 1)[0])
                            module.load_shard(param, tensor, shard)
                    loaded.add((name, shard))
        missing = needed - loaded
        if missing:
            names = sorted(f"{n}[{s}]" if s is not None else n for n, s in missing)
            raise KeyError(f"checkpoint lacks {len(names)} tensors, e.g. {names[:5]}")
        if self.device.type == "cpu":
            store_weights_transposed(self)

    @torch.no_grad()
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int [T] -> [T, hidden]."""
        return self.model.embed_tokens(input_ids)

    @torch.no_grad()
    def encode_images(
        self, pixels: list[torch.Tensor], grids: list[tuple[int, int, int]]
    ) -> list[torch.Tensor]:
        """Resized uint8 images [h, w, 3] (host or device) with their (t, h, w) patch grids
        -> per image embeddings [t*h*w / merge^2, hidden], from one vision forward."""
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
        Patches are embedded piece by piece: float patches are 8x the uint8 pixels
        (float32, temporal duplication), ~100 MB for one 2048px image; the embeddings are a
        tenth of that."""
        return torch.cat([
            self.visual.patch_embed(chunk)
            for chunk in pixels_to_patch_chunks(
                pixels.to(self.device, non_blocking=True), grid, self.config.image, PATCH_CHUNK)
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
    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """inputs_embeds [T, hidden], positions int64 [3, T] -> hidden [T, hidden].
        Attention layout and KV cache slots come from engine_proc.context."""
        return self.model(inputs_embeds, positions)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in the model dtype."""
        return self.lm_head(hidden)
