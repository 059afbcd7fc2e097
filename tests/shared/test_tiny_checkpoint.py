from __future__ import annotations

import hashlib
import json

from transformers import AutoTokenizer

from shared.model_config import load_model_config
from shared.random_checkpoints import write_tiny_checkpoint


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_same_bytes_on_every_run(tmp_path, tiny_model_path):
    fresh = write_tiny_checkpoint(tmp_path / "again")
    assert _digests(fresh) == _digests(tiny_model_path)


def test_has_every_file_a_checkpoint_needs(tiny_model_path):
    names = {p.name for p in tiny_model_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "preprocessor_config.json", "generation_config.json"} <= names


def test_vision_tower_exercises_window_and_full_attention(tiny_model_path):
    cfg = load_model_config(tiny_model_path)
    assert 0 < len(cfg.vision.fullatt_block_indexes) < cfg.vision.depth
    assert cfg.vision.window_size // (cfg.vision.patch_size * cfg.vision.spatial_merge_size) >= 2


def test_tokenizer_round_trips_multibyte_text_and_special_tokens(tiny_model_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    cfg = load_model_config(tiny_model_path)
    text = "Describe this image. 你好 😀 café"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.convert_tokens_to_ids("<|image_pad|>") == cfg.image_token_id
    assert tok.convert_tokens_to_ids("<|vision_start|>") == cfg.vision_start_token_id
    assert tok.convert_tokens_to_ids("<|im_end|>") in cfg.eos_token_ids
    assert len(tok) <= cfg.text.vocab_size


def test_chat_template_marks_images(tiny_model_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:"}},
        {"type": "text", "text": "What is this?"},
    ]}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>What is this?" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_flat_published_layout_loads_the_same(tmp_path, tiny_model_path):
    nested = json.loads((tiny_model_path / "config.json").read_text())
    text = nested.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**nested, **text, "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
            "torch_dtype": "float32"}
    pre = json.loads((tiny_model_path / "preprocessor_config.json").read_text())
    flat_pre = {k: v for k, v in pre.items() if k not in ("min_pixels", "max_pixels")}
    flat_pre["size"] = {"shortest_edge": pre["min_pixels"], "longest_edge": pre["max_pixels"]}
    folder = tmp_path / "flat"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(flat))
    (folder / "preprocessor_config.json").write_text(json.dumps(flat_pre))
    (folder / "generation_config.json").write_bytes((tiny_model_path / "generation_config.json").read_bytes())
    a, b = load_model_config(tiny_model_path), load_model_config(folder)
    assert (a.text, a.vision, a.image, a.eos_token_ids) == (b.text, b.vision, b.image, b.eos_token_ids)
    assert a.image_token_id == b.image_token_id
