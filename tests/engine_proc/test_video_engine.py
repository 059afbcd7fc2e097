"""Videos through LLMEngine: greedy tokens identical to transformers' own model (fp32, CPU) on
the same tiny random weights, for every family, with the frames sent the way the API sends
them (one ImageInput per temporal group of 2 frames); the 2-frame patchify equals
transformers' video patchify; each group's pixels go once it is encoded and its embeddings
once the chunk that covers it has run (R3 per group); the encoder cache keys groups."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from engine_proc.image_processor import normalize_table, pixels_to_patches
from shared.messages import AddRequest, ImageInput
from shared.model_config import load_model_config
from shared.random_checkpoints import (
    TINY,
    TINY_QWEN2_VL,
    TINY_QWEN3_5,
    TINY_QWEN3_VL,
    TINY_QWEN3_VL_MOE,
    ensure_checkpoint,
)
from shared.sampling_params import SamplingParams
from shared.video_layout import VideoSettings
from tests.engine_proc.conftest import hf_class
from tests.engine_proc.engine_factory import make_engine

MAX_TOKENS = 8
FAMILIES = [TINY, TINY_QWEN2_VL, TINY_QWEN3_VL, TINY_QWEN3_VL_MOE, TINY_QWEN3_5]
SOURCE_FPS = 8.0  # one position a group on Qwen2.5-VL (4 tokens/s x 2 frames / 8 fps)


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda p: p.name)
def family(request):
    path = ensure_checkpoint(request.param)
    config = load_model_config(path)
    hf = hf_class(config.architecture).from_pretrained(str(path), dtype=torch.float32).eval()
    return path, config, hf


def frames(config, num_frames: int, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 frames [F, H, W, 3] of rows x cols merge units."""
    f = config.image.factor
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (num_frames, rows * f, cols * f, 3), dtype=np.uint8)


