import weakref

import numpy as np
import torch

from engine_proc.sequence import ImageSpan, Sequence
from shared.sampling_params import SamplingParams


def test_counters_follow_tokens():
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=4))
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_completion_tokens) == (3, 3, 0)
    seq.num_computed_tokens = 3
    seq.append_token(9)
    assert seq.num_uncomputed_tokens == 1 and seq.last_token_id == 9
    assert seq.completion_token_ids == [9] and seq.num_computed_tokens == 3
    assert not seq.has_images and seq.mm_bytes == 0


def test_images_account_bytes_and_release_drops_every_reference():
    pixels = np.zeros((28, 56, 3), np.uint8)
    pixels_ref = weakref.ref(pixels)
    a = ImageSpan(pixels, (1, 2, 4), offset=1, length=2)
    b = ImageSpan(np.zeros((28, 28, 3), np.uint8), (1, 2, 2), offset=4, length=1)
    del pixels
    seq = Sequence("r", [0, 5, 5, 0, 5, 0], SamplingParams(), [a, b])
    assert seq.mm_bytes == 28 * 56 * 3 + 28 * 28 * 3
    a.embeds = torch.zeros(2, 8)
    embeds_ref = weakref.ref(a.embeds)
    a.pixels = None
    assert seq.mm_bytes == 2 * 8 * 4 + 28 * 28 * 3
    seq.num_computed_tokens = 3  # a (tokens 1..2) is in the cache, b (token 4) is not
    seq.release_consumed_images()
    assert a.released and not b.released
    assert pixels_ref() is None and embeds_ref() is None
    seq.release_multimodal()
    assert b.released and seq.mm_bytes == 0
