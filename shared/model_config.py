"""Checkpoint settings of the supported vision-language families (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL dense and MoE, Qwen3.5 dense and MoE), read from a local folder in either config
layout.

The family comes from config.json's `architectures` (else its `model_type`); anything
else fails here, by name, with the list of supported architectures.

Published checkpoints write config.json flat (text settings at the top level, `rope_theta`,
`rope_scaling: {type: mrope, mrope_section}`) and preprocessor_config.json with
`min_pixels`/`max_pixels`; transformers 5 writes `text_config` nested with
`rope_parameters` and `size: {shortest_edge, longest_edge}`. Both load to the same values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# architecture (config.json "architectures") -> model_type, for the families served here
ARCHITECTURES = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
_BY_MODEL_TYPE = {model_type: arch for arch, model_type in ARCHITECTURES.items()}


class UnsupportedModelError(ValueError):
    """The folder holds an architecture flatserve does not implement."""


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
    num_position_embeddings: int = 0  # Qwen3-VL: learned position table (a square grid)
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL: blocks feeding DeepStack

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
    attention_bias: bool = True  # q/k/v biases (Qwen2); Qwen3 has none
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    mrope_interleaved: bool = False  # Qwen3-VL: t/h/w rotary frequencies interleaved
    # Qwen3-VL-MoE: sparse MoE blocks (num_experts 0: dense MLPs everywhere)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Qwen3.5: hybrid decoders. `layer_types` names each layer's token mixer (empty: all
    # full attention); linear layers are Gated DeltaNet with a per-sequence state.
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0  # the share of head_dim the rotary turns
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    ssm_state_dtype: str = "float32"  # the recurrent state's (checkpoints: mamba_ssm_dtype)
    shared_expert_intermediate_size: int = 0  # MoE: a shared expert beside the routed ones

    def is_moe_layer(self, index: int) -> bool:
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    def is_linear_layer(self, index: int) -> bool:
        return bool(self.layer_types) and self.layer_types[index] == LINEAR_ATTENTION

    @property
    def is_hybrid(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV cache (full attention)."""
        return self.num_hidden_layers - self.num_linear_layers

    @property
    def num_linear_layers(self) -> int:
        """Gated DeltaNet layers, each with a state slot per sequence."""
        return sum(t == LINEAR_ATTENTION for t in self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a Gated DeltaNet layer's causal conv: q, k and v."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if sum(self.mrope_section) * 2 != self.rotary_dim:
            raise ValueError(f"mrope_section {self.mrope_section} does not cover the rotary "
                             f"dimension {self.rotary_dim} (head_dim {self.head_dim})")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types names {len(self.layer_types)} layers but "
                                 f"num_hidden_layers is {self.num_hidden_layers}")
            unknown = sorted(set(self.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
            if unknown:
                raise ValueError(f"layer_types has unknown layer types {unknown}; flatserve "
                                 f"implements {FULL_ATTENTION!r} and {LINEAR_ATTENTION!r}")
        if self.is_hybrid:
            if self.linear_num_key_heads < 1 or self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be "
                                 f"a multiple of linear_num_key_heads ({self.linear_num_key_heads})")
            if not self.num_attention_layers:
                raise ValueError("layer_types has no full_attention layer; flatserve's hybrid "
                                 "decoders need at least one")
            if self.ssm_state_dtype not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"unsupported recurrent state dtype {self.ssm_state_dtype!r}")


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
    architecture: str  # a key of ARCHITECTURES
    text: TextConfig
    vision: VisionConfig
    image: ImageProcessorConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]
    torch_dtype: str = "float32"

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture]


def _text_section(cfg: dict) -> dict:
    nested = cfg.get("text_config")
    if isinstance(nested, dict) and "hidden_size" in nested:
        merged = dict(cfg)
        merged.update(nested)
        return merged
    return cfg


def _architecture(cfg: dict) -> str:
    names = list(cfg.get("architectures") or [])
    for name in names:
        if name in ARCHITECTURES:
            return name
    model_type = cfg.get("model_type")
    if not names and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    found = names[0] if names else f"model_type {model_type!r}"
    raise UnsupportedModelError(
        f"unsupported architecture {found}; flatserve serves {', '.join(ARCHITECTURES)}")


# transformers' mrope_section when a config names none (it fits head_dim 128)
_DEFAULT_MROPE_SECTION = {"qwen2_vl": (16, 24, 24), "qwen2_5_vl": (16, 24, 24),
                          "qwen3_vl": (24, 20, 20), "qwen3_vl_moe": (24, 20, 20),
                          "qwen3_5": (11, 11, 10), "qwen3_5_moe": (11, 11, 10)}


def _rope(text: dict, model_type: str) -> tuple[float, tuple[int, int, int], bool]:
    """(theta, mrope_section, interleaved). transformers interleaves Qwen3-VL's rotary
    frequencies whatever the config's mrope_interleaved says, and never Qwen2(.5)-VL's."""
    params = text.get("rope_parameters") or {}
    scaling = text.get("rope_scaling") or {}
    theta = params.get("rope_theta", text.get("rope_theta", 1000000.0))
    section = (params.get("mrope_section") or scaling.get("mrope_section")
               or _DEFAULT_MROPE_SECTION[model_type])
    return float(theta), tuple(int(s) for s in section), model_type.startswith("qwen3")


