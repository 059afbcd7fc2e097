"""Video parts through the HTTP app against the engine test double: every request form, the
limits and flags, and bad input answered with a clear 4xx that leaves the server serving and
nothing behind (file descriptors, threads)."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from tests.api_proc.conftest import encode_image
from tests.api_proc.test_app import assert_error, chat
from tests.video.clips import data_url, frame_list_url, frame_pixels, jpeg, make_clip

TINY_GROUP_TOKENS = 6  # a 96x64 frame on the tiny Qwen2.5-VL: 56x84 px, 4x6 patches, 2x3 merged


def video_content(url: str, text: str = "what happens?"):
    return [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}]


def last_request(double) -> dict:
    return double.log()["requests"][-1]


@pytest.fixture(scope="module")
def clip():
    return make_clip(7, 96, 64, fps=4)


@pytest.fixture
def server(start_app, engine_double, tmp_path):
    return start_app(engine_double, allowed_local_media_path=str(tmp_path),
                     allow_private_media_addresses=True,
                     limit_mm_per_prompt=(2, 1))


def test_data_url_becomes_one_input_per_temporal_group(server, engine_double, clip):
    r = chat(server, video_content(data_url(clip)))
    assert r.status_code == 200, r.text
    request = last_request(engine_double)
    # 7 frames: 3 groups of 2 and one of the last frame alone
    assert request["shapes"] == [[2, 56, 84, 3]] * 3 + [[1, 56, 84, 3]]
    assert request["grids"] == [[1, 4, 6]] * 4
    assert request["video"] == [True] * 4
    # Qwen2.5-VL: tokens_per_second 4 x 2 frames / 4 fps = 2 positions a group
    assert request["temporal_pos"] == [0, 2, 4, 6]
    assert request["num_video_tokens"] == 4 * TINY_GROUP_TOKENS


def test_frame_list_file_and_http_forms(server, engine_double, clip, tmp_path, http_server):
    frames = [jpeg(frame_pixels(i, 96, 64)) for i in range(5)]
    r = chat(server, video_content(frame_list_url(frames)))
    assert r.status_code == 200, r.text
    assert last_request(engine_double)["shapes"] == [[2, 56, 84, 3]] * 2 + [[1, 56, 84, 3]]
    # frame lists run at 1 frame a second unless media_io_kwargs says: 2 / 1 x 4 tokens/s
    assert last_request(engine_double)["temporal_pos"] == [0, 8, 16]

    path = tmp_path / "clip.mp4"
    path.write_bytes(clip)
    r = chat(server, video_content(f"file://{path}"))
    assert r.status_code == 200, r.text
    assert len(last_request(engine_double)["shapes"]) == 4
    outside = tmp_path.parent / "outside.mp4"
    outside.write_bytes(clip)
    assert_error(chat(server, video_content(f"file://{outside}")), 400,
                 match="video file is outside allowed_local_media_path")

    url = http_server.serve_bytes("/clip.mp4", clip, "video/mp4")
    r = chat(server, video_content(url))
    assert r.status_code == 200, r.text
    assert len(last_request(engine_double)["shapes"]) == 4


def test_video_beside_images_and_the_count_limits(server, engine_double, clip):
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                   + __import__("base64").b64encode(
                                                       encode_image()).decode()}},
               *video_content(data_url(clip))]
    r = chat(server, content)
    assert r.status_code == 200, r.text
    request = last_request(engine_double)
    assert request["video"] == [False] + [True] * 4
    two = video_content(data_url(clip)) + video_content(data_url(clip))
    error = assert_error(chat(server, two), 400, match="limit_mm_per_prompt video=1")
    assert error.code == "too_many_videos"


def test_media_io_kwargs_per_request_and_server(server, start_app, engine_double, clip):
    r = chat(server, video_content(data_url(clip)), media_io_kwargs={"video": {"num_frames": 4}})
    assert r.status_code == 200, r.text
    assert len(last_request(engine_double)["shapes"]) == 2
    # fps: at most 2 frames a second of a 1.75 s clip -> 3 frames
    r = chat(server, video_content(data_url(clip)), media_io_kwargs={"video": {"fps": 2}})
    assert r.status_code == 200, r.text
    assert [s[0] for s in last_request(engine_double)["shapes"]] == [2, 1]
    assert_error(chat(server, video_content(data_url(clip)),
                      media_io_kwargs={"video": {"num_frames": 65}}), 400,
                 match="max_video_frames=64")
    assert_error(chat(server, video_content(data_url(clip)),
                      media_io_kwargs={"video": {"frames": 4}}), 400, match="unknown setting 'frames'")
    assert_error(chat(server, video_content(data_url(clip)),
                      media_io_kwargs={"image": {"x": 1}}), 400, match="'image' takes no settings")

    sparse = start_app(engine_double, media_io_kwargs='{"video": {"num_frames": 2}}')
    r = chat(sparse, video_content(data_url(clip)))
    assert r.status_code == 200, r.text
    assert last_request(engine_double)["shapes"] == [[2, 56, 84, 3]]


def test_uuid_is_refused_by_name(server, clip):
    part = {"type": "video_url", "video_url": {"url": data_url(clip)}, "uuid": "mine"}
    assert_error(chat(server, [part]), 400, match="uuid")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settled(count, at_most: int | None = None, timeout: float = 3.0) -> int:
    """count() once it stops falling (or reaches at_most), within `timeout`."""
    deadline = time.monotonic() + timeout
    value = count()
    while time.monotonic() < deadline and (at_most is None or value > at_most):
        time.sleep(0.1)
        again = count()
        if at_most is None and again >= value:
            return again
        value = again
    return value


def _threads() -> tuple[set[str], int]:
    """Python threads by name, and every thread of the process (FFmpeg's own included)."""
    return {t.name for t in threading.enumerate()}, len(os.listdir("/proc/self/task"))


def test_bad_videos_get_a_clear_4xx_and_leave_nothing_behind(start_app, engine_double, clip,
                                                            tmp_path):
    server = start_app(engine_double, max_video_pixels=96 * 64, max_video_duration_s=5,
                       max_video_decode_frames=40, max_video_bytes=200_000)
    faststart = make_clip(16, 96, 64, fps=4, container="matroska")
    frames = [jpeg(frame_pixels(i, 96, 64)) for i in range(3)]
    cases = [
        (data_url(clip[: len(clip) // 2]), "not a supported container"),  # moov atom lost
        (data_url(faststart[: len(faststart) * 2 // 3], "video/x-matroska"),
         "video ended after"),
        (data_url(encode_image(), "video/mp4"), "video codec png is not supported"),
        ("data:video/mp4;base64,", "video is empty"),
        (data_url(make_clip(audio_only=True)), "has no video stream"),
        (data_url(make_clip(4, codec="ffv1", container="matroska")),
         "video codec ffv1 is not supported"),
        (data_url(make_clip(4, 128, 64)), "max_video_pixels is 6144"),
        (data_url(make_clip(48, fps=12)), "max_video_decode_frames is 40"),
        (data_url(make_clip(30, fps=5)), "max_video_duration_s is 5"),
        (data_url(b"\0" * 300_000), "max_video_bytes=200000"),
        (frame_list_url([frames[0], b"not a jpeg", frames[2]]),
         "video frame 1 of the frame list is not a JPEG"),
        (frame_list_url([frames[0], frames[1][: len(frames[1]) // 2], frames[2]]),
         "video frame 1 of the frame list cannot be decoded"),
        (frame_list_url([frames[0], jpeg(frame_pixels(1, 64, 64))]),
         "video frame 1 of the frame list is 64x64"),
        (data_url(clip, "image/png"), "is not a video"),
    ]

    def send_all():
        for url, says in cases:
            r = chat(server, video_content(url))
            assert 400 <= r.status_code < 500, (says, r.text)
            assert says in r.json()["error"]["message"], (says, r.json()["error"]["message"])
        r = chat(server, video_content(data_url(clip)))
        assert r.status_code == 200, r.text  # still serving

    send_all()  # a first round may open what lives on (pool threads, libraries' files)
    fds, threads = _settled(_open_fds), _threads()
    for _ in range(2):
        send_all()
    # the server closes its side of the last connection a moment after the client did
    assert _settled(_open_fds, fds) <= fds
    names, count = _threads()
    assert names <= threads[0] and count <= threads[1]
    assert httpx.get(server.url + "/health").status_code == 200
