"""Writing a random checkpoint folder: the shared tokenizer (trained on text shipped in
shared/data) with the Qwen2-VL chat template, the family's preprocessor config, and the
weights: built by transformers from the shared seed (`materialize`) or streamed shard by
shard (random_checkpoints/streamed.py). `ensure_checkpoint` keeps one folder per preset
in a cache."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from shared.cache_dir import default_cache_dir
from shared.random_checkpoints.hf_configs import transformers_config
from shared.random_checkpoints.preset import CHECKPOINT_VERSION, SEED, Preset
from shared.random_checkpoints.presets import TINY
from shared.random_checkpoints.streamed import MAX_SHARD_BYTES, write_streamed_weights

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
# Qwen3.5's template form (thinking, Qwen3-Coder tool calls); the other families share
# Qwen2-VL's
_CHAT_TEMPLATES = {"Qwen3_5ForConditionalGeneration": "qwen3_5_chat_template.jinja",
                   "Qwen3_5MoeForConditionalGeneration": "qwen3_5_chat_template.jinja"}

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
    if preset.fill_vocab:
        tokenizer = _filled(tokenizer, preset.text.vocab_size)
    special = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    tokenizer.save(str(folder / "tokenizer.json"))
    _write_tokenizer_config(folder, preset.text.max_position_embeddings,
                            _CHAT_TEMPLATES.get(preset.architecture, "qwen2_vl_chat_template.jinja"))
    config = transformers_config(preset, special)
    if preset.materialize:
        _save_transformers_model(folder, config, preset)
    else:
        config.architectures = [preset.architecture]
        config.dtype = preset.dtype
        config.save_pretrained(str(folder))
        write_streamed_weights(folder, preset, max_shard_bytes)
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


def _filled(tokenizer, vocab_size: int):
    """The tokenizer with a filler token for every id from its own size up to `vocab_size`,
    each decoding to visible text (" tok4014"): a random model samples ids all over its
    vocabulary, and an id that decodes to nothing streams no text, so a client would time
    one chunk every few dozen tokens. The fillers are vocabulary entries no merge reaches:
    encoding is unchanged. The special tokens go into the model's vocabulary at their own
    ids too, or loading would renumber them after the fillers."""
    from tokenizers import Tokenizer

    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    for added in data["added_tokens"]:
        vocab[added["content"]] = added["id"]
    for i in range(tokenizer.get_vocab_size(), vocab_size):
        vocab[f"\u0120tok{i}"] = i  # "Ġ": the byte-level alphabet's space
    return Tokenizer.from_str(json.dumps(data))


def _write_tokenizer_config(folder: Path, model_max_length: int, template_name: str) -> None:
    template = (DATA_DIR / template_name).read_text(encoding="utf-8")
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