def _vision(v: dict, model_type: str, text_hidden: int) -> VisionConfig:
    if model_type == "qwen2_vl":  # embed_dim is the tower's width, hidden_size its output
        width = int(v.get("embed_dim", 1280))
        return VisionConfig(
            depth=int(v["depth"]),
            hidden_size=width,
            intermediate_size=int(width * float(v.get("mlp_ratio", 4))),  # as transformers
            num_heads=int(v["num_heads"]),
            out_hidden_size=int(v.get("hidden_size", text_hidden)),
            patch_size=int(v.get("patch_size", 14)),
            spatial_merge_size=int(v.get("spatial_merge_size", 2)),
            temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            window_size=0,
            fullatt_block_indexes=tuple(range(int(v["depth"]))),
            in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
            hidden_act=v.get("hidden_act", "quick_gelu"),
        )
    qwen3 = model_type.startswith("qwen3")
    depth = int(v["depth"])
    return VisionConfig(
        depth=depth,
        hidden_size=int(v["hidden_size"]),
        intermediate_size=int(v["intermediate_size"]),
        num_heads=int(v["num_heads"]),
        out_hidden_size=int(v.get("out_hidden_size", text_hidden)),
        patch_size=int(v.get("patch_size", 16 if qwen3 else 14)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        window_size=0 if qwen3 else int(v.get("window_size", 112)),
        fullatt_block_indexes=(tuple(range(depth)) if qwen3 else
                               tuple(int(i) for i in v.get("fullatt_block_indexes", ()))),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        hidden_act=v.get("hidden_act", "gelu_pytorch_tanh" if qwen3 else "silu"),
        num_position_embeddings=int(v.get("num_position_embeddings", 0)) if qwen3 else 0,
        deepstack_visual_indexes=(tuple(int(i) for i in v.get("deepstack_visual_indexes", ()))
                                  if qwen3 else ()),
    )


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


def _layer_types(text: dict) -> tuple[str, ...]:
    """As transformers: the config's list, else every `full_attention_interval`-th layer
    (default 4) full attention and the rest linear."""
    types = text.get("layer_types")
    if types is not None:
        return tuple(str(t) for t in types)
    interval = int(text.get("full_attention_interval", 4))
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                 for i in range(int(text["num_hidden_layers"])))


def _hybrid_fields(cfg: dict, text: dict) -> dict:
    """Qwen3.5's TextConfig fields: the layer pattern, Gated DeltaNet shapes, gated and
    partially rotary attention, zero-centred norms, the shared expert."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    state_dtype = text.get("mamba_ssm_dtype") or cfg.get("mamba_ssm_dtype") or "float32"
    return dict(
        layer_types=_layer_types(text),
        partial_rotary_factor=float(factor),
        linear_num_key_heads=int(text["linear_num_key_heads"]),
        linear_num_value_heads=int(text["linear_num_value_heads"]),
        linear_key_head_dim=int(text["linear_key_head_dim"]),
        linear_value_head_dim=int(text["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        ssm_state_dtype=str(state_dtype).removeprefix("torch."),
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
    )


def load_model_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    file = path / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"{path} is not a model folder: no config.json")
    cfg = json.loads(file.read_text())
    architecture = _architecture(cfg)
    model_type = ARCHITECTURES[architecture]
    qwen3 = model_type.startswith("qwen3")
    text = _text_section(cfg)
    theta, section, interleaved = _rope(text, model_type)
    moe = model_type in ("qwen3_vl_moe", "qwen3_5_moe")
    text_config = TextConfig(
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        # transformers deletes it from Qwen3.5-MoE's config (every layer is sparse)
        intermediate_size=int(text.get("intermediate_size") or 0),
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
        attention_bias=bool(text.get("attention_bias", not qwen3)),
        qk_norm=qwen3,
        mrope_interleaved=interleaved,
        # published configs say num_experts; transformers 5 saves num_local_experts
        num_experts=(int(text.get("num_experts") or text.get("num_local_experts") or 0)
                     if moe else 0),
        num_experts_per_tok=int(text.get("num_experts_per_tok", 0)),
        moe_intermediate_size=int(text.get("moe_intermediate_size", 0)),
        # Qwen3.5-MoE always renormalizes its top-k weights
        norm_topk_prob=model_type in HYBRID_MODEL_TYPES or bool(text.get("norm_topk_prob", True)),
        decoder_sparse_step=int(text.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in text.get("mlp_only_layers") or ()),
        **(_hybrid_fields(cfg, text) if model_type in HYBRID_MODEL_TYPES else {}),
    )
    vision = _vision(cfg["vision_config"], model_type, text_config.hidden_size)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or text.get("dtype") or "float32"
    return ModelConfig(
        path=str(path),
        architecture=architecture,
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


def tensor_parallel_problem(config: ModelConfig, size: int) -> str | None:
    """Why `config`'s decoder cannot be split over `size` ranks, or None when it can: the
    attention heads (query and key/value) and the MLP's (and experts') intermediate rows
    split evenly."""
    if size == 1:
        return None
    text = config.text
    names = ["num_attention_heads", "num_key_value_heads"]
    if text.intermediate_size:
        names.append("intermediate_size")
    if text.num_experts:
        names.append("moe_intermediate_size")
    if text.shared_expert_intermediate_size:
        names.append("shared_expert_intermediate_size")
    if text.is_hybrid:
        names += ["linear_num_key_heads", "linear_num_value_heads"]
    for name in names:
        value = getattr(text, name)
        if value % size:
            return f"the model's {name} ({value}) is not divisible by the tensor-parallel size {size}"
    return None
