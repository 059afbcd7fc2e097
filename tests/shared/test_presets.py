from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine_proc.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from shared.model_config import load_model_config
from shared.random_checkpoints import (
    PRESETS,
    QWEN2_5_VL_3B,
    QWEN2_5_VL_7B,
    TINY,
    TINY_QWEN2_VL,
    ensure_checkpoint,
    num_parameters,
    weight_specs,
    write_checkpoint,
)


def _shrunk(preset):
    """The preset's structure (tied embeddings, real vocabulary, window and full-attention
    blocks, bf16) at widths that write in milliseconds."""
    # head_dim=0: recomputed from the new widths (replace would carry the old one over)
    text = replace(
        preset.text,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        mrope_section=(4, 6, 6),
        head_dim=0,
    )
    vision = replace(
        preset.vision,
        depth=3,
        hidden_size=64,
        intermediate_size=96,
        num_heads=2,
        out_hidden_size=64,
        fullatt_block_indexes=(1,),
    )
    return replace(preset, name="shrunk", text=text, vision=vision)


def test_presets_have_the_published_shapes():
    assert set(PRESETS) == {"tiny", "tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe", "3b", "7b",
                            "tiny-qwen3.5", "tiny-qwen3.5-moe", "qwen3.5-0.8b"}
    t3, v3 = QWEN2_5_VL_3B.text, QWEN2_5_VL_3B.vision
    assert (t3.hidden_size, t3.intermediate_size, t3.num_hidden_layers) == (2048, 11008, 36)
    assert (t3.num_attention_heads, t3.num_key_value_heads, t3.head_dim) == (16, 2, 128)
    assert (t3.vocab_size, t3.tie_word_embeddings, t3.mrope_section) == (151936, True, (16, 24, 24))
    assert (v3.depth, v3.hidden_size, v3.intermediate_size, v3.num_heads) == (32, 1280, 3420, 16)
    assert (v3.out_hidden_size, v3.fullatt_block_indexes) == (2048, (7, 15, 23, 31))
    t7, v7 = QWEN2_5_VL_7B.text, QWEN2_5_VL_7B.vision
    assert (t7.hidden_size, t7.intermediate_size, t7.num_hidden_layers) == (3584, 18944, 28)
    assert (t7.num_attention_heads, t7.num_key_value_heads, t7.head_dim) == (28, 4, 128)
    assert (t7.vocab_size, t7.tie_word_embeddings) == (152064, False)
    assert v7 == replace(v3, out_hidden_size=3584)
    assert QWEN2_5_VL_3B.dtype == QWEN2_5_VL_7B.dtype == "bfloat16"


def test_parameter_counts_match_the_published_models():
    assert num_parameters(QWEN2_5_VL_3B) == pytest.approx(3.75e9, rel=0.01)
    assert num_parameters(QWEN2_5_VL_7B) == pytest.approx(8.29e9, rel=0.01)


