"""R1/R5 on the video path: a weakref to the payload at every hop (the base64 string, the
encoded video, each temporal group's ImageInput and frames, the AddRequest) and each must be
collected, by reference counting alone (the garbage collector is off), once the next stage
holds it: in the loader, at the engine client's send (groups are 4-D arrays sent zero-copy),
and across the whole app before the engine has answered anything. The engine side (each
group's pixels freed once encoded, its embeddings once consumed) is in
tests/engine_proc/test_video_engine.py."""

from __future__ import annotations

import asyncio
import json
import time
import tracemalloc
import weakref

import numpy as np
import pytest

import api_proc.serving as serving_module
from api_proc.engine_client import EngineClient
from api_proc.media_loader import MediaLoader, MediaRef
from api_proc.video_loader import VideoLoader, VideoSampling
from shared.messages import AddRequest, ImageInput
from shared.model_config import load_model_config
from shared.sampling_params import SamplingParams
from shared.video_layout import VideoSettings
from tests.api_proc.test_payload_lifetime import (
    WeakStr,
    _big_blocks,
    _open_stream_bytes,
    _rest,
    wait_collected,
    wait_collected_async,
)
from tests.video.clips import data_url, make_clip

pytestmark = pytest.mark.usefixtures("no_garbage_collector")


@pytest.fixture
def videos(make_config, image_config, tiny_model_path):
    """videos(**config) -> a VideoLoader (the test closes its MediaLoader)."""
    def make(**kw) -> VideoLoader:
        media = MediaLoader(make_config(**kw), image_config)
        return VideoLoader(media, VideoSettings.of(load_model_config(tiny_model_path)))
    return make


async def test_video_loader_drops_every_hop(videos):
    loader = videos()
    try:
        url = WeakStr(data_url(make_clip(5, 96, 64)))
        refs = [("base64 url", weakref.ref(url))]
        ref = MediaRef(url, "video")
        del url
        encoded = await loader.fetch(ref, VideoSampling(32))
        await wait_collected_async(refs)  # the string is gone once its bytes are decoded
        refs.append(("encoded video", weakref.ref(encoded)))
        groups = await loader.decode(encoded)
        assert encoded.data is None
        del encoded
        refs += [(f"group {i}", weakref.ref(g)) for i, g in enumerate(groups)]
        refs += [(f"frames {i}", weakref.ref(g.pixels)) for i, g in enumerate(groups)]
        del groups
        await wait_collected_async(refs)  # the loader itself keeps nothing
    finally:
        await loader.media.aclose()


async def test_video_loader_errors_do_not_pin_the_payload(videos):
    loader = videos(max_video_duration_s=0.5)
    try:
        for clip in (make_clip(8, 96, 64), make_clip(8, 96, 64)[:3000]):
            url = WeakStr(data_url(clip))
            refs = [("base64 url", weakref.ref(url))]
            with pytest.raises(Exception, match="max_video_duration_s|video"):
                await loader.fetch(MediaRef(url, "video"), VideoSampling(32))
            del url
            await wait_collected_async(refs)
    finally:
        await loader.media.aclose()


def _video_request(tiny_model_path, text: str) -> AddRequest:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))
    video_id = tok.token_to_id("<|video_pad|>")
    frames = np.random.default_rng(0).integers(0, 256, (3, 448, 448, 3), dtype=np.uint8)
    groups = [ImageInput(np.ascontiguousarray(frames[g:g + 2]), (1, 32, 32), video=True,
                         temporal_pos=g // 2) for g in (0, 2)]
    ids = tok.encode(text).ids + [video_id] * (2 * 16 * 16)
    return AddRequest("req-" + str(time.monotonic_ns()), ids, SamplingParams(max_tokens=20),
                      groups)


async def test_engine_client_drops_video_groups_at_the_send(engine_double, tiny_model_path):
    client = EngineClient.connect([engine_double.address])
    await client.start()
    try:
        request = _video_request(tiny_model_path, "[[gated]] a video")
        rid = request.request_id
        request_refs = [("add request", weakref.ref(request))] + [
            (f"group {i}", weakref.ref(g)) for i, g in enumerate(request.images)]
        frame_refs = [(f"frames {i}", weakref.ref(g.pixels))
                      for i, g in enumerate(request.images)]
        stream = client.submit(request)
        del request
        await asyncio.sleep(0)
        wait_collected(request_refs, timeout=0)
        await wait_collected_async(frame_refs, timeout=1.0)  # zmq lets go once they are out
        deadline = time.monotonic() + 3
        while rid not in engine_double.log()["running"]:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        logged = next(r for r in engine_double.log()["requests"] if r["id"] == rid)
        assert logged["shapes"] == [[2, 448, 448, 3], [1, 448, 448, 3]]
        assert logged["video"] == [True, True] and logged["temporal_pos"] == [0, 1]
        assert engine_double.open_gate() >= 1
        outputs = [out async for out in stream]
        assert outputs[-1].finish_reason == "stop"
    finally:
        await client.close()


class RecordingVideoLoader(VideoLoader):
    """Keeps weakrefs to what it produces."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.refs: list = []
        self.pixel_bytes: list[int] = []

    async def fetch(self, ref, sampling):
        encoded = await super().fetch(ref, sampling)
        self.refs.append(("encoded video", weakref.ref(encoded)))
        return encoded

    async def decode(self, video):
        result = await super().decode(video)
        for i, group in enumerate(result):
            self.refs += [(f"group {i}", weakref.ref(group)),
                          (f"frames {i}", weakref.ref(group.pixels))]
            self.pixel_bytes.append(group.nbytes)
        return result


def test_streaming_video_request_holds_no_payload_after_handoff(start_app, engine_double,
                                                                monkeypatch):
    refs: list = []

    class WeakRef(MediaRef):
        __slots__ = ()

        def __init__(self, url, kind="image"):
            url = WeakStr(url)
            refs.append(("base64 url", weakref.ref(url)))
            super().__init__(url, kind)

    monkeypatch.setattr(serving_module, "MediaRef", WeakRef)
    monkeypatch.setattr(serving_module, "VideoLoader", RecordingVideoLoader)
    server = start_app(engine_double, max_video_pixels=2048 * 2048)
    loader = server.app.state.serving.videos
    admission = server.app.state.admission
    # noise at 640x480 does not compress: about 1.5 MB of video, 2 MB of base64
    clip = make_clip(8, 640, 480, fps=4)
    payload = json.dumps({"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": data_url(clip)}},
        {"type": "text", "text": "[[gated]] keep streaming"}]}], "stream": True,
        "max_tokens": 50}).encode()
    del clip
    tracemalloc.start()
    try:
        client, cm, lines, first = _open_stream_bytes(server, payload)
        all_refs = refs + loader.refs
        assert len([r for r in all_refs if r[0].startswith("frames")]) == 4
        wait_collected(all_refs, timeout=1.0)
        big = _big_blocks(tracemalloc.take_snapshot())
        assert big == [], [str(t.traceback) for t in big]
        # the engine holds it and has answered nothing: it holds the frames' bytes (R4)
        assert admission.in_flight_bytes == sum(loader.pixel_bytes) > 0
        assert engine_double.open_gate() >= 1
        rest = _rest(lines)
        assert rest[-1] == "data: [DONE]"
        assert admission.in_flight_bytes == 0
    finally:
        tracemalloc.stop()
        cm.__exit__(None, None, None)
        client.close()
