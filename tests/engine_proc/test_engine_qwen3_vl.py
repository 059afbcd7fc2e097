"""LLMEngine on Qwen3-VL checkpoints (dense and MoE): greedy tokens identical to
transformers' `generate` (fp32, CPU) for text, an image, chunked prefill across an image
and staged encoding; R3 with DeepStack: an image's embeddings, DeepStack columns included,
die right after the step that ran its last chunk."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

from engine_proc.image_processor import pixels_to_patches
from shared.messages import AddRequest, ImageInput
from shared.model_config import ModelConfig, load_model_config
from shared.sampling_params import SamplingParams
from tests.engine_proc.engine_factory import make_engine
from tests.engine_proc.qwen3_vl_checkpoints import SHAPES, hf_class, perturbed_checkpoint

MAX_TOKENS = 10
# per shape: a small and a large image (pixels), sides multiples of patch * merge
SIZES = {"dense": ((64, 96), (160, 224)), "dense-b": ((84, 126), (168, 252)),
         "moe": ((84, 126), (168, 252))}


class Checkpoint:
    def __init__(self, shape: str, tmp_path_factory) -> None:
        self.shape = shape
        self.path = perturbed_checkpoint(SHAPES[shape], tmp_path_factory)
        self.cfg: ModelConfig = load_model_config(self.path)
        self.hf = hf_class(SHAPES[shape]).from_pretrained(self.path, dtype=torch.float32).eval()
        self.cache: dict = {}

    def prompt(self, segments: list, seed: int = 0) -> tuple[list[int], list[ImageInput]]:
        """segments: ints (that many text tokens) and image indexes into SIZES as ("img", i)."""
        rng = np.random.default_rng(seed)
        ids: list[int] = []
        images: list[ImageInput] = []
        p, m = self.cfg.vision.patch_size, self.cfg.vision.spatial_merge_size
        for seg in segments:
            if isinstance(seg, int):
                ids += rng.integers(10, 3900, seg).tolist()
                continue
            h, w = SIZES[self.shape][seg[1]]
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            images.append(ImageInput(pixels, (1, h // p, w // p)))
            ids += ([self.cfg.vision_start_token_id]
                    + [self.cfg.image_token_id] * ((h // p) * (w // p) // (m * m))
                    + [self.cfg.vision_end_token_id])
        return ids, images

    def request(self, rid: str, segments: list, seed: int = 0, **sampling) -> AddRequest:
        ids, images = self.prompt(segments, seed)
        sampling.setdefault("max_tokens", MAX_TOKENS)
        sampling.setdefault("temperature", 0.0)
        return AddRequest(rid, ids, SamplingParams(**sampling), images)

    def greedy(self, segments: list, seed: int = 0) -> list[int]:
        key = (repr(segments), seed)
        if key not in self.cache:
            ids, images = self.prompt(segments, seed)
            input_ids = torch.tensor([ids])
            kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                          mm_token_type_ids=(input_ids == self.cfg.image_token_id).int())
            if images:  # the engine's patches equal the processor's (test_model_qwen3_vl)
                kwargs["pixel_values"] = torch.cat([
                    pixels_to_patches(torch.from_numpy(im.pixels), im.grid_thw, self.cfg.image)
                    for im in images])
                kwargs["image_grid_thw"] = torch.tensor([list(im.grid_thw) for im in images])
            with torch.no_grad():
                out = self.hf.generate(**kwargs, max_new_tokens=MAX_TOKENS, do_sample=False)
            self.cache[key] = out[0, len(ids) :].tolist()
        return self.cache[key]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def ckpt(request, tmp_path_factory) -> Checkpoint:
    return Checkpoint(request.param, tmp_path_factory)


TEXT = [17]
ONE_IMAGE = [5, ("img", 0), 9]
BIG_IMAGE = [5, ("img", 1), 7]


@pytest.mark.parametrize("segments", [TEXT, ONE_IMAGE], ids=["text", "one_image"])
def test_greedy_matches_transformers(ckpt, segments):
    engine = make_engine(ckpt.path)
    out = engine.generate([ckpt.request("a", segments)])
    assert out["a"] == ckpt.greedy(segments)
    assert engine.stats().num_kv_blocks_free == engine.stats().num_kv_blocks_total


def test_chunked_prefill_and_staged_encoding_match_transformers(ckpt):
    """16-token steps split the big image's placeholders (and DeepStack rows) over several
    chunks; a 16-patch encoder budget encodes it in the tower's stages first."""
    engine = make_engine(ckpt.path, max_num_batched_tokens=16, max_num_seqs=4,
                         max_num_encoder_patches=16, encoder_stage_patches=16)
    model = engine.model_runner.model
    assert model.num_vision_stages == 4
    stages = []
    encode_stage = model.encode_stage
    model.encode_stage = lambda hidden, grid, stage: stages.append(stage) or encode_stage(
        hidden, grid, stage)
    requests = [ckpt.request("big", BIG_IMAGE), ckpt.request("small", ONE_IMAGE, 1)]
    out = engine.generate(requests)
    assert sorted(stages) == [0, 0, 1, 1, 2, 2, 3, 3]  # both images are over the budget
    assert len(out["big"]) > 1
    assert out["big"] == ckpt.greedy(BIG_IMAGE)
    assert out["small"] == ckpt.greedy(ONE_IMAGE, 1)
    assert engine.stats().mm_bytes_held == 0


def test_embeddings_with_deepstack_die_after_the_last_chunk_covering_the_image(ckpt):
    # the encoder cache off: it would hold them by design (test_encoder_cache_engine.py)
    engine = make_engine(ckpt.path, max_num_batched_tokens=16, max_num_seqs=2,
                         encoder_cache_bytes=0)
    engine.add_request(ckpt.request("a", BIG_IMAGE, max_tokens=4, ignore_eos=True))
    seq = engine.seqs["a"]
    (image,) = seq.images
    assert image.end - image.offset > 16  # the image spans at least two chunks
    embeds_ref = None
    while seq.num_computed_tokens < image.end:
        engine.step()
        if embeds_ref is None and image.embeds is not None:
            k = len(ckpt.cfg.vision.deepstack_visual_indexes)
            assert image.embeds.shape[1] == ckpt.cfg.text.hidden_size * (1 + k)
            embeds_ref = weakref.ref(image.embeds)
        if seq.num_computed_tokens < image.end:
            assert embeds_ref is not None and embeds_ref() is not None
    assert embeds_ref() is None, "embeddings outlived the chunk that consumed them"
    assert engine.stats().mm_bytes_held == 0
    while engine.has_unfinished_requests():
        engine.step()
