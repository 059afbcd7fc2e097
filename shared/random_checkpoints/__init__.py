"""Vision-language checkpoints with random weights, generated locally and deterministically:
the default model flatserve serves out of the box, the models the tests compare against
transformers, and real-shaped ones for benchmarks.

No hub download is possible where flatserve is developed and tested, so models are made
here. A `Preset` (preset.py) is the data of one: the shapes `load_model_config` reads back,
the weight dtype, the folder name. Every preset shares the byte-level BPE tokenizer trained
on text shipped in shared/data and the Qwen2-VL chat template (Qwen3.5: a template of its form, thinking and XML tool calls); the preprocessor config is
the family's (writer.py).

- `tiny`, the default model: about 5 M parameters, window attention and full-attention
  blocks in the vision tower so every code path runs. transformers builds it from a fixed
  seed; same bytes on every run for a given transformers version.
- `tiny-qwen2-vl`: a Qwen2-VL of about the same size (full attention, LayerNorm and
  quick-GELU in the vision tower), built by transformers from the same seed.
- `tiny-qwen3-vl`, `tiny-qwen3-vl-moe`: Qwen3-VL dense (7.5 M parameters) and MoE (2 M,
  4 experts top 2, one dense layer), DeepStack taps in a 5- and 4-block tower, built by
  transformers from the same seed, with Qwen3-VL's preprocessor config (patch 16, mean
  and std 0.5).
- `tiny-qwen3.5`, `tiny-qwen3.5-moe`, `qwen3.5-0.8b`: the hybrid family (qwen3_5.py).
- `3b`, `7b`: the real shapes of Qwen2.5-VL-3B/7B-Instruct, to measure performance at scale.
  Their weights are streamed tensor by tensor into bf16 safetensors shards with an index,
  so memory stays bounded whatever the model size (7.5 GB and 16.6 GB of disk;
  streamed.py).
"""

from shared.random_checkpoints.preset import CHECKPOINT_VERSION, SEED, Preset
from shared.random_checkpoints.presets import (
    PRESETS,
    QWEN2_5_VL_3B,
    QWEN2_5_VL_7B,
    TINY,
    TINY_QWEN2_VL,
    TINY_QWEN3_5,
    TINY_QWEN3_5_MOE,
    TINY_QWEN3_VL,
    TINY_QWEN3_VL_MOE,
)
from shared.random_checkpoints.qwen3_5 import QWEN3_5_0_8B
from shared.random_checkpoints.streamed import num_parameters, weight_specs
from shared.random_checkpoints.writer import (
    default_cache_dir,
    ensure_checkpoint,
    ensure_tiny_checkpoint,
    preprocessor_config,
    write_checkpoint,
    write_tiny_checkpoint,
)

__all__ = [
    "CHECKPOINT_VERSION", "PRESETS", "QWEN2_5_VL_3B", "QWEN2_5_VL_7B", "QWEN3_5_0_8B", "SEED",
    "TINY", "TINY_QWEN2_VL", "TINY_QWEN3_5", "TINY_QWEN3_5_MOE", "TINY_QWEN3_VL",
    "TINY_QWEN3_VL_MOE", "Preset", "default_cache_dir", "ensure_checkpoint",
    "ensure_tiny_checkpoint", "num_parameters", "preprocessor_config", "weight_specs",
    "write_checkpoint", "write_tiny_checkpoint",
]
