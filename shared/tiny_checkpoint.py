"""Vision-language checkpoints with random weights, generated locally and deterministically.

No hub download is possible where flatserve is developed and tested, so models are made
here. A `Preset` is the data of one: the shapes `load_model_config` reads back, the weight
dtype, the folder name. Every preset shares the byte-level BPE tokenizer trained on text
shipped in shared/data and the Qwen2-VL chat template; the preprocessor config is the
family's.

- `tiny`, the default model: about 5 M parameters, window attention and full-attention
  blocks in the vision tower so every code path runs. transformers builds it from a fixed
  seed; same bytes on every run for a given transformers version.
- `tiny-qwen2-vl`: a Qwen2-VL of about the same size (full attention, LayerNorm and
  quick-GELU in the vision tower), built by transformers from the same seed.
- `tiny-qwen3-vl`, `tiny-qwen3-vl-moe`: Qwen3-VL dense (7.5 M parameters) and MoE (2 M,
  4 experts top 2, one dense layer), DeepStack taps in a 5- and 4-block tower, built by
  transformers from the same seed, with Qwen3-VL's preprocessor config (patch 16, mean
  and std 0.5).
- `tiny-qwen3.5`, `tiny-qwen3.5-moe`, `qwen3.5-0.8b`: the hybrid family
  (shared/qwen3_5_checkpoints.py).
- `3b`, `7b`: the real shapes of Qwen2.5-VL-3B/7B-Instruct, to measure performance at scale.
  Their weights are streamed tensor by tensor into bf16 safetensors shards with an index,
  so memory stays bounded whatever the model size (7.5 GB and 16.6 GB of disk).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from dataclasses import replace
from pathlib import Path

from shared.model_config import TextConfig, VisionConfig
from shared.preset import CHECKPOINT_VERSION, SAFETENSORS_DTYPES, SEED, Preset
from shared.qwen3_5_checkpoints import (
    QWEN3_5_0_8B,
    TINY_QWEN3_5,
    TINY_QWEN3_5_MOE,
    qwen3_5_config,
)

DATA_DIR = Path(__file__).parent / "data"
MAX_SHARD_BYTES = 4 * 10**9  # transformers' "4GB": Qwen2.5-VL-3B ships as 2 shards, 7B as 5
CHUNK_ELEMENTS = 1 << 23  # streamed weights are drawn and written this many at a time

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
BPE_VOCAB_SIZE = 4000
PREPROCESSOR_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 16384,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}
# Qwen3-VL's published layout (transformers 5 `size`), with a smaller minimum for tiny tests
QWEN3_VL_PREPROCESSOR_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "processor_class": "Qwen3VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 64 * 64, "longest_edge": 4096 * 4096},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


TINY = Preset(
    name="tiny-qwen2.5-vl",
    text=TextConfig(
        vocab_size=4096,  # the tokenizer's 4014 ids rounded up to a multiple of 128
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        mrope_section=(4, 6, 6),
        tie_word_embeddings=False,
    ),
    vision=VisionConfig(
        depth=4,
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        out_hidden_size=256,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=(1, 3),
    ),
    dtype="float32",
    initializer_range=0.05,
    materialize=True,
)

# Shapes from the published config.json of Qwen/Qwen2.5-VL-{3B,7B}-Instruct.
_QWEN2_5_VL_VISION = VisionConfig(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=2048,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=(7, 15, 23, 31),
)
QWEN2_5_VL_3B = Preset(
    name="random-qwen2.5-vl-3b",
    text=TextConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        max_position_embeddings=128000,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        mrope_section=(16, 24, 24),
        tie_word_embeddings=True,
    ),
    vision=_QWEN2_5_VL_VISION,
    dtype="bfloat16",
    initializer_range=0.02,
)
QWEN2_5_VL_7B = Preset(
    name="random-qwen2.5-vl-7b",
    text=TextConfig(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=128000,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        mrope_section=(16, 24, 24),
        tie_word_embeddings=False,
    ),
    vision=replace(_QWEN2_5_VL_VISION, out_hidden_size=3584),
    dtype="bfloat16",
    initializer_range=0.02,
)
TINY_QWEN2_VL = Preset(
    name="tiny-qwen2-vl",
    text=replace(TINY.text, mrope_section=(8, 4, 4)),
    vision=VisionConfig(
        depth=4,
        hidden_size=128,  # embed_dim
        intermediate_size=256,  # embed_dim * mlp_ratio
        num_heads=4,
        out_hidden_size=256,  # the vision config's hidden_size
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=0,
        fullatt_block_indexes=(0, 1, 2, 3),
        hidden_act="quick_gelu",
    ),
    dtype="float32",
    initializer_range=0.05,
    materialize=True,
    architecture="Qwen2VLForConditionalGeneration",
)
# Qwen3-VL: head_dim set apart from hidden / heads, interleaved mRoPE, learned position
# table smaller than most grids (so it is resampled), two DeepStack taps.
TINY_QWEN3_VL = Preset(
    name="tiny-qwen3-vl",
    text=TextConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=5000000.0,
        mrope_section=(10, 7, 7),
        tie_word_embeddings=False,
        head_dim=48,
        attention_bias=False,
        qk_norm=True,
        mrope_interleaved=True,
    ),
    vision=VisionConfig(
        depth=5,
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        out_hidden_size=256,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=0,
        fullatt_block_indexes=(0, 1, 2, 3, 4),
        hidden_act="gelu_pytorch_tanh",
        num_position_embeddings=64,
        deepstack_visual_indexes=(1, 3),
    ),
    dtype="float32",
    initializer_range=0.05,
    materialize=True,
    architecture="Qwen3VLForConditionalGeneration",
)
# Qwen3-VL-MoE: 4 experts, top 2, layer 1 a dense MLP (mlp_only_layers).
TINY_QWEN3_VL_MOE = Preset(
    name="tiny-qwen3-vl-moe",
    text=TextConfig(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=5000000.0,
        mrope_section=(6, 5, 5),
        tie_word_embeddings=False,
        head_dim=32,
        attention_bias=False,
        qk_norm=True,
        mrope_interleaved=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,  # 2 * 48 != 128: the two expert layouts differ in shape
        mlp_only_layers=(1,),
    ),
    vision=VisionConfig(
        depth=4,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        out_hidden_size=128,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=0,
        fullatt_block_indexes=(0, 1, 2, 3),
        hidden_act="gelu_pytorch_tanh",
        num_position_embeddings=36,
        deepstack_visual_indexes=(0, 2),
    ),
    dtype="float32",
    initializer_range=0.1,  # at 0.05 greedy decoding repeats one token (a weak test)
    materialize=True,
    architecture="Qwen3VLMoeForConditionalGeneration",
)
PRESETS = {
    "tiny": TINY,
    "tiny-qwen2-vl": TINY_QWEN2_VL,
    "3b": QWEN2_5_VL_3B,
    "7b": QWEN2_5_VL_7B,
    "tiny-qwen3-vl": TINY_QWEN3_VL,
    "tiny-qwen3-vl-moe": TINY_QWEN3_VL_MOE,
    "tiny-qwen3.5": TINY_QWEN3_5,
    "tiny-qwen3.5-moe": TINY_QWEN3_5_MOE,
    "qwen3.5-0.8b": QWEN3_5_0_8B,
}


def default_cache_dir() -> Path:
    root = os.environ.get("FLATSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "flatserve"
    )
    return Path(root)


def ensure_tiny_checkpoint(cache_dir: str | Path | None = None) -> Path:
    """Return the tiny checkpoint folder, writing it first if it is not there yet."""
    return ensure_checkpoint(TINY, cache_dir)


def ensure_checkpoint(preset: Preset, cache_dir: str | Path | None = None) -> Path:
    """Return the preset's folder in the cache, writing it first if it is not there yet.

    Safe against concurrent callers: each builds in a temporary folder and renames it into
    place; the first rename wins."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / f"{preset.name}-{CHECKPOINT_VERSION}"
    if (target / "config.json").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{preset.name}-", dir=cache))
    try:
        write_checkpoint(staging, preset)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_tiny_checkpoint(folder: str | Path) -> Path:
    return write_checkpoint(folder, TINY)


