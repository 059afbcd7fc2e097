"""Qwen2.5-VL checkpoint settings, read from a local folder in either config layout.

Published checkpoints write config.json flat (text settings at the top level, `rope_theta`,
`rope_scaling: {type: mrope, mrope_section}`) and preprocessor_config.json with
`min_pixels`/`max_pixels`; transformers 5 writes `text_config` nested with
`rope_parameters` and `size: {shortest_edge, longest_edge}`. Both load to the same values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    in_channels: int = 3
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    head_dim: int = 0  # 0: hidden_size // num_attention_heads

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError(f"mrope_section {self.mrope_section} does not cover head_dim {self.head_dim}")


@dataclass(frozen=True)
class ImageProcessorConfig:
    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this."""
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class ModelConfig:
    path: str
    text: TextConfig
    vision: VisionConfig
    image: ImageProcessorConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]
    torch_dtype: str = "float32"


def _text_section(cfg: dict) -> dict:
    nested = cfg.get("text_config")
    if isinstance(nested, dict) and "hidden_size" in nested:
        merged = dict(cfg)
        merged.update(nested)
        return merged
    return cfg


def _rope(text: dict) -> tuple[float, tuple[int, int, int]]:
    params = text.get("rope_parameters") or {}
    scaling = text.get("rope_scaling") or {}
    theta = params.get("rope_theta", text.get("rope_theta", 1000000.0))
    section = params.get("mrope_section") or scaling.get("mrope_section")
    if section is None:
        raise ValueError("config has no mrope_section (rope_scaling or rope_parameters)")
    return float(theta), tuple(int(s) for s in section)


def _eos_ids(path: Path, cfg: dict, text: dict) -> tuple[int, ...]:
    ids: list[int] = []
    gen = path / "generation_config.json"
    for source in (json.loads(gen.read_text()) if gen.exists() else {}, text, cfg):
        value = source.get("eos_token_id")
        if value is None:
            continue
        for v in value if isinstance(value, list) else [value]:
            if int(v) not in ids:
                ids.append(int(v))
    return tuple(ids)


def _image_processor(path: Path, vision: VisionConfig) -> ImageProcessorConfig:
    file = path / "preprocessor_config.json"
    pre = json.loads(file.read_text()) if file.exists() else {}
    size = pre.get("size") or {}
    return ImageProcessorConfig(
        min_pixels=int(pre.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
        max_pixels=int(pre.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
        patch_size=int(pre.get("patch_size", vision.patch_size)),
        merge_size=int(pre.get("merge_size", vision.spatial_merge_size)),
        temporal_patch_size=int(pre.get("temporal_patch_size", vision.temporal_patch_size)),
        image_mean=tuple(pre.get("image_mean", (0.48145466, 0.4578275, 0.40821073))),
        image_std=tuple(pre.get("image_std", (0.26862954, 0.26130258, 0.27577711))),
        rescale_factor=float(pre.get("rescale_factor", 1 / 255)),
    )


def load_model_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    file = path / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"{path} is not a model folder: no config.json")
    cfg = json.loads(file.read_text())
    text = _text_section(cfg)
    theta, section = _rope(text)
    text_config = TextConfig(
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        intermediate_size=int(text["intermediate_size"]),
        num_hidden_layers=int(text["num_hidden_layers"]),
        num_attention_heads=int(text["num_attention_heads"]),
        num_key_value_heads=int(text.get("num_key_value_heads", text["num_attention_heads"])),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        mrope_section=section,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        hidden_act=text.get("hidden_act", "silu"),
        head_dim=int(text.get("head_dim") or 0),
    )
    v = cfg["vision_config"]
    vision = VisionConfig(
        depth=int(v["depth"]),
        hidden_size=int(v["hidden_size"]),
        intermediate_size=int(v["intermediate_size"]),
        num_heads=int(v["num_heads"]),
        out_hidden_size=int(v.get("out_hidden_size", text_config.hidden_size)),
        patch_size=int(v.get("patch_size", 14)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        window_size=int(v.get("window_size", 112)),
        fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", ())),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        hidden_act=v.get("hidden_act", "silu"),
    )
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or text.get("dtype") or "float32"
    return ModelConfig(
        path=str(path),
        text=text_config,
        vision=vision,
        image=_image_processor(path, vision),
        image_token_id=int(cfg.get("image_token_id", 151655)),
        video_token_id=int(cfg.get("video_token_id", 151656)),
        vision_start_token_id=int(cfg.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(cfg.get("vision_end_token_id", 151653)),
        eos_token_ids=_eos_ids(path, cfg, text),
        torch_dtype=str(dtype),
    )
