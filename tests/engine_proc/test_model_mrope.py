"""mRoPE positions against transformers' get_rope_index, for every family case (images in
merge units)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_proc.models.mrope import compute_mrope_positions


def _ours(vl, ids, grids):
    c = vl.cfg
    return compute_mrope_positions(
        ids, grids, c.image_token_id, c.vision_start_token_id, c.vision.spatial_merge_size
    )


def _hf(vl, ids, grids):
    input_ids = torch.tensor([ids])
    positions, delta = vl.hf.model.get_rope_index(
        input_ids,
        (input_ids == vl.cfg.image_token_id).int(),
        image_grid_thw=torch.tensor(grids) if grids else None,
    )
    return positions[:, 0].numpy(), int(delta)


LAYOUTS = [
    ([5, 6, 7], (4, 4), [8, 9]),
    ((2, 6), [8, 9, 10]),  # image first
    ([5, 6], (7, 3)),  # image last, taller than wide
    ([5], (3, 5), [7, 8, 9], (2, 2), [10, 11]),  # two images
    ([5], (2, 2), (4, 2), [6]),  # two images back to back
    ([5], (1, 1), [6]),  # one merged token
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_positions_match_hf_get_rope_index(vl, layout):
    ids, grids = vl.prompt(*layout)
    positions, delta = _ours(vl, ids, grids)
    expected, expected_delta = _hf(vl, ids, grids)
    assert positions.dtype == np.int64 and positions.shape == (3, len(ids))
    np.testing.assert_array_equal(positions, expected)
    assert delta == expected_delta


def test_decode_positions_continue_with_delta(vl):
    ids, grids = vl.prompt([5, 6], (4, 6), [7])
    _, delta = _ours(vl, ids, grids)
    longer = ids + [20, 21, 22]
    full, _ = _hf(vl, longer, grids)
    for index in range(len(ids), len(longer)):
        assert (full[:, index] == index + delta).all()


def test_text_only_is_arange(vl):
    ids = list(range(40, 60))
    positions, delta = _ours(vl, np.asarray(ids), [])
    assert delta == 0
    np.testing.assert_array_equal(positions, np.broadcast_to(np.arange(20), (3, 20)))
    positions, delta = _ours(vl, [], [])
    assert positions.shape == (3, 0) and delta == 0


def test_mismatched_grids_are_refused(vl):
    ids, grids = vl.prompt([5], (2, 2), [6])
    with pytest.raises(ValueError, match="grids"):
        _ours(vl, ids, grids + [vl.grid(2, 2)])
    with pytest.raises(ValueError, match="placeholder"):
        _ours(vl, ids, [vl.grid(4, 4)])