def write_checkpoint(
    folder: str | Path, preset: Preset, max_shard_bytes: int = MAX_SHARD_BYTES
) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    if tokenizer.get_vocab_size() > preset.text.vocab_size:
        raise ValueError(
            f"{preset.name}: vocab_size {preset.text.vocab_size} < the tokenizer's "
            f"{tokenizer.get_vocab_size()} ids"
        )
    special = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    tokenizer.save(str(folder / "tokenizer.json"))
    _write_tokenizer_config(folder, preset.text.max_position_embeddings)
    config = _transformers_config(preset, special)
    if preset.materialize:
        _save_transformers_model(folder, config, preset)
    else:
        config.architectures = [preset.architecture]
        config.dtype = preset.dtype
        config.save_pretrained(str(folder))
        _write_streamed_weights(folder, preset, max_shard_bytes)
    (folder / "preprocessor_config.json").write_text(
        json.dumps(preprocessor_config(preset), indent=2) + "\n"
    )
    generation = {
        "bos_token_id": special["<|endoftext|>"],
        "eos_token_id": [special["<|im_end|>"], special["<|endoftext|>"]],
        "pad_token_id": special["<|endoftext|>"],
    }
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return folder


def preprocessor_config(preset: Preset) -> dict:
    """The family's preprocessor config with the tower's patch and merge sizes."""
    v = preset.vision
    base = PREPROCESSOR_CONFIG
    if preset.architecture.startswith(("Qwen3VL", "Qwen3_5")):
        factor = v.patch_size * v.spatial_merge_size
        base = {**QWEN3_VL_PREPROCESSOR_CONFIG,
                "size": {"shortest_edge": 4 * factor * factor, "longest_edge": 4096 * 4096}}
    return {
        **base,
        "patch_size": v.patch_size,
        "temporal_patch_size": v.temporal_patch_size,
        "merge_size": v.spatial_merge_size,
    }


