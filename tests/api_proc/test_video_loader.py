"""The video pool jobs and their admission: sampling, sizing from the header, one-pass
decoding into one buffer per temporal group, rotation, and the byte budget counted before
any frame is decoded."""

from __future__ import annotations

import numpy as np
import pytest

import api_proc.video_loader as video_loader
from api_proc.video_loader import (
    DECODER_REFERENCE_FRAMES,
    VideoLimits,
    VideoSampling,
    decode_video,
    probe_video,
)
from shared.model_config import load_model_config
from shared.video_layout import VideoSettings, sample_indices
from tests.api_proc.test_app import assert_error, chat
from tests.api_proc.test_video_input import video_content
from tests.video.clips import data_url, decoded_frames, make_clip

LIMITS = VideoLimits(max_pixels=10**7, max_duration_s=600, max_decode_frames=10_000)


@pytest.fixture(scope="module")
def settings(tiny_model_path):
    return VideoSettings.of(load_model_config(tiny_model_path))


def test_sampling_is_vllms_uniform_rule():
    assert sample_indices(100, 30.0, 4) == np.linspace(0, 99, 4, dtype=int).tolist() == [0, 33, 66, 99]
    assert sample_indices(5, 30.0, 32) == [0, 1, 2, 3, 4]  # a short clip: every frame
    # fps: at most 2 frames a second of a 10 s clip, within num_frames
    assert len(sample_indices(300, 30.0, 32, fps=2)) == 20
    assert len(sample_indices(300, 30.0, 8, fps=2)) == 8
    assert sample_indices(300, 30.0, 32, fps=0.01) == [0, 299]  # at least one group


def test_qwen2_frames_are_capped_below_the_image_bound(settings):
    assert settings.max_pixels == 768 * 28 * 28
    h, w = settings.resized_size(1080, 1920, 32)
    assert h * w <= 768 * 28 * 28 and h % 28 == 0 and w % 28 == 0


def test_need_bytes_counts_every_sampled_frame_before_decoding(settings):
    clip = make_clip(9, 96, 64)
    encoded = probe_video(clip, LIMITS, settings, VideoSampling(32))
    assert encoded.indices == list(range(9)) and encoded.resized_hw == (56, 84)
    resized = 9 * 56 * 84 * 3
    assert encoded.resized_bytes == resized
    pixels = 96 * 64
    decoder = int((DECODER_REFERENCE_FRAMES + 2) * pixels * 1.5)
    assert encoded.need_bytes == len(clip) + decoder + pixels * 11 + 56 * 84 * 4 + resized
    groups = decode_video(encoded.take(), encoded.indices, encoded.resized_hw,
                          (encoded.height, encoded.width), 2)
    assert [g.shape for g in groups] == [(2, 56, 84, 3)] * 4 + [(1, 56, 84, 3)]
    assert sum(g.nbytes for g in groups) == encoded.resized_bytes
    # one buffer per group: freeing one frees its bytes, whatever the others do (R3)
    assert all(g.base is None for g in groups)
    assert not any(np.shares_memory(a, b) for a in groups for b in groups if a is not b)


def test_only_sampled_frames_come_out_and_in_order(settings):
    clip = make_clip(12, 96, 64)
    encoded = probe_video(clip, LIMITS, settings, VideoSampling(4))
    assert encoded.indices == [0, 3, 7, 11]
    groups = decode_video(encoded.take(), encoded.indices, encoded.resized_hw,
                          (encoded.height, encoded.width), 2)
    frames = np.concatenate(groups)
    # the red channel carries the frame index (tests/video/clips.py): 37 a frame
    red = frames[:, 30:, 40:, 0].mean(axis=(1, 2))
    assert np.allclose(red, [0, 111, 259 % 256, 407 % 256], atol=18)  # neighbours: 37 away


def test_rotation_metadata_is_honoured(settings):
    plain = make_clip(4, 96, 64)
    turned = make_clip(4, 96, 64, rotation=90)
    encoded = probe_video(turned, LIMITS, settings, VideoSampling(4))
    groups = decode_video(encoded.take(), encoded.indices, encoded.resized_hw,
                          (encoded.height, encoded.width), 2)
    assert groups[0].shape == (2, 84, 56, 3)  # portrait now
    upright = decoded_frames(plain)[0]
    # the white mark of the top-left corner is at the bottom-left after a quarter turn
    # counter-clockwise (what a player shows for a display matrix of 90 degrees)
    assert upright[:8, :12].min() > 200
    frame = groups[0][0]
    assert frame[-10:, :6].min() > 180 and frame[:10, :6].max() < 250


def test_over_budget_is_413_before_any_frame_is_decoded(start_app, engine_double, monkeypatch):
    calls = []
    real = video_loader.decode_video
    monkeypatch.setattr(video_loader, "decode_video",
                        lambda *a: calls.append(1) or real(*a))
    clip = make_clip(8, 96, 64)
    server = start_app(engine_double, mm_inflight_budget=100_000)
    before = len(engine_double.log()["requests"])
    error = assert_error(chat(server, video_content(data_url(clip))), 413,
                         match="mm_inflight_budget")
    assert error.code == "mm_budget_too_small"
    assert calls == [] and len(engine_double.log()["requests"]) == before
    roomy = start_app(engine_double, mm_inflight_budget=2_000_000)
    assert chat(roomy, video_content(data_url(clip))).status_code == 200
    assert calls == [1]


def test_a_prompt_over_max_model_len_is_400_before_any_frame_is_decoded(start_app, engine_double,
                                                                        monkeypatch):
    calls = []
    monkeypatch.setattr(video_loader, "decode_video", lambda *a: calls.append(1))
    server = start_app(engine_double, max_model_len=48)
    error = assert_error(chat(server, video_content(data_url(make_clip(12, 96, 64)))), 400,
                         match="max_model_len is 48")
    assert error.code == "context_length_exceeded" and calls == []


def test_a_count_estimated_from_the_duration_may_be_a_frame_long(settings):
    """Containers without a frame count (WebM, MKV) are counted as duration x fps; a stream
    a frame shorter than that repeats its last sampled frame instead of failing, and only
    then: an exact count, or a stream far shorter, is refused."""
    clip = make_clip(7, 96, 64, container="matroska")
    encoded = probe_video(clip, LIMITS, settings, VideoSampling(32))
    assert not encoded.count_exact and encoded.total_frames == 7
    hw, source = encoded.resized_hw, (64, 96)
    groups = decode_video(clip, [0, 2, 4, 7], hw, source, 2, slack=2)
    assert np.array_equal(groups[1][1], groups[1][0])
    with pytest.raises(Exception, match="video ended after 7 frames"):
        decode_video(clip, [0, 2, 4, 7], hw, source, 2, slack=0)
    with pytest.raises(Exception, match="video ended after 7 frames"):
        decode_video(clip, [0, 2, 4, 12], hw, source, 2, slack=2)