def video_inputs(config, video: np.ndarray, layout) -> list[ImageInput]:
    p = config.vision.patch_size
    return [ImageInput(np.ascontiguousarray(video[g:g + 2]),
                       (1, video.shape[1] // p, video.shape[2] // p), video=True,
                       temporal_pos=layout.temporal_positions[g // 2])
            for g in range(0, len(video), 2)]


def video_ids(config, layout, tokenizer) -> list[int]:
    """What a template's `<|vision_start|><|video_pad|><|vision_end|>` becomes."""
    vs, ve, pad = config.vision_start_token_id, config.vision_end_token_id, config.video_token_id
    if not layout.timestamps:
        return [vs] + [pad] * layout.num_tokens + [ve]
    ids = [vs]
    for stamp in layout.timestamps:
        ids += tokenizer.encode(stamp, add_special_tokens=False).ids
        ids += [vs] + [pad] * layout.group_tokens + [ve]
    return ids + [ve]


def hf_video_patches(config, video: np.ndarray) -> torch.Tensor:
    """transformers' own video patchify (Qwen3VLVideoProcessor.patchify, which pads the last
    group by repeating the last frame) on the normalized frames."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    cfg = config.image
    table = normalize_table(cfg, torch.device("cpu")).view(3, 256)
    values = torch.stack([table[c][torch.from_numpy(video[..., c]).long()] for c in range(3)],
                         dim=1)  # [F, C, H, W]
    patches, *_ = Qwen3VLVideoProcessor.patchify(
        None, values[None], cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    return patches[0]


def hf_greedy(hf, config, ids: list[int], video: np.ndarray, layout, indices) -> list[int]:
    input_ids = torch.tensor([ids])
    kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                  mm_token_type_ids=(input_ids == config.video_token_id).int() * 2,
                  pixel_values_videos=hf_video_patches(config, video),
                  video_grid_thw=torch.tensor([list(layout.grid_thw)]))
    if config.model_type == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = torch.tensor([2 / SOURCE_FPS])
    with torch.no_grad():
        out = hf.generate(**kwargs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


def test_two_frame_patchify_equals_transformers(family):
    _, config, _ = family
    video = frames(config, 5, 2, 3, seed=1)
    p = config.vision.patch_size
    grid = (1, video.shape[1] // p, video.shape[2] // p)
    ours = torch.cat([pixels_to_patches(torch.from_numpy(video[g:g + 2]), grid, config.image)
                      for g in range(0, 5, 2)])
    assert torch.equal(ours, hf_video_patches(config, video))


@pytest.mark.parametrize("num_frames, rows, cols", [(6, 2, 3), (5, 3, 2), (4, 5, 6)])
def test_video_greedy_tokens_equal_transformers(family, num_frames, rows, cols):
    path, config, hf = family
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    video = frames(config, num_frames, rows, cols, seed=num_frames)
    indices = list(range(num_frames))
    settings = VideoSettings.of(config)
    layout = settings.layout(indices, SOURCE_FPS, num_frames, video.shape[1], video.shape[2])
    rng = np.random.default_rng(0)
    ids = rng.integers(10, 3900, 5).tolist() + video_ids(config, layout, tokenizer) \
        + rng.integers(10, 3900, 4).tolist()
    want = hf_greedy(hf, config, ids, video, layout, indices)
    for chunk in (512, 7):  # whole prefill, and chunks that end inside groups
        engine = make_engine(path, max_num_batched_tokens=chunk, max_num_seqs=2)
        request = AddRequest("v", ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                             video_inputs(config, video, layout))
        assert engine.generate([request])["v"] == want


def test_qwen3_timestamps_follow_transformers():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    config = load_model_config(ensure_checkpoint(TINY_QWEN3_VL))
    settings = VideoSettings.of(config)
    for indices, fps in (([0, 3, 7, 10, 14], 30.0), ([0, 1, 2, 3], 4.0), ([2, 9, 40, 41], 7.5)):
        layout = settings.layout(indices, fps, 100, 64, 64)
        stamps = Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)
        assert layout.timestamps == tuple(f"<{t:.1f} seconds>" for t in stamps)


def test_each_group_is_freed_once_encoded_and_consumed():
    """R3 per group: with chunks smaller than a group, a group's pixels are gone once it is
    encoded and its embeddings once the chunk covering its last token has run, while later
    groups are still waiting."""
    path = ensure_checkpoint(TINY)
    config = load_model_config(path)
    engine = make_engine(path, max_num_batched_tokens=4, max_num_seqs=2, enable_prefix_caching=False,
                         encoder_cache_bytes=0)
    video = frames(config, 6, 2, 3, seed=3)
    settings = VideoSettings.of(config)
    layout = settings.layout(list(range(6)), SOURCE_FPS, 6, video.shape[1], video.shape[2])
    groups = video_inputs(config, video, layout)
    pixel_refs = [weakref.ref(g.pixels) for g in groups]
    ids = [11, 12] + video_ids(config, layout, None) + [13]
    engine.add_request(AddRequest("v", ids, SamplingParams(max_tokens=2, temperature=0.0),
                                  groups))
    del groups
    gc.collect()
    seq = engine.scheduler.waiting[0] if engine.scheduler.waiting else engine.scheduler.running[0]
    spans = list(seq.images)
    embed_refs: list = [None] * len(spans)
    seen_partial = False
    while engine.has_unfinished_requests():
        engine.step()
        gc.collect()
        for i, span in enumerate(spans):
            if span.embeds is not None and embed_refs[i] is None:
                embed_refs[i] = weakref.ref(span.embeds)
            if span.end <= seq.num_computed_tokens:
                assert span.released, f"group {i} kept after its last token ran"
        alive = [r() is not None for r in pixel_refs]
        if any(alive) and not all(alive):
            seen_partial = True  # some groups freed while others still wait
    assert seen_partial
    assert all(r() is None for r in pixel_refs)
    assert all(r is not None and r() is None for r in embed_refs)


def test_encoder_cache_keys_groups():
    """A video sent again (same group keys) skips the vision tower for every group."""
    path = ensure_checkpoint(TINY_QWEN2_VL)
    config = load_model_config(path)
    engine = make_engine(path)
    video = frames(config, 4, 2, 2, seed=5)
    settings = VideoSettings.of(config)
    layout = settings.layout(list(range(4)), SOURCE_FPS, 4, video.shape[1], video.shape[2])
    ids = [11] + video_ids(config, layout, None) + [12]

    def request(rid):
        groups = video_inputs(config, video, layout)
        for g, group in enumerate(groups):
            group.key = b"k" + bytes([g])
        return AddRequest(rid, ids, SamplingParams(max_tokens=4, temperature=0.0), groups)

    first = engine.generate([request("a")])["a"]
    hits = engine.encoder_cache.num_hits
    assert engine.generate([request("b")])["b"] == first
    assert engine.encoder_cache.num_hits - hits == 2


def _prompt(path, config, num_frames, rows, cols, fps):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    video = frames(config, num_frames, rows, cols, seed=1)
    layout = VideoSettings.of(config).layout(list(range(num_frames)), fps, num_frames,
                                             video.shape[1], video.shape[2])
    ids = [11, 12, 13] + video_ids(config, layout, tokenizer) + [14, 15]
    return ids, video, layout


@pytest.mark.parametrize("num_frames, fps", [(6, SOURCE_FPS), (4, 2.0), (9, 12.0)])
def test_video_positions_equal_transformers(family, num_frames, fps):
    """The mRoPE positions of a prompt with a video, tokens after it included, against
    transformers' get_rope_index, where its rule for text after a video agrees with the
    original one (the groups' temporal positions stay within the frame's rows and columns);
    test_text_after_a_long_video pins where they part."""
    path, config, hf = family
    ids, video, layout = _prompt(path, config, num_frames, 4, 5, fps)
    engine = make_engine(path, max_num_seqs=2)
    engine.add_request(AddRequest("p", ids, SamplingParams(max_tokens=1),
                                  video_inputs(config, video, layout)))
    seq = engine.scheduler.waiting[0]
    input_ids = torch.tensor([ids])
    kwargs = {}
    if config.model_type == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = torch.tensor([2 / fps])
    want, want_delta = hf.model.get_rope_index(
        input_ids, (input_ids == config.video_token_id).int() * 2,
        video_grid_thw=torch.tensor([list(layout.grid_thw)]),
        attention_mask=torch.ones_like(input_ids), **kwargs)
    assert max(layout.temporal_positions) < 5  # within 4 x 5 merge units: both rules agree
    assert seq.mrope_positions.tolist() == want[:, 0].tolist()
    assert seq.mrope_delta == int(want_delta)


def test_text_after_a_long_video():
    """Qwen2.5-VL: group g of a video at 1 frame a second sits at temporal position
    start + g x 4 x 2 (tokens_per_second 4, 2 s a group), and the text after the video
    resumes at the largest position of the video + 1 (the original Qwen rule and vLLM's;
    transformers 5.24 would resume at start + max(rows, cols))."""
    path = ensure_checkpoint(TINY)
    config = load_model_config(path)
    ids, video, layout = _prompt(path, config, 6, 2, 3, 1.0)
    assert layout.temporal_positions == (0, 8, 16)
    engine = make_engine(path, max_num_seqs=2)
    engine.add_request(AddRequest("p", ids, SamplingParams(max_tokens=1),
                                  video_inputs(config, video, layout)))
    pos = engine.scheduler.waiting[0].mrope_positions
    start = 4  # three text tokens and vision_start
    video_tokens = slice(start, start + layout.num_tokens)
    assert pos[0, video_tokens].tolist() == [start + t for t in (0, 8, 16) for _ in range(6)]
    assert pos[1, video_tokens].tolist() == [start + r for _ in range(3) for r in (0, 0, 0, 1, 1, 1)]
    assert pos[2, video_tokens].tolist() == [start + c for _ in range(3) for c in (0, 1, 2) * 2]
    after = start + layout.num_tokens  # vision_end, then the text
    assert pos[:, after].tolist() == [start + 17] * 3
    assert pos[:, after + 1].tolist() == [start + 18] * 3