def weight_specs(preset: Preset) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) of every tensor in a Qwen2.5-VL checkpoint, with the published
    names, in file order. init: "normal" for matrices, "ones" for norm weights, "zeros" for
    biases."""
    if preset.architecture != "Qwen2_5_VLForConditionalGeneration":
        raise ValueError(f"{preset.name}: weight specs are written for Qwen2.5-VL only")
    t, v = preset.text, preset.vision
    q_size, kv_size = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    specs = [("model.embed_tokens.weight", (t.vocab_size, t.hidden_size), "normal")]
    for i in range(t.num_hidden_layers):
        p = f"model.layers.{i}."
        specs += _norm(p + "input_layernorm", t.hidden_size)
        specs += _linear(p + "self_attn.q_proj", t.hidden_size, q_size, bias=True)
        specs += _linear(p + "self_attn.k_proj", t.hidden_size, kv_size, bias=True)
        specs += _linear(p + "self_attn.v_proj", t.hidden_size, kv_size, bias=True)
        specs += _linear(p + "self_attn.o_proj", q_size, t.hidden_size, bias=False)
        specs += _norm(p + "post_attention_layernorm", t.hidden_size)
        specs += _linear(p + "mlp.gate_proj", t.hidden_size, t.intermediate_size, bias=False)
        specs += _linear(p + "mlp.up_proj", t.hidden_size, t.intermediate_size, bias=False)
        specs += _linear(p + "mlp.down_proj", t.intermediate_size, t.hidden_size, bias=False)
    specs += _norm("model.norm", t.hidden_size)
    if not t.tie_word_embeddings:
        specs += _linear("lm_head", t.hidden_size, t.vocab_size, bias=False)
    patch = (v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    specs.append(("visual.patch_embed.proj.weight", (v.hidden_size, *patch), "normal"))
    for i in range(v.depth):
        p = f"visual.blocks.{i}."
        specs += _norm(p + "norm1", v.hidden_size)
        specs += _norm(p + "norm2", v.hidden_size)
        specs += _linear(p + "attn.qkv", v.hidden_size, 3 * v.hidden_size, bias=True)
        specs += _linear(p + "attn.proj", v.hidden_size, v.hidden_size, bias=True)
        specs += _linear(p + "mlp.gate_proj", v.hidden_size, v.intermediate_size, bias=True)
        specs += _linear(p + "mlp.up_proj", v.hidden_size, v.intermediate_size, bias=True)
        specs += _linear(p + "mlp.down_proj", v.intermediate_size, v.hidden_size, bias=True)
    merged = v.hidden_size * v.spatial_merge_size**2
    specs += _norm("visual.merger.ln_q", v.hidden_size)
    specs += _linear("visual.merger.mlp.0", merged, merged, bias=True)
    specs += _linear("visual.merger.mlp.2", merged, v.out_hidden_size, bias=True)
    return specs


def num_parameters(preset: Preset) -> int:
    return sum(math.prod(shape) for _, shape, _ in weight_specs(preset))


def _linear(prefix: str, in_features: int, out_features: int, bias: bool) -> list:
    specs = [(f"{prefix}.weight", (out_features, in_features), "normal")]
    if bias:
        specs.append((f"{prefix}.bias", (out_features,), "zeros"))
    return specs


def _norm(prefix: str, size: int) -> list:
    return [(f"{prefix}.weight", (size,), "ones")]


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = (DATA_DIR / "tokenizer_corpus.txt").read_text(encoding="utf-8")
    tokenizer.train_from_iterator(corpus.split("\n\n"), trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def _write_tokenizer_config(folder: Path, model_max_length: int) -> None:
    template = (DATA_DIR / "qwen2_vl_chat_template.jinja").read_text(encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")


def _transformers_config(preset: Preset, special: dict[str, int]):
    return _CONFIG_BUILDERS[preset.architecture](preset, special)


def _text_config(t: TextConfig, special: dict[str, int]) -> dict:
    return dict(
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        max_position_embeddings=t.max_position_embeddings,
        rms_norm_eps=t.rms_norm_eps,
        rope_theta=t.rope_theta,
        hidden_act=t.hidden_act,
        vocab_size=t.vocab_size,
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|im_end|>"],
        rope_scaling={
            "type": "mrope",
            "mrope_section": list(t.mrope_section),
            "rope_theta": t.rope_theta,
        },
    )


def _token_ids(special: dict[str, int]) -> dict:
    return dict(
        image_token_id=special["<|image_pad|>"],
        video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"],
        vision_end_token_id=special["<|vision_end|>"],
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|im_end|>"],
    )


def _with_initializer_range(config, preset: Preset):
    config.text_config.initializer_range = preset.initializer_range
    config.vision_config.initializer_range = preset.initializer_range
    return config


def _qwen2_5_vl_config(preset: Preset, special: dict[str, int]):
    from transformers import Qwen2_5_VLConfig

    t, v = preset.text, preset.vision
    config = Qwen2_5_VLConfig(
        text_config=_text_config(t, special),
        vision_config=dict(
            depth=v.depth,
            hidden_size=v.hidden_size,
            intermediate_size=v.intermediate_size,
            num_heads=v.num_heads,
            out_hidden_size=v.out_hidden_size,
            patch_size=v.patch_size,
            spatial_merge_size=v.spatial_merge_size,
            temporal_patch_size=v.temporal_patch_size,
            window_size=v.window_size,
            fullatt_block_indexes=list(v.fullatt_block_indexes),
            in_channels=v.in_channels,
            hidden_act=v.hidden_act,
        ),
        **_token_ids(special),
        tie_word_embeddings=t.tie_word_embeddings,
        initializer_range=preset.initializer_range,
    )
    return _with_initializer_range(config, preset)


def _qwen2_vl_config(preset: Preset, special: dict[str, int]):
    from transformers import Qwen2VLConfig

    t, v = preset.text, preset.vision
    if v.intermediate_size % v.hidden_size:
        raise ValueError(f"{preset.name}: Qwen2-VL's MLP width is a whole mlp_ratio of its own")
    config = Qwen2VLConfig(
        text_config=_text_config(t, special),
        vision_config=dict(
            depth=v.depth,
            embed_dim=v.hidden_size,
            hidden_size=v.out_hidden_size,
            mlp_ratio=v.intermediate_size // v.hidden_size,
            num_heads=v.num_heads,
            patch_size=v.patch_size,
            spatial_merge_size=v.spatial_merge_size,
            temporal_patch_size=v.temporal_patch_size,
            in_channels=v.in_channels,
            hidden_act=v.hidden_act,
        ),
        **_token_ids(special),
        tie_word_embeddings=t.tie_word_embeddings,
        initializer_range=preset.initializer_range,
    )
    return _with_initializer_range(config, preset)


def _qwen3_vl_config(preset: Preset, special: dict[str, int]):
    import transformers

    t, v = preset.text, preset.vision
    moe = preset.architecture == "Qwen3VLMoeForConditionalGeneration"
    text = dict(
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=t.head_dim,
        max_position_embeddings=t.max_position_embeddings,
        rms_norm_eps=t.rms_norm_eps,
        hidden_act=t.hidden_act,
        vocab_size=t.vocab_size,
        attention_bias=t.attention_bias,
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|im_end|>"],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": t.rope_theta,
            "mrope_section": list(t.mrope_section),
            "mrope_interleaved": t.mrope_interleaved,
        },
    )
    if moe:
        text.update(
            num_experts=t.num_experts,
            num_experts_per_tok=t.num_experts_per_tok,
            moe_intermediate_size=t.moe_intermediate_size,
            decoder_sparse_step=t.decoder_sparse_step,
            mlp_only_layers=list(t.mlp_only_layers),
            tie_word_embeddings=t.tie_word_embeddings,
        )
    config_class = transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig
    config = config_class(
        text_config=text,
        vision_config=dict(
            depth=v.depth,
            hidden_size=v.hidden_size,
            intermediate_size=v.intermediate_size,
            num_heads=v.num_heads,
            out_hidden_size=v.out_hidden_size,
            patch_size=v.patch_size,
            spatial_merge_size=v.spatial_merge_size,
            temporal_patch_size=v.temporal_patch_size,
            in_channels=v.in_channels,
            hidden_act=v.hidden_act,
            num_position_embeddings=v.num_position_embeddings,
            deepstack_visual_indexes=list(v.deepstack_visual_indexes),
        ),
        image_token_id=special["<|image_pad|>"],
        video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"],
        vision_end_token_id=special["<|vision_end|>"],
        tie_word_embeddings=t.tie_word_embeddings,
    )
    config.text_config.initializer_range = preset.initializer_range
    config.vision_config.initializer_range = preset.initializer_range
    config.initializer_range = preset.initializer_range
    return config


_CONFIG_BUILDERS = {
    "Qwen2VLForConditionalGeneration": _qwen2_vl_config,
    "Qwen2_5_VLForConditionalGeneration": _qwen2_5_vl_config,
    "Qwen3VLForConditionalGeneration": _qwen3_vl_config,
    "Qwen3VLMoeForConditionalGeneration": _qwen3_vl_config,
    "Qwen3_5ForConditionalGeneration": qwen3_5_config,
    "Qwen3_5MoeForConditionalGeneration": qwen3_5_config,
}


def _save_transformers_model(folder: Path, config, preset: Preset) -> None:
    import torch
    import transformers

    model_class = getattr(transformers, preset.architecture)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(SEED)
        model = model_class(config).eval()
        if preset.perturb:
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn_like(param) * preset.perturb)
        model = model.to(getattr(torch, preset.dtype))
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(str(folder), safe_serialization=True)
    model.generation_config.save_pretrained(str(folder))


def _write_streamed_weights(folder: Path, preset: Preset, max_shard_bytes: int) -> None:
    """Shards named and indexed like transformers' (model-0000i-of-0000n.safetensors and
    model.safetensors.index.json). Each file's header is written first, from the shapes,
    then every tensor is drawn CHUNK_ELEMENTS at a time straight into the file."""
    import torch

    dtype = getattr(torch, preset.dtype)
    buffer = torch.empty(CHUNK_ELEMENTS, dtype=dtype)
    itemsize = buffer.element_size()
    shards = _split_shards(weight_specs(preset), itemsize, max_shard_bytes)
    generator = torch.Generator().manual_seed(SEED)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        with open(folder / file, "wb") as f:
            f.write(_safetensors_header(shard, SAFETENSORS_DTYPES[preset.dtype], itemsize))
            for name, shape, init in shard:
                numel = math.prod(shape)
                for start in range(0, numel, CHUNK_ELEMENTS):
                    part = buffer[: min(CHUNK_ELEMENTS, numel - start)]
                    if init == "normal":
                        part.normal_(0.0, preset.initializer_range, generator=generator)
                    else:
                        part.fill_(1.0 if init == "ones" else 0.0)
                    f.write(part.view(torch.uint8).numpy())
                weight_map[name] = file
                total += numel * itemsize
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    text = json.dumps(index, indent=2, sort_keys=True) + "\n"
    (folder / "model.safetensors.index.json").write_text(text)


def _split_shards(specs: list, itemsize: int, max_shard_bytes: int) -> list[list]:
    """Consecutive runs of tensors, each run at most max_shard_bytes unless one tensor is
    bigger on its own."""
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        nbytes = math.prod(spec[1]) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _safetensors_header(specs: list, dtype: str, itemsize: int) -> bytes:
    """The safetensors prefix: header length (u64 little-endian), then the JSON header with
    each tensor's byte range in the data that follows, padded to 8 bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in specs:
        end = offset + math.prod(shape) * itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw
