"""Large random checkpoints (the 3B/7B Qwen2.5-VL shapes) written without ever holding the
model: every tensor drawn a chunk at a time straight into safetensors shards."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from shared.random_checkpoints.preset import SAFETENSORS_DTYPES, SEED, Preset

MAX_SHARD_BYTES = 4 * 10**9  # transformers' "4GB": Qwen2.5-VL-3B ships as 2 shards, 7B as 5
CHUNK_ELEMENTS = 1 << 23  # streamed weights are drawn and written this many at a time


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


def write_streamed_weights(folder: Path, preset: Preset, max_shard_bytes: int) -> None:
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
