"""Our Qwen3-VL (dense and MoE) against transformers' on the same perturbed weights, fp32 on
the CPU: image patches, vision tower and DeepStack features, prefill logits (text, one
image, two images), paged decode, chunked prefill splitting an image, checkpoint layouts."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from engine_proc.context import reset_context, set_context
from engine_proc.image_processor import pixels_to_patches
from engine_proc.layers.attention import Attention
from engine_proc.models.qwen3_vl import Qwen3VLForConditionalGeneration
from shared.image_resize import resize_image
from shared.model_config import load_model_config
from shared.random_checkpoints import TINY_QWEN3_VL, TINY_QWEN3_VL_MOE, write_checkpoint
from tests.engine_proc.conftest import PagedKV, VLHarness
from tests.engine_proc.qwen3_vl_checkpoints import SHAPES, hf_class, perturbed_checkpoint
from tests.tolerance import assert_argmax_differs_only_at_ties, tolerance, tolerance_for

pytestmark = pytest.mark.numeric

# per shape: (one image grid, two grids of different sizes), sides multiples of the merge
GRIDS = {
    "dense": ((1, 8, 12), ((1, 10, 14), (1, 6, 4))),
    "dense-b": ((1, 9, 12), ((1, 6, 15), (1, 3, 9))),
    "moe": ((1, 6, 9), ((1, 12, 6), (1, 3, 6))),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def q3(request, tmp_path_factory) -> VLHarness:
    preset = SHAPES[request.param]
    path = perturbed_checkpoint(preset, tmp_path_factory)
    cfg = load_model_config(path)
    model = Qwen3VLForConditionalGeneration(cfg, torch.device("cpu"), torch.float32)
    model.load_weights(path)
    hf = hf_class(preset).from_pretrained(path, dtype=torch.float32)
    harness = VLHarness(path, model, hf.eval())
    harness.shape = request.param
    yield harness
    for layer in model.modules():
        if isinstance(layer, Attention):
            layer.k_cache = torch.tensor([])
            layer.v_cache = torch.tensor([])


@pytest.fixture
def kv(q3) -> PagedKV:
    return PagedKV(q3.model)


def _embeds(h: VLHarness, ids, images, grids) -> tuple[torch.Tensor, torch.Tensor]:
    """Token embeddings with image rows written, and the DeepStack rows [T, k * hidden]."""
    ids = torch.tensor(ids, device=h.model.device)
    x = h.model.embed_tokens(ids)
    deepstack = x.new_zeros(x.shape[0], len(h.cfg.vision.deepstack_visual_indexes) * x.shape[1])
    if images:
        rows = ids == h.cfg.image_token_id
        encoded = torch.cat(h.model.encode_images(images, grids))
        x[rows] = encoded[:, : x.shape[1]]
        deepstack[rows] = encoded[:, x.shape[1] :]
    return x, deepstack


def _forward(kv: PagedKV, model, spans) -> torch.Tensor:
    """spans: (key, embeds, positions, deepstack or None) -> hidden [T, H]."""
    kv.activate()
    set_context(kv.context([(key, e.shape[0]) for key, e, _, _ in spans]))
    try:
        deepstack = [d for *_, d in spans]
        kwargs = {}
        if any(d is not None for d in deepstack):
            kwargs["deepstack"] = torch.cat([
                d if d is not None else e.new_zeros(e.shape[0], deepstack_width(model))
                for (_, e, _, _), d in zip(spans, deepstack, strict=True)
            ])
        return model(torch.cat([e for _, e, _, _ in spans]),
                     torch.cat([p for _, _, p, _ in spans], dim=1), **kwargs)
    finally:
        reset_context()


def deepstack_width(model) -> int:
    return len(model.config.vision.deepstack_visual_indexes) * model.config.text.hidden_size


def _prefill_logits(h, kv, key, ids, images, grids, chunks=None):
    embeds, deepstack = _embeds(h, ids, images, grids)
    positions, delta = h.positions(ids, grids)
    bounds = [0, *(chunks or []), len(ids)]
    hidden = [
        _forward(kv, h.model, [(key, embeds[a:b], positions[:, a:b],
                                deepstack[a:b] if images else None)])
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return h.model.compute_logits(torch.cat(hidden)), delta


def _patches(h, grids, seed=0):
    images = [h.pixels(g, seed=seed + i) for i, g in enumerate(grids)]
    patches = torch.cat(
        [pixels_to_patches(px, g, h.cfg.image) for px, g in zip(images, grids, strict=True)])
    return images, patches


# ---- preprocessing and vision ------------------------------------------------------------


@pytest.mark.parametrize("width,height", [(640, 480), (97, 300), (1, 1), (2100, 900)])
def test_patches_equal_the_hf_processor(q3, width, height):
    from transformers import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(width)
    img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    expected = Qwen2VLImageProcessorPil.from_pretrained(q3.path)(images=img, return_tensors="np")
    pixels, grid = resize_image(img, q3.cfg.image)
    assert grid == tuple(int(v) for v in expected["image_grid_thw"][0])
    patches = pixels_to_patches(torch.from_numpy(pixels), grid, q3.cfg.image)
    # a table lookup computed with transformers' arithmetic (image_processor.py): no sums
    np.testing.assert_array_equal(patches.numpy(), expected["pixel_values"])


def test_vision_tower_and_deepstack_match_hf(q3):
    one, two = GRIDS[q3.shape]
    grids = [one, *two]
    images, patches = _patches(q3, grids)
    with torch.no_grad():
        out = q3.hf.model.visual(patches, grid_thw=torch.tensor(grids))
    ours = q3.model.visual(patches, tuple(grids))
    width = q3.cfg.text.hidden_size
    expected = [out.pooler_output, *out.deepstack_features]
    assert ours.shape == (out.pooler_output.shape[0], width * len(expected))
    for i, feature in enumerate(expected):
        torch.testing.assert_close(ours[:, i * width : (i + 1) * width], feature,
                                   **q3.vision_tolerance(feature, grids))
    split = q3.model.encode_images(images, grids)
    unit = q3.cfg.vision.spatial_merge_size**2
    assert [e.shape[0] for e in split] == [t * h * w // unit for t, h, w in grids]
    # one image's rows at a time take other GEMM blockings than the whole batch's
    torch.testing.assert_close(torch.cat(split), ours, **q3.vision_tolerance(ours, grids))
    for e in split:  # R3: each image its own storage
        assert e.untyped_storage().nbytes() == e.numel() * e.element_size()


def test_staged_encoding_equals_one_forward(q3):
    """Stage by stage, the DeepStack block outputs ride along with the hidden states."""
    grid = GRIDS[q3.shape][0]
    images, _ = _patches(q3, [grid], seed=5)
    model = q3.model
    assert model.num_vision_stages == min(4, q3.cfg.vision.depth) > 1
    hidden = model.embed_patches(images[0], grid)
    for stage in range(model.num_vision_stages):
        hidden = model.encode_stage(hidden, grid, stage)
    whole = model.encode_images(images, [grid])[0]
    torch.testing.assert_close(hidden, whole, **q3.vision_tolerance(whole, [grid]))


# ---- decoder --------------------------------------------------------------------------


def test_text_only_prefill_matches_hf(q3, kv):
    ids, grids = q3.prompt(list(range(10, 47)))
    logits, delta = _prefill_logits(q3, kv, "a", ids, [], grids)
    assert delta == 0
    expected = q3.hf_logits(ids, [], grids)
    torch.testing.assert_close(logits, expected, **q3.logits_tolerance(expected, ids, grids))


def test_one_image_prefill_matches_hf(q3, kv):
    ids, grids = q3.prompt([5, 6, 7], GRIDS[q3.shape][0], [8, 9, 10, 11])
    images = [q3.pixels(grids[0], seed=1)]
    logits, _ = _prefill_logits(q3, kv, "a", ids, images, grids)
    expected = q3.hf_logits(ids, images, grids)
    torch.testing.assert_close(logits, expected, **q3.logits_tolerance(expected, ids, grids))


def test_two_images_of_different_sizes_match_hf(q3, kv):
    first, second = GRIDS[q3.shape][1]
    ids, grids = q3.prompt([5, 6], first, [7, 8, 9], second, [10, 11])
    images = [q3.pixels(g, seed=i) for i, g in enumerate(grids)]
    logits, _ = _prefill_logits(q3, kv, "a", ids, images, grids)
    expected = q3.hf_logits(ids, images, grids)
    torch.testing.assert_close(logits, expected, **q3.logits_tolerance(expected, ids, grids))


def test_decode_steps_through_paged_cache_match_hf(q3, kv):
    ids, grids = q3.prompt([5, 6, 7], GRIDS[q3.shape][0], [8, 9])
    images = [q3.pixels(grids[0], seed=2)]
    logits, delta = _prefill_logits(q3, kv, "a", ids, images, grids)
    token = int(logits[-1].argmax())
    for _ in range(4):
        ids = ids + [token]
        embeds = q3.model.embed_tokens(torch.tensor([token]))
        pos = torch.full((3, 1), len(ids) - 1 + delta, dtype=torch.int64)
        step = q3.model.compute_logits(_forward(kv, q3.model, [("a", embeds, pos, None)]))[0]
        expected = q3.hf_logits(ids, images, grids)[-1]
        torch.testing.assert_close(step, expected, **q3.logits_tolerance(expected, ids, grids))
        token = int(step.argmax())


def test_chunked_prefill_splitting_an_image_matches_hf(q3, kv):
    """Chunk ends inside the image: its embeddings and DeepStack rows split with it."""
    ids, grids = q3.prompt([5, 6, 7], GRIDS[q3.shape][0], [8, 9, 10])
    images = [q3.pixels(grids[0], seed=3)]
    count = ids.count(q3.cfg.image_token_id)  # placeholders at 4 .. 4 + count
    chunks = [4 + count // 3, 4 + 2 * count // 3]
    assert 4 < chunks[0] < chunks[1] < 4 + count
    logits, _ = _prefill_logits(q3, kv, "a", ids, images, grids, chunks=chunks)
    expected = q3.hf_logits(ids, images, grids)
    torch.testing.assert_close(logits, expected, **q3.logits_tolerance(expected, ids, grids))


def test_a_text_decode_batched_with_an_image_chunk_equals_each_alone(q3):
    """DeepStack rows of an image chunk leave a decode in the same flat batch untouched."""
    txt, _ = q3.prompt(list(range(30, 41)))
    img, grids = q3.prompt([5, 6, 7], GRIDS[q3.shape][0], [8, 9])
    images = [q3.pixels(grids[0], seed=4)]
    emb, ds = _embeds(q3, img, images, grids)
    pos, _ = q3.positions(img, grids)
    temb, tpos = q3.model.embed_tokens(torch.tensor(txt)), q3.positions(txt, [])[0]
    dec = ("txt", q3.model.embed_tokens(torch.tensor([77])), torch.full((3, 1), len(txt)), None)
    chunk = ("img", emb[6:], pos[:, 6:], ds[6:])
    results = []
    for batched in (False, True):
        kv = PagedKV(q3.model)
        _forward(kv, q3.model, [("txt", temb, tpos, None)])
        _forward(kv, q3.model, [("img", emb[:6], pos[:, :6], ds[:6])])
        if batched:
            results.append(list(_forward(kv, q3.model, [dec, chunk]).split([1, emb.shape[0] - 6])))
        else:
            results.append([_forward(kv, q3.model, [span]) for span in (dec, chunk)])
    # together, each span's rows sit in other GEMM blockings and attention paths than alone
    tokens = max(len(txt) + 1, len(img))
    for alone, together in zip(*results, strict=True):
        torch.testing.assert_close(together, alone, **q3.hidden_tolerance(alone, tokens))


def test_bfloat16_follows_float32(q3):
    model = Qwen3VLForConditionalGeneration(q3.cfg, torch.device("cpu"), torch.bfloat16)
    model.load_weights(q3.path)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    bf = q3.with_model(model)
    ids, grids = bf.prompt([5, 6], GRIDS[q3.shape][0], [7, 8])
    images = [bf.pixels(grids[0], seed=5)]
    logits, _ = _prefill_logits(bf, PagedKV(model), "a", ids, images, grids)
    assert logits.dtype == torch.bfloat16
    # against transformers in bf16 too: a router near-tie can pick other experts in bf16
    # than in fp32 (0.36 off fp32 on one MoE row, for both implementations alike)
    hf = hf_class(SHAPES[q3.shape]).from_pretrained(q3.path, dtype=torch.bfloat16).eval()
    expected = q3.with_model(model, hf).hf_logits(ids, images, grids)
    bound = q3.bf16_tolerance(expected, grids)
    torch.testing.assert_close(logits.float(), expected.float(), **bound)
    # near-tied logits (exact ties, in bf16) may flip, and only those
    assert_argmax_differs_only_at_ties(logits, expected, bound)


@pytest.mark.gpu
def test_cuda_matches_hf_on_cpu(q3):
    model = Qwen3VLForConditionalGeneration(q3.cfg, torch.device("cuda"), torch.float32)
    model.load_weights(q3.path)
    gpu = q3.with_model(model)
    first, second = GRIDS[q3.shape][1]
    ids, grids = gpu.prompt([5, 6], first, [7, 8], second, [9])
    images = [gpu.pixels(g, seed=i) for i, g in enumerate(grids)]
    kv = PagedKV(model)
    logits, delta = _prefill_logits(gpu, kv, "a", ids, images, grids, chunks=[7])
    expected = q3.hf_logits(ids, images, grids)
    torch.testing.assert_close(logits.cpu(), expected, **q3.logits_tolerance(expected, ids, grids))
    embeds = model.embed_tokens(torch.tensor([11], device="cuda"))
    pos = torch.full((3, 1), len(ids) + delta, dtype=torch.int64, device="cuda")
    step = model.compute_logits(_forward(kv, model, [("a", embeds, pos, None)]))
    expected = q3.hf_logits(ids + [11], images, grids)[-1]
    torch.testing.assert_close(step.cpu()[0], expected,
                               **q3.logits_tolerance(expected, ids + [11], grids))


# ---- checkpoints ------------------------------------------------------------------------


def test_missing_and_unknown_tensors_are_refused(q3, tmp_path):
    state = load_file(str(q3.path / "model.safetensors"))
    for name in ("config.json", "preprocessor_config.json"):
        (tmp_path / name).write_bytes((q3.path / name).read_bytes())
    model = Qwen3VLForConditionalGeneration(q3.cfg, torch.device("cpu"), torch.float32)
    missing = {k: v for k, v in state.items() if "deepstack_merger_list.1.norm.bias" not in k}
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="deepstack_merger_list.1.norm.bias"):
        model.load_weights(tmp_path)
    save_file({**state, "model.visual.extra.weight": torch.zeros(2)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="model.visual.extra.weight"):
        model.load_weights(tmp_path)


def test_published_expert_layout_loads_the_same(q3, tmp_path):
    """Published Qwen3-VL-MoE checkpoints store fused experts transposed per expert
    (gate_up_proj [E, hidden, 2 * inter], down_proj [E, inter, hidden])."""
    if q3.shape != "moe":
        pytest.skip("dense model")
    state = load_file(str(q3.path / "model.safetensors"))
    experts = [k for k in state if ".mlp.experts." in k]
    assert experts
    published = {k: v.transpose(1, 2).contiguous() if k in experts else v
                 for k, v in state.items()}
    save_file(published, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_bytes((q3.path / "config.json").read_bytes())
    model = Qwen3VLForConditionalGeneration(q3.cfg, torch.device("cpu"), torch.float32)
    model.load_weights(tmp_path)
    ours = dict(q3.model.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, ours[name]), name


@pytest.mark.parametrize("preset", [TINY_QWEN3_VL, TINY_QWEN3_VL_MOE], ids=lambda p: p.name)
def test_presets_load_in_flatserve_and_transformers(preset, tmp_path):
    import transformers

    from shared.random_checkpoints import PRESETS

    assert PRESETS[preset.name] is preset
    folder = write_checkpoint(tmp_path / "m", preset)
    cfg = load_model_config(folder)
    assert (cfg.architecture, cfg.text, cfg.vision) == (preset.architecture, preset.text,
                                                        preset.vision)
    image = cfg.image
    assert (image.patch_size, image.merge_size, image.image_mean) == (16, 2, (0.5, 0.5, 0.5))
    model = Qwen3VLForConditionalGeneration(cfg, torch.device("cpu"), torch.float32)
    model.load_weights(folder)  # raises on a missing or unexpected tensor
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 1e7
    hf, info = getattr(transformers, preset.architecture).from_pretrained(
        folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert torch.equal(hf.model.visual.pos_embed.weight, model.visual.pos_embed.weight)


@pytest.mark.parametrize("path", ["grouped", "looped"])
@pytest.mark.parametrize("num_tokens", [0, 1, 3, 40])
def test_sparse_moe_block_matches_hf(num_tokens, path, monkeypatch):
    """Routing, renormalized top-k weights and the expert sums, for batches where some
    experts get no token (or none does), through the grouped GEMM and the expert loop."""
    from engine_proc.models import qwen3_moe

    monkeypatch.setattr(qwen3_moe, "can_group", lambda x, width: path == "grouped")
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import (
        Qwen3VLMoeTextConfig,
    )
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
        Qwen3VLMoeTextSparseMoeBlock,
    )

    from engine_proc.models.qwen3_moe import SparseMoeBlock

    t = TINY_QWEN3_VL_MOE.text
    torch.manual_seed(0)
    hf = Qwen3VLMoeTextSparseMoeBlock(Qwen3VLMoeTextConfig(
        hidden_size=t.hidden_size, num_experts=6, num_experts_per_tok=3,
        moe_intermediate_size=t.moe_intermediate_size))
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.1)
    ours = SparseMoeBlock(replace(t, num_experts=6, num_experts_per_tok=3))
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(1, num_tokens, t.hidden_size)
    with torch.no_grad():
        expected = hf(x)[0]
        # router, softmax over experts, top-k weights, an expert's gate_up and down, their sum
        terms = 2 * t.hidden_size + 6 + 2 * 3 + t.moe_intermediate_size
        torch.testing.assert_close(ours(x[0]), expected, **tolerance_for(expected, terms))


@pytest.mark.parametrize("section", [(24, 20, 20), (10, 7, 7), (6, 5, 5)])
def test_interleaved_mrope_tables_match_hf(section):
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from engine_proc.layers.rotary_embedding import MRotaryEmbedding

    head_dim = 2 * sum(section)
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": list(section),
            "mrope_interleaved": True}
    hf = Qwen3VLTextRotaryEmbedding(Qwen3VLTextConfig(
        head_dim=head_dim, max_position_embeddings=4096, rope_parameters=rope))
    ours = MRotaryEmbedding(head_dim, 4096, 5e6, section, torch.device("cpu"), torch.float32,
                            interleaved=True)
    positions = torch.randint(0, 4096, (3, 50), generator=torch.Generator().manual_seed(0))
    cos, sin = hf(torch.zeros(1), positions[:, None, :])
    ours_cos, ours_sin = ours(positions)
    # the same float32 angles (one product each), then cos / sin, vectorized or scalar by
    # where a value falls (each within an ulp): no sums, a couple of roundings of values <= 1
    bound = tolerance(torch.float32, 1, depth=2, scale=1.0)
    torch.testing.assert_close(ours_cos, cos[0, :, : head_dim // 2], **bound)
    torch.testing.assert_close(ours_sin, sin[0, :, : head_dim // 2], **bound)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_tokens", [0, 1, 3, 300])
def test_grouped_experts_on_cuda_bf16_equal_the_loop(num_tokens):
    """The path a GPU serves MoE with (grouped GEMMs in bfloat16) against the expert loop."""
    from engine_proc.models import qwen3_moe

    t = replace(TINY_QWEN3_VL_MOE.text, hidden_size=256, moe_intermediate_size=128,
                num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    block = qwen3_moe.SparseMoeBlock(t).cuda().to(torch.bfloat16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(num_tokens, t.hidden_size, device="cuda", dtype=torch.bfloat16)
    probs = torch.softmax(block.gate(x).float(), dim=-1)
    weights, experts = torch.topk(probs, t.num_experts_per_tok, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
    with torch.no_grad():
        looped = block.experts.looped(x, experts, weights)
        if not qwen3_moe.can_group(x, t.moe_intermediate_size):
            pytest.skip("this GPU serves MoE through the loop")
        grouped = block.experts.grouped(x, experts, weights)
    # bf16 outputs of gate_up, the activation, its product, down, the weighting and the sum
    # over experts, each rounded once (accumulation in fp32), at other points on each side
    bound = tolerance_for(looped, 1, depth=6)
    torch.testing.assert_close(grouped.float(), looped.float(), **bound)


def test_deepstack_taps_listed_out_of_block_order_match_hf(tmp_path_factory):
    """Feature i comes from the i-th tapped block in block order, through the merger listed
    with that block, whatever order the config lists the taps in."""
    preset = replace(TINY_QWEN3_VL, name="tiny-qwen3-vl-unsorted-taps",
                     vision=replace(TINY_QWEN3_VL.vision, deepstack_visual_indexes=(3, 1)))
    path = perturbed_checkpoint(preset, tmp_path_factory)
    model = Qwen3VLForConditionalGeneration(load_model_config(path), torch.device("cpu"),
                                            torch.float32)
    model.load_weights(path)
    hf = hf_class(preset).from_pretrained(path, dtype=torch.float32).eval()
    grid = (1, 8, 12)
    pixels = torch.randint(0, 256, (8 * 16, 12 * 16, 3), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(3))
    patches = pixels_to_patches(pixels, grid, model.config.image)
    with torch.no_grad():
        out = hf.model.visual(patches, grid_thw=torch.tensor([grid]))
        ours = model.visual(patches, (grid,))
    width = model.config.text.hidden_size
    harness = VLHarness(path, model, hf)
    for i, feature in enumerate([out.pooler_output, *out.deepstack_features]):
        torch.testing.assert_close(ours[:, i * width : (i + 1) * width], feature,
                                   **harness.vision_tolerance(feature, [grid]))