def test_weight_specs_name_what_transformers_saves(tiny_model_path):
    with safe_open(str(tiny_model_path / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert saved == {name: shape for name, shape, _ in weight_specs(TINY)}
    assert load_model_config(tiny_model_path).text == TINY.text
    assert load_model_config(tiny_model_path).vision == TINY.vision


def test_streamed_preset_loads_in_flatserve_and_transformers(tmp_path, tiny_model_path):
    from transformers import Qwen2_5_VLForConditionalGeneration as HFModel

    preset = _shrunk(QWEN2_5_VL_3B)
    folder = write_checkpoint(tmp_path / "m", preset, max_shard_bytes=200_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) >= 3 and sorted(set(index["weight_map"].values())) == shards
    assert index["weight_map"].keys() == {name for name, _, _ in weight_specs(preset)}
    assert "lm_head.weight" not in index["weight_map"]  # tied

    cfg, tiny = load_model_config(folder), load_model_config(tiny_model_path)
    assert (cfg.text, cfg.vision, cfg.torch_dtype) == (preset.text, preset.vision, "bfloat16")
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.eos_token_ids) == (
        tiny.image_token_id,
        tiny.vision_start_token_id,
        tiny.eos_token_ids,
    )

    model = Qwen2_5_VLForConditionalGeneration(cfg, torch.device("cpu"), torch.bfloat16)
    model.load_weights(folder)  # raises on a missing or unexpected tensor
    embed = model.model.embed_tokens.weight
    assert model.lm_head.weight is embed
    assert embed.float().std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(model.model.norm.weight, torch.ones(64, dtype=torch.bfloat16))

    hf, info = HFModel.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert hf.dtype == torch.bfloat16
    assert hf.lm_head.weight.data_ptr() == hf.model.language_model.embed_tokens.weight.data_ptr()
    assert torch.equal(hf.model.language_model.embed_tokens.weight, embed)


def test_the_index_names_the_shards_that_load(tmp_path):
    """A consolidated copy beside indexed shards is not loaded twice (transformers reads the
    index too); an index naming a shard that is not there fails by name."""
    import shutil

    preset = _shrunk(QWEN2_5_VL_3B)
    folder = write_checkpoint(tmp_path / "m", preset, max_shard_bytes=200_000)
    stray = folder / "consolidated.safetensors"
    save_file({"model.unrelated.weight": torch.zeros(2)}, str(stray))
    model = Qwen2_5_VLForConditionalGeneration(load_model_config(folder), torch.device("cpu"),
                                               torch.bfloat16)
    model.load_weights(folder)  # the stray tensor would raise "has no place in the model"
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shutil.move(shard, tmp_path / shard.name)
    with pytest.raises(FileNotFoundError, match="names shards that are not there"):
        model.load_weights(folder)


def test_streamed_weights_are_the_same_on_every_run(tmp_path):
    preset = _shrunk(QWEN2_5_VL_7B)
    a = write_checkpoint(tmp_path / "a", preset, max_shard_bytes=200_000)
    b = write_checkpoint(tmp_path / "b", preset, max_shard_bytes=200_000)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def test_every_id_of_a_real_vocabulary_decodes_to_text(tmp_path):
    """A random model samples ids all over its vocabulary: each must stream visible text,
    or a client times one chunk every few dozen tokens. The fillers change no encoding."""
    from tokenizers import Tokenizer

    from shared.random_checkpoints.writer import _train_tokenizer

    folder = write_checkpoint(tmp_path / "m", _shrunk(QWEN2_5_VL_3B), max_shard_bytes=1 << 20)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    size = QWEN2_5_VL_3B.text.vocab_size
    assert tok.get_vocab_size() == size
    texts = tok.decode_batch([[i] for i in range(size)])
    specials = tok.get_added_tokens_decoder()
    assert [i for i, t in enumerate(texts) if not t and i not in specials] == []
    assert texts[size - 1] == f" tok{size - 1}"
    trained = _train_tokenizer()
    sample = ("<|im_start|>user\nDescribe tok4015 and 你好 😀<|im_end|>\n<|vision_start|>"
              "<|image_pad|><|vision_end|>")
    assert tok.encode(sample).ids == trained.encode(sample).ids
    assert {t.content: i for i, t in specials.items()} == {
        t.content: i for i, t in trained.get_added_tokens_decoder().items()}
    unfilled = write_checkpoint(tmp_path / "u", replace(_shrunk(QWEN2_5_VL_3B), fill_vocab=False),
                                max_shard_bytes=1 << 20)
    assert Tokenizer.from_file(str(unfilled / "tokenizer.json")).get_vocab_size() < 5000


def test_vocabulary_must_cover_the_tokenizer(tmp_path):
    preset = replace(TINY, text=replace(TINY.text, vocab_size=1000))
    with pytest.raises(ValueError, match="vocab_size"):
        write_checkpoint(tmp_path / "m", preset)


def test_an_unknown_architecture_fails_by_name_and_lists_the_served_ones(tmp_path):
    import json

    from shared.model_config import ARCHITECTURES, UnsupportedModelError, load_model_config

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlavaForCausalLM"]}))
    with pytest.raises(UnsupportedModelError) as info:
        load_model_config(tmp_path)
    message = str(info.value)
    assert "LlavaForCausalLM" in message
    assert all(name in message for name in ARCHITECTURES)


def test_tiny_qwen2_vl_preset_reads_back_and_loads_in_both():
    """`flatserve make-model --preset tiny-qwen2-vl`: a Qwen2-VL checkpoint whose config
    reads back as the preset, with the shared tokenizer's special tokens, and whose tensors
    every model of ours and of transformers takes without a missing or extra one."""
    from transformers import Qwen2VLForConditionalGeneration as HFModel

    from engine_proc.models.registry import model_class

    folder = ensure_checkpoint(PRESETS["tiny-qwen2-vl"])
    cfg, tiny = load_model_config(folder), load_model_config(ensure_checkpoint(TINY))
    assert cfg.architecture == "Qwen2VLForConditionalGeneration"
    assert (cfg.text, cfg.vision) == (TINY_QWEN2_VL.text, TINY_QWEN2_VL.vision)
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.eos_token_ids, cfg.image) == (
        tiny.image_token_id, tiny.vision_start_token_id, tiny.eos_token_ids, tiny.image)
    assert (folder / "tokenizer.json").read_bytes() == (
        ensure_checkpoint(TINY) / "tokenizer.json").read_bytes()
    model = model_class(cfg)(cfg, torch.device("cpu"), torch.float32)
    model.load_weights(folder)  # raises on a missing or unexpected tensor
    assert 2e6 < sum(p.numel() for p in model.parameters()) < 2 * num_parameters(TINY)
    _, info = HFModel.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))


def test_weight_specs_are_qwen2_5_vl_only():
    with pytest.raises(ValueError, match="Qwen2.5-VL only"):
        weight_specs(TINY_QWEN2_VL)


def test_the_qwen3_5_preset_has_the_published_0_8b_shapes():
    import torch
    import transformers

    from shared.random_checkpoints.hf_configs import transformers_config
    from shared.random_checkpoints.writer import SPECIAL_TOKENS

    preset = PRESETS["qwen3.5-0.8b"]
    t, v = preset.text, preset.vision
    assert (t.hidden_size, t.intermediate_size, t.num_hidden_layers) == (1024, 3584, 24)
    assert (t.num_linear_layers, t.num_attention_layers, t.layer_types[:4]) == (
        18, 6, ("linear_attention",) * 3 + ("full_attention",))
    assert (t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.rotary_dim) == (8, 2, 256, 64)
    assert (t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim) == (16, 16, 128)
    assert (t.vocab_size, t.tie_word_embeddings, t.rope_theta) == (248320, True, 1e7)
    assert (v.depth, v.hidden_size, v.out_hidden_size, v.deepstack_visual_indexes) == (12, 768, 1024, ())
    config = transformers_config(preset, {tok: 4000 + i for i, tok in enumerate(SPECIAL_TOKENS)})
    with torch.device("meta"):
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(0.87e9, rel=0.02)
