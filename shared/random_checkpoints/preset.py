"""The description of one random-weight test checkpoint (random_checkpoints/writer.py writes
it): the shapes `load_model_config` reads back, the dtype on disk, how it is made."""

from __future__ import annotations

from dataclasses import dataclass

from shared.model_config import TextConfig, VisionConfig

# v2: the tokenizer covers the whole vocabulary (filler tokens past the trained BPE's ids)
CHECKPOINT_VERSION = "v2"
SEED = 1234
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclass(frozen=True)
class Preset:
    """One random checkpoint. `text.vocab_size` may exceed the shared tokenizer's trained
    vocabulary, never fall short of it; the ids past it decode to filler text unless
    `fill_vocab` is off."""

    name: str  # the cache folder is f"{name}-{CHECKPOINT_VERSION}"
    text: TextConfig
    vision: VisionConfig
    dtype: str  # of the weights on disk: "float32", "bfloat16" or "float16"
    initializer_range: float
    # True: build the transformers model from SEED and save it in one file (the tiny
    # checkpoint, whose bytes tests pin). False: stream normal(0, initializer_range)
    # matrices, ones for norms and zeros for biases into shards, never holding the model.
    materialize: bool = False
    architecture: str = "Qwen2_5_VLForConditionalGeneration"  # a key of _CONFIG_BUILDERS
    # materialized only: normal(0, perturb) noise added to every parameter after init, so
    # norm weights and biases are not the trivial ones and zeros a fresh init gives
    perturb: float = 0.0
    # a filler token (" tok4014") for every id past the trained tokenizer's, so that every id
    # a random model samples streams visible text (off: those ids decode to nothing)
    fill_vocab: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(SAFETENSORS_DTYPES)}")
        if not self.materialize and self.architecture != "Qwen2_5_VLForConditionalGeneration":
            raise ValueError(f"{self.name}: only Qwen2.5-VL weights are streamed; "
                             "set materialize=True")


