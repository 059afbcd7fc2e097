"""The tiny default Qwen2.5-VL checkpoint, generated locally and deterministically.

No hub download is possible where flatserve is developed and tested, so the default model is
made here: random weights from a fixed seed (about 5 M parameters, window attention and
full-attention blocks in the vision tower so every code path runs), a byte-level BPE
tokenizer trained on text shipped in shared/data, the Qwen2-VL chat template, and the
preprocessor config. Same bytes on every run for a given transformers version.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
CHECKPOINT_VERSION = "v1"
SEED = 1234

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
VOCAB_MULTIPLE = 128

TEXT_CONFIG = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    hidden_act="silu",
)
MROPE_SECTION = [4, 6, 6]
VISION_CONFIG = dict(
    depth=4,
    hidden_size=128,
    intermediate_size=256,
    num_heads=4,
    out_hidden_size=256,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[1, 3],
    in_channels=3,
    hidden_act="silu",
)
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


def default_cache_dir() -> Path:
    root = os.environ.get("FLATSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "flatserve"
    )
    return Path(root)


def ensure_tiny_checkpoint(cache_dir: str | Path | None = None) -> Path:
    """Return the tiny checkpoint folder, writing it first if it is not there yet.

    Safe against concurrent callers: each builds in a temporary folder and renames it into
    place; the first rename wins."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / f"tiny-qwen2.5-vl-{CHECKPOINT_VERSION}"
    if (target / "model.safetensors").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=cache))
    try:
        write_tiny_checkpoint(staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_tiny_checkpoint(folder: str | Path) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    special = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    vocab_size = -(-tokenizer.get_vocab_size() // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    tokenizer.save(str(folder / "tokenizer.json"))
    _write_tokenizer_config(folder)
    _write_weights(folder, vocab_size, special)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
    generation = {
        "bos_token_id": special["<|endoftext|>"],
        "eos_token_id": [special["<|im_end|>"], special["<|endoftext|>"]],
        "pad_token_id": special["<|endoftext|>"],
    }
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return folder


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


def _write_tokenizer_config(folder: Path) -> None:
    template = (DATA_DIR / "qwen2_vl_chat_template.jinja").read_text(encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
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


def _write_weights(folder: Path, vocab_size: int, special: dict[str, int]) -> None:
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(
            TEXT_CONFIG,
            vocab_size=vocab_size,
            bos_token_id=special["<|endoftext|>"],
            eos_token_id=special["<|im_end|>"],
            rope_scaling={"type": "mrope", "mrope_section": MROPE_SECTION, "rope_theta": TEXT_CONFIG["rope_theta"]},
        ),
        vision_config=VISION_CONFIG,
        image_token_id=special["<|image_pad|>"],
        video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"],
        vision_end_token_id=special["<|vision_end|>"],
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|im_end|>"],
        tie_word_embeddings=False,
        initializer_range=0.05,
    )
    config.text_config.initializer_range = 0.05
    config.vision_config.initializer_range = 0.05
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(SEED)
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(str(folder), safe_serialization=True)
    model.generation_config.save_pretrained(str(folder))
