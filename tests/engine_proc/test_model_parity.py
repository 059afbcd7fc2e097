"""Our model against transformers' on the same weights, for every family case
(families.py): prefill, paged decode, chunked prefill, mixed batches, checkpoint layouts.
Images are written in merge units, so each case sees the same prompts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_proc.layers.attention import Attention
from engine_proc.models.registry import model_class
from shared.model_config import load_model_config
from tests.engine_proc.conftest import hf_class
from tests.tolerance import assert_argmax_differs_only_at_ties, tolerance_for

pytestmark = pytest.mark.numeric


def _prefill_logits(vl, kv, key, ids, images, grids, chunks=None):
    """Logits of every prompt position, run through the paged cache in `chunks`."""
    embeds = vl.embeds(ids, images, grids)
    positions, delta = vl.positions(ids, grids)
    bounds = [0, *(chunks or []), len(ids)]
    hidden = [
        kv.forward(vl.model, [(key, embeds[a:b], positions[:, a:b])])
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return vl.model.compute_logits(torch.cat(hidden)), delta


def _decode_inputs(vl, token: int, index: int, delta: int):
    embeds = vl.model.embed_tokens(torch.tensor([token], device=vl.model.device))
    return embeds, torch.full((3, 1), index + delta, dtype=torch.int64, device=vl.model.device)


def test_text_only_prefill_matches_hf(vl, paged_kv):
    ids, grids = vl.prompt(list(range(10, 47)))
    logits, delta = _prefill_logits(vl, paged_kv, "a", ids, [], grids)
    assert delta == 0
    expected = vl.hf_logits(ids, [], grids)
    torch.testing.assert_close(logits, expected, **vl.logits_tolerance(expected, ids, grids))


def test_one_image_prefill_matches_hf(vl, paged_kv):
    ids, grids = vl.prompt([5, 6, 7], (4, 6), [8, 9, 10, 11])
    images = [vl.pixels(grids[0], seed=1)]
    logits, _ = _prefill_logits(vl, paged_kv, "a", ids, images, grids)
    expected = vl.hf_logits(ids, images, grids)
    torch.testing.assert_close(logits, expected, **vl.logits_tolerance(expected, ids, grids))


def test_two_images_of_different_sizes_match_hf(vl, paged_kv):
    ids, grids = vl.prompt([5, 6], (5, 7), [7, 8, 9], (3, 2), [10, 11])
    images = [vl.pixels(g, seed=i) for i, g in enumerate(grids)]
    logits, _ = _prefill_logits(vl, paged_kv, "a", ids, images, grids)
    expected = vl.hf_logits(ids, images, grids)
    torch.testing.assert_close(logits, expected, **vl.logits_tolerance(expected, ids, grids))


def test_decode_steps_through_paged_cache_match_hf(vl, paged_kv):
    ids, grids = vl.prompt([5, 6, 7], (4, 4), [8, 9])
    images = [vl.pixels(grids[0], seed=2)]
    logits, delta = _prefill_logits(vl, paged_kv, "a", ids, images, grids)
    token = int(logits[-1].argmax())
    for _ in range(5):
        ids = ids + [token]
        embeds, pos = _decode_inputs(vl, token, len(ids) - 1, delta)
        step = vl.model.compute_logits(paged_kv.forward(vl.model, [("a", embeds, pos)]))[0]
        expected = vl.hf_logits(ids, images, grids)[-1]
        torch.testing.assert_close(step, expected, **vl.logits_tolerance(expected, ids, grids))
        token = int(step.argmax())


def test_chunked_prefill_splitting_an_image_matches_hf(vl, paged_kv):
    ids, grids = vl.prompt([5, 6, 7], (4, 4), [8, 9, 10])
    images = [vl.pixels(grids[0], seed=3)]
    # image placeholders are tokens 4..19: chunk ends at 9 and 15 land inside them
    logits, _ = _prefill_logits(vl, paged_kv, "a", ids, images, grids, chunks=[9, 15])
    expected = vl.hf_logits(ids, images, grids)
    torch.testing.assert_close(logits, expected, **vl.logits_tolerance(expected, ids, grids))


@pytest.mark.parametrize("host_lens", [False, True])
@pytest.mark.parametrize("num_decodes", [0, None, 2])
def test_mixed_batch_matches_each_sequence_alone(vl, make_paged_kv, num_decodes, host_lens):
    """Two decodes + one prefill chunk (after an earlier chunk that ends inside its image)
    in one flat forward equal each span run alone: padded all together (num_decodes 0)
    or with the leading decodes split off (found on the host, or given); the prefill
    padded or, with the host lengths, on its own."""
    prompts = {
        "txt": vl.prompt(list(range(30, 51))),
        "img2": vl.prompt([13], (2, 3), [14, 15]),
        "img": vl.prompt([5, 6, 7], (4, 4), [8, 9, 10, 11, 12]),
    }
    inputs = {}
    for i, (key, (ids, grids)) in enumerate(prompts.items()):
        images = [vl.pixels(g, seed=10 + i) for g in grids]
        inputs[key] = (vl.embeds(ids, images, grids), *vl.positions(ids, grids))
    emb, pos, _ = inputs["img"]
    chunk = ("img", emb[9:], pos[:, 9:])
    decodes = []
    for token, key in enumerate(("txt", "img2"), start=77):
        e, p = _decode_inputs(vl, token, len(prompts[key][0]), inputs[key][2])
        decodes.append((key, e, p))

    results = []
    for batched in (False, True):
        kv = make_paged_kv(host_lens=host_lens)
        for key in ("txt", "img2"):
            kv.forward(vl.model, [(key, inputs[key][0], inputs[key][1])])
        kv.forward(vl.model, [("img", emb[:9], pos[:, :9])])
        if batched:
            hidden = kv.forward(vl.model, decodes + [chunk], num_decodes=num_decodes)
            results.append(list(hidden.split([1, 1, emb.shape[0] - 9])))
        else:
            results.append([kv.forward(vl.model, [span]) for span in decodes + [chunk]])
    # batched, each span's rows sit in other GEMM blockings and attention paths than alone
    tokens = max(len(ids) for ids, _ in prompts.values()) + 1
    for alone, batched in zip(*results, strict=True):
        torch.testing.assert_close(batched, alone, **vl.hidden_tolerance(alone, tokens))


def test_all_decode_batch_matches_each_alone(vl, make_paged_kv):
    kvs = [make_paged_kv(), make_paged_kv()]
    prompts = [vl.prompt(list(range(20, 20 + n))) for n in (3, 9, 14)]
    for kv in kvs:
        for i, (ids, grids) in enumerate(prompts):
            kv.forward(vl.model, [(i, vl.embeds(ids, [], grids), vl.positions(ids, grids)[0])])
    steps = [(i, *_decode_inputs(vl, 40 + i, len(ids), 0)) for i, (ids, _) in enumerate(prompts)]
    batched = kvs[0].forward(vl.model, steps)
    alone = torch.cat([kvs[1].forward(vl.model, [step]) for step in steps])
    tokens = max(len(ids) for ids, _ in prompts) + 1
    torch.testing.assert_close(batched, alone, **vl.hidden_tolerance(alone, tokens))


def test_runs_without_kv_cache_like_a_profiling_pass(vl, paged_kv):
    """Empty caches (before the runner allocates them): no cache writes, each sequence
    attends to its own new tokens."""
    prompts = [vl.prompt(list(range(20, 31))), vl.prompt([5], (2, 2), [6, 7])]
    spans = []
    for i, (ids, grids) in enumerate(prompts):
        images = [vl.pixels(g, seed=i) for g in grids]
        spans.append((i, vl.embeds(ids, images, grids), vl.positions(ids, grids)[0]))
    cached = [paged_kv.forward(vl.model, [span]) for span in spans]
    ctx = paged_kv.context([(f"x{i}", e.shape[0]) for i, e, _ in spans])
    for layer in paged_kv.layers:
        layer.k_cache = layer.v_cache = torch.tensor([])
    from engine_proc.context import reset_context, set_context

    for use in (spans[:1], spans):  # one sequence (causal path) and a padded batch
        set_context(ctx if len(use) > 1 else paged_kv.context([("y", use[0][1].shape[0])]))
        try:
            hidden = vl.model(
                torch.cat([e for _, e, _ in use]), torch.cat([p for _, _, p in use], dim=1)
            )
        finally:
            reset_context()
        expected = torch.cat(cached[: len(use)])
        tokens = max(e.shape[0] for _, e, _ in use)
        torch.testing.assert_close(hidden, expected, **vl.hidden_tolerance(expected, tokens))


def _relayout(src, dst, flat_config: bool, hf5_names: bool, shards: int, tie: bool = False):
    """Copy a checkpoint with another config layout / tensor naming / sharding."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(src / "model.safetensors")
    if tie:
        tensors.pop("lm_head.weight", None)
    if hf5_names:
        renamed = {}
        for k, v in tensors.items():
            if k.startswith("visual."):
                k = "model." + k
            elif k.startswith("model."):
                k = "model.language_model." + k[len("model.") :]
            renamed[k] = v
        tensors = renamed
    names = sorted(tensors)
    for i in range(shards):
        part = {k: tensors[k].contiguous() for k in names[i::shards]}
        save_file(part, dst / f"model-{i + 1:05d}-of-{shards:05d}.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    if tie:
        cfg["tie_word_embeddings"] = True
        cfg.get("text_config", {}).pop("tie_word_embeddings", None)
    if flat_config:
        text = cfg.pop("text_config")
        params = text.pop("rope_parameters")
        text.pop("model_type", None)
        cfg.update(text)
        cfg["rope_theta"] = params["rope_theta"]
        cfg["rope_scaling"] = {"type": "mrope", "mrope_section": params["mrope_section"]}
        cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_flat_config_and_hf5_names_load_the_same(vl, tmp_path):
    flat = _relayout(vl.path, tmp_path / "flat", flat_config=True, hf5_names=False, shards=3)
    nested = _relayout(vl.path, tmp_path / "hf5", flat_config=False, hf5_names=True, shards=2)
    assert "text_config" not in json.loads((flat / "config.json").read_text())
    expected = vl.model.state_dict()
    for path in (flat, nested):
        cfg = load_model_config(path)
        assert cfg.text == vl.cfg.text and cfg.vision == vl.cfg.vision
        model = model_class(cfg)(cfg, torch.device("cpu"), torch.float32)
        model.load_weights(path)
        state = model.state_dict()
        assert state.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(state[name], tensor), name


def test_tied_embeddings_share_the_input_table(vl, tmp_path):
    path = _relayout(
        vl.path, tmp_path / "tied", flat_config=True, hf5_names=False, shards=1, tie=True
    )
    cfg = load_model_config(path)
    assert cfg.text.tie_word_embeddings
    model = model_class(cfg)(cfg, torch.device("cpu"), torch.float32)
    model.load_weights(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hidden = torch.randn(2, cfg.text.hidden_size)
    expected = hidden @ model.model.embed_tokens.weight.T
    torch.testing.assert_close(model.compute_logits(hidden), expected,
                               **tolerance_for(expected, cfg.text.hidden_size))


def test_missing_and_unknown_tensors_are_refused(vl, tmp_path):
    path = _relayout(vl.path, tmp_path / "broken", flat_config=False, hf5_names=False, shards=1)
    file = next(path.glob("*.safetensors"))
    tensors = load_file(file)
    k_bias = tensors.pop("model.layers.1.self_attn.k_proj.bias")
    save_file(tensors, file)
    model = model_class(vl.cfg)(vl.cfg, torch.device("cpu"), torch.float32)
    with pytest.raises(KeyError, match="k_proj|qkv_proj"):
        model.load_weights(path)
    tensors["model.layers.1.self_attn.k_proj.bias"] = k_bias
    tensors["model.extra.weight"] = torch.zeros(3)
    save_file(tensors, file)
    with pytest.raises(KeyError, match="model.extra.weight"):
        model.load_weights(path)


def test_generated_checkpoint_matches_hf(vl, make_paged_kv):
    """The project's generated checkpoint (unperturbed) through the same path."""
    cfg = load_model_config(vl.source)
    model = model_class(cfg)(cfg, torch.device("cpu"), torch.float32)
    model.load_weights(vl.source)
    hf = hf_class(cfg.architecture).from_pretrained(vl.source, dtype=torch.float32).eval()
    tiny = vl.with_model(model, hf)
    ids, grids = tiny.prompt([5, 6], (3, 4), [7, 8, 9])
    images = [tiny.pixels(grids[0], seed=4)]
    logits, _ = _prefill_logits(tiny, make_paged_kv(model), "a", ids, images, grids)
    expected = tiny.hf_logits(ids, images, grids)
    torch.testing.assert_close(logits, expected, **tiny.logits_tolerance(expected, ids, grids))


def test_bfloat16_follows_float32(vl, make_paged_kv):
    model = model_class(vl.cfg)(vl.cfg, torch.device("cpu"), torch.bfloat16)
    model.load_weights(vl.path)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    bf = vl.with_model(model)
    ids, grids = bf.prompt([5, 6], (2, 4), [7, 8])
    images = [bf.pixels(grids[0], seed=5)]
    logits, _ = _prefill_logits(bf, make_paged_kv(model), "a", ids, images, grids)
    expected = vl.hf_logits(ids, images, grids)
    assert logits.dtype == torch.bfloat16
    bound = vl.bf16_tolerance(expected, grids)
    torch.testing.assert_close(logits.float(), expected, **bound)
    # tiny random models have near-tied logits: bf16 rounding may flip those, and only those
    assert_argmax_differs_only_at_ties(logits, expected, bound)


def test_attention_layers_start_without_cache(vl):
    model = model_class(vl.cfg)(vl.cfg, torch.device("cpu"), torch.float32)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert len(layers) == vl.cfg.text.num_hidden_layers
    assert all(m.k_cache.numel() == 0 and m.v_cache.numel() == 0 for m in layers)


@pytest.mark.gpu
def test_cuda_matches_hf_on_cpu(vl, make_paged_kv):
    model = model_class(vl.cfg)(vl.cfg, torch.device("cuda"), torch.float32)
    model.load_weights(vl.path)
    gpu = vl.with_model(model)
    ids, grids = gpu.prompt([5, 6], (4, 6), [7, 8], (2, 2), [9])
    images = [gpu.pixels(g, seed=i) for i, g in enumerate(grids)]
    kv = make_paged_kv(model)
    logits, delta = _prefill_logits(gpu, kv, "a", ids, images, grids, chunks=[7])
    expected = vl.hf_logits(ids, images, grids)
    torch.testing.assert_close(logits.cpu(), expected, **vl.logits_tolerance(expected, ids, grids))
    embeds, pos = _decode_inputs(gpu, 11, len(ids), delta)
    step = model.compute_logits(kv.forward(model, [("a", embeds, pos)]))
    expected = vl.hf_logits(ids + [11], images, grids)[-1]
    torch.testing.assert_close(step.cpu()[0], expected,
                               **vl.logits_tolerance(expected, ids + [11], grids))
