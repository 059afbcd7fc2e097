"""Fetch, check and decode request videos; hand on only resized uint8 frames, one array per
temporal group of 2 frames (R6), like images (media_loader.py) and through the same pool.

    encoded = await videos.fetch(ref, sampling)  # bytes + what the header says, sized
    groups = await videos.decode(encoded)         # [ImageInput per group]; takes the bytes

A video is a container (data:video/*;base64, http(s)://, file://, decoded with PyAV: FFmpeg
inside the wheel) or vLLM's frame list (data:video/jpeg;base64,<jpeg>,<jpeg>,...: each
frame an image, the list cut to num_frames, `fps` of media_io_kwargs or 1 a second).

R4, before any frame is decoded: the header gives size, frame rate, length and codec; what
cannot fit (max_video_pixels, max_video_duration_s, max_video_decode_frames, the codec) is
refused then, with a 400 naming the limit, and `need_bytes` sizes the decode for admission.
The prompt (and so max_model_len) is checked from the same header (shared/video_layout.py).

Decoding is one sequential pass in a pool thread, one decoder thread: each sampled frame
is converted, oriented (the stream's rotation), resized and written into its group's
array, and dropped before the next is decoded; source-size frames never accumulate beyond
the decoder's own reference pool. The container (and its decoder threads) is closed before
the job returns, whatever happens.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from dataclasses import dataclass

import av
import numpy as np
from PIL import Image, UnidentifiedImageError

from api_proc.config import ApiConfig
from api_proc.errors import BadRequest
from api_proc.media_loader import (
    MediaLoader,
    MediaRef,
    data_url_media_type,
    decode_base64,
    too_large,
)
from shared.image_key import group_key, video_key
from shared.memory import release_freed_memory
from shared.messages import ImageInput
from shared.video_layout import VideoLayout, VideoSettings, sample_indices

PARAM = "video_url"
# decoders flatserve runs; anything else (an image labelled as video: png, mjpeg; raw or
# lossless intra codecs whose frames are huge) is refused by name
ALLOWED_CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "libdav1d", "libaom-av1",
                            "mpeg4", "mpeg2video", "mpeg1video"})
FRAME_LIST_TYPE = "video/jpeg"
DEFAULT_FRAME_LIST_FPS = 1.0  # vLLM's
DECODED_SIZES_KEPT = 4096  # about 100 bytes each
DECODER_REFERENCE_FRAMES = 16  # H.264's most; the decoder's pool holds these plus one
BYTES_PER_SOURCE_PIXEL = 1.5  # yuv420p, what decoders mostly hold


@dataclass(frozen=True)
class VideoSampling:
    """Frames to sample: `num_frames` uniformly, at most `fps` a second when given."""

    num_frames: int
    fps: float | None = None


@dataclass(frozen=True)
class VideoLimits:
    max_pixels: int
    max_duration_s: float
    max_decode_frames: int

    @classmethod
    def of(cls, config: ApiConfig) -> VideoLimits:
        return cls(config.max_video_pixels, config.max_video_duration_s,
                   config.max_video_decode_frames)


@dataclass
class EncodedVideo:
    """Encoded bytes of one video (a container, or a frame list's JPEGs) plus what its
    header says and what the model will make of it. `take()` moves the bytes out."""

    data: bytes | list[bytes] | None
    width: int  # a source frame's, as stored (rotation applies when decoded)
    height: int
    source_fps: float
    total_frames: int
    indices: list[int]  # the sampled frames, in order
    resized_hw: tuple[int, int]  # before rotation: 90 or 270 degrees swap it when decoded
    layout: VideoLayout
    nbytes: int
    key: bytes
    count_exact: bool = True  # the header states the frame count (else duration x fps)
    # (h, w) of the frames as decoded (after rotation) when this key was decoded before:
    # a video whose every group the engine holds is then neither decoded nor sent
    decoded_hw: tuple[int, int] | None = None
    patch_size: int = 14

    def take(self) -> bytes | list[bytes]:
        data, self.data = self.data, None
        if data is None:
            raise RuntimeError("video bytes already taken")
        return data

    @property
    def group_keys(self) -> list[bytes]:
        return [group_key(self.key, g) for g in range(self.layout.num_groups)]

    def held_by(self, engine) -> bool:
        """Whether `engine`'s encoder cache holds every group (its mirror says so) and the
        groups' decoded size is known: decoding is all or nothing."""
        return self.decoded_hw is not None and all(engine.holds_image(k)
                                                   for k in self.group_keys)

    def without_pixels(self) -> list[ImageInput]:
        """What a request sends for a video whose groups the engine's cache holds."""
        h, w = self.decoded_hw
        p = self.patch_size
        return [ImageInput(None, (1, h // p, w // p), key, video=True, temporal_pos=pos)
                for key, pos in zip(self.group_keys, self.layout.temporal_positions,
                                    strict=True)]

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        return self.layout.grid_thw

    @property
    def resized_bytes(self) -> int:
        """Bytes of the uint8 frames handed to the engine (every sampled frame)."""
        return len(self.indices) * self.resized_hw[0] * self.resized_hw[1] * 3

    @property
    def need_bytes(self) -> int:
        """Peak bytes while this video is decoded and resized, counted before decoding:
        the encoded bytes, the decoder's reference pool and the frame it is decoding,
        one source frame as RGB and as a PIL image, a rotated copy, the resize's output
        (PIL keeps RGB as 4 bytes a pixel) and every sampled frame at the model's size."""
        pixels = self.width * self.height
        decoder = int((DECODER_REFERENCE_FRAMES + 2) * pixels * BYTES_PER_SOURCE_PIXEL)
        source = pixels * (3 + 4 + 4)
        resized = self.resized_hw[0] * self.resized_hw[1] * 4 + self.resized_bytes
        return self.nbytes + decoder + source + resized


# ------------------------------------------------------------------ worker-pool jobs


def probe_video(data: bytes, limits: VideoLimits, settings: VideoSettings,
                sampling: VideoSampling) -> EncodedVideo:
    """Read the container header only (no frame is decoded) and size the video."""
    if not data:
        raise BadRequest("video is empty", param=PARAM, code="invalid_video")
    problem = None
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            streams = container.streams.video
            if not streams:
                problem = "video has no video stream (an audio-only file?)"
            else:
                header = _header(container, streams[0])
    except (av.FFmpegError, ValueError, OSError, UnicodeDecodeError) as e:
        problem = f"video data is not a supported container: {type(e).__name__}"
    if problem is not None:
        raise BadRequest(problem, param=PARAM, code="invalid_video")
    codec, width, height, fps, duration, total, exact = header
    if codec not in ALLOWED_CODECS:
        raise BadRequest(f"video codec {codec or 'unknown'} is not supported (supported: "
                         "h264, hevc, vp8, vp9, av1, mpeg4, mpeg2)", param=PARAM,
                         code="invalid_video")
    if width < 1 or height < 1:
        raise BadRequest("video frames have no pixels", param=PARAM, code="invalid_video")
    if width * height > limits.max_pixels:
        raise BadRequest(f"video frames are {width}x{height} = {width * height} pixels; "
                         f"max_video_pixels is {limits.max_pixels}", param=PARAM,
                         code="video_too_large")
    if not fps > 0 or total < 1:
        raise BadRequest("video header declares no frame rate or no frames", param=PARAM,
                         code="invalid_video")
    if duration > limits.max_duration_s:
        raise BadRequest(f"video is {duration:.1f} s long; max_video_duration_s is "
                         f"{limits.max_duration_s:g}", param=PARAM, code="video_too_large")
    if total > limits.max_decode_frames:
        raise BadRequest(f"video has {total} frames to decode; max_video_decode_frames is "
                         f"{limits.max_decode_frames}", param=PARAM, code="video_too_large")
    indices = sample_indices(total, fps, sampling.num_frames, sampling.fps)
    encoded = _encoded(data, width, height, fps, total, indices, settings, sampling, len(data))
    encoded.count_exact = exact
    return encoded


def _header(container, stream) -> tuple[str, int, int, float, float, int, bool]:
    """(codec, width, height, fps, seconds, frames, whether the container states the frame
    count); frames from duration x fps when it does not (as vLLM's PyAV reader)."""
    ctx = stream.codec_context
    fps = float(stream.average_rate or stream.guessed_rate or 0)
    if stream.duration and stream.time_base:
        duration = float(stream.duration * stream.time_base)
    else:
        duration = (container.duration or 0) / av.time_base
    total = int(stream.frames or 0)
    exact = total > 0
    if not exact and fps > 0:
        total = round(duration * fps)
    if duration <= 0 and fps > 0:
        duration = total / fps
    return ctx.name or "", int(ctx.width), int(ctx.height), fps, duration, total, exact


def split_frame_list(url: str, start: int, max_bytes: int) -> list[bytes]:
    """vLLM's frame list: comma-separated base64 JPEGs after the data URL's header."""
    if (len(url) - start) * 3 // 4 > max_bytes + 2:
        raise too_large("video", max_bytes)
    frames, total = [], 0
    for i, part in enumerate(url[start:].split(",")):
        frame = decode_base64(part, "video")
        if not frame:
            raise BadRequest(f"video frame {i} of the frame list is empty", param=PARAM,
                             code="invalid_video")
        total += len(frame)
        if total > max_bytes:
            raise too_large("video", max_bytes)
        frames.append(frame)
    return frames


def probe_frame_list(frames: list[bytes], max_pixels: int, settings: VideoSettings,
                     sampling: VideoSampling) -> EncodedVideo:
    """Headers of a frame list's JPEGs (no pixel decoded): cut to num_frames, every frame
    the same size."""
    frames = frames[: sampling.num_frames]
    size = None
    for i, frame in enumerate(frames):
        problem = None
        try:
            with Image.open(io.BytesIO(frame)) as img:
                fmt, this = img.format, img.size
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError,
                Image.DecompressionBombError):
            problem = f"video frame {i} of the frame list is not a JPEG image"
        if problem is None and fmt != "JPEG":
            problem = f"video frame {i} of the frame list is {fmt}, not JPEG"
        if problem is None and size is not None and this != size:
            problem = (f"video frame {i} of the frame list is {this[0]}x{this[1]}, frame 0 "
                       f"is {size[0]}x{size[1]}")
        if problem is not None:
            raise BadRequest(problem, param=PARAM, code="invalid_video")
        size = this
    width, height = size
    if width * height > max_pixels:
        raise BadRequest(f"video frames are {width}x{height} = {width * height} pixels; "
                         f"max_video_pixels is {max_pixels}", param=PARAM,
                         code="video_too_large")
    fps = sampling.fps or DEFAULT_FRAME_LIST_FPS
    nbytes = sum(len(f) for f in frames)
    return _encoded(frames, width, height, fps, len(frames), list(range(len(frames))),
                    settings, sampling, nbytes)


def _encoded(data, width, height, fps, total, indices, settings: VideoSettings,
             sampling: VideoSampling, nbytes: int) -> EncodedVideo:
    try:
        resized = settings.resized_size(height, width, len(indices))
    except ValueError as e:
        message = f"video of {width}x{height} cannot be resized for the model: {e}"
    else:
        message = None
    if message is not None:
        raise BadRequest(message, param=PARAM, code="invalid_video")
    layout = settings.layout(indices, fps, total, *resized)
    key = video_key(data, settings, indices, fps)
    return EncodedVideo(data=data, width=width, height=height, source_fps=fps,
                        total_frames=total, indices=indices, resized_hw=resized, layout=layout,
                        nbytes=nbytes, key=key, patch_size=settings.patch_size)


def decode_video(data: bytes | list[bytes], indices: list[int], resized_hw: tuple[int, int],
                 source_hw: tuple[int, int], temporal_patch: int,
                 slack: int = 0) -> list[np.ndarray]:
    """The sampled frames, resized, as one uint8 array [frames, H, W, 3] per temporal group
    (its own buffer: the engine frees each group once it is encoded). `slack`: how many
    frames short of the header's count the stream may end (a count estimated from the
    duration); sampled frames past its end repeat the last one decoded. Runs in a pool
    thread."""
    problem = None
    try:
        if isinstance(data, list):
            groups = _decode_frame_list(data, resized_hw, temporal_patch)
        else:
            groups = _decode_container(data, indices, resized_hw, source_hw, temporal_patch,
                                       slack)
    except _Refused as e:
        problem = str(e)
    except (av.FFmpegError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        problem = f"video cannot be decoded: {type(e).__name__}"
    data = None  # R1: an error raised below must not pin the encoded bytes in this frame
    if problem is not None:
        raise BadRequest(problem, param=PARAM, code="invalid_video")
    return groups


def _decode_then_trim(*args) -> list[np.ndarray]:
    """decode_video, then hand the memory FFmpeg freed back to the OS. Without it glibc
    keeps it: the API's RSS grew ~4 MB per 1,000 16-frame 448px clips (soak: +3.77 ± 0.63
    MB/1k) and 4.6 MB per 3,000 decodes in a loop, with Python's heap flat; trimmed, the
    loop stays flat. A trim costs about a millisecond next to ~100 ms of decoding."""
    try:
        return decode_video(*args)
    finally:
        release_freed_memory()


class _Refused(Exception):
    pass


def _group_arrays(count: int, hw: tuple[int, int], temporal_patch: int) -> list[np.ndarray]:
    return [np.empty((min(temporal_patch, count - g), *hw, 3), dtype=np.uint8)
            for g in range(0, count, temporal_patch)]


def _resize_into(img: Image.Image, out: np.ndarray) -> None:
    height, width = out.shape[:2]
    with img.resize((width, height), resample=Image.Resampling.BICUBIC) as resized:
        out[...] = np.asarray(resized, dtype=np.uint8)


_ROTATIONS = {90: Image.Transpose.ROTATE_90, 180: Image.Transpose.ROTATE_180,
              270: Image.Transpose.ROTATE_270}


def _decode_container(data: bytes, indices: list[int], resized_hw: tuple[int, int],
                      source_hw: tuple[int, int], temporal_patch: int,
                      slack: int) -> list[np.ndarray]:
    wanted = {index: k for k, index in enumerate(indices)}
    last = indices[-1]
    groups: list[np.ndarray] = []
    seen = 0
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1  # one decoder thread per pool worker
        for index, frame in enumerate(container.decode(stream)):
            seen = index + 1
            if (frame.height, frame.width) != source_hw:
                raise _Refused(f"video frame {index} is {frame.width}x{frame.height}; its "
                               f"header declares {source_hw[1]}x{source_hw[0]}")
            if not groups:  # the display rotation is known from the first frame on
                turn = int(frame.rotation or 0) % 360
                hw = resized_hw[::-1] if turn in (90, 270) else resized_hw
                groups = _group_arrays(len(indices), hw, temporal_patch)
            k = wanted.get(index)
            if k is not None:
                with frame.to_image() as img:
                    transpose = _ROTATIONS.get(int(frame.rotation or 0) % 360)
                    if transpose is None:
                        _resize_into(img, groups[k // temporal_patch][k % temporal_patch])
                    else:
                        with img.transpose(transpose) as oriented:
                            _resize_into(oriented, groups[k // temporal_patch][k % temporal_patch])
            frame = None  # the source frame goes before the next one is decoded
            if index >= last:
                break
    done = sum(1 for index in indices if index < seen)  # sampled frames written
    if seen <= last and (seen + slack <= last or done == 0):
        raise _Refused(f"video ended after {seen} frames; its header declares at least "
                       f"{last + 1} (a truncated file?)")
    for k in range(done, len(indices)):  # a duration-estimated count a frame or two long
        previous = groups[(k - 1) // temporal_patch][(k - 1) % temporal_patch]
        groups[k // temporal_patch][k % temporal_patch] = previous
    return groups


def _decode_frame_list(frames: list[bytes], resized_hw: tuple[int, int],
                       temporal_patch: int) -> list[np.ndarray]:
    groups = _group_arrays(len(frames), resized_hw, temporal_patch)
    for k, frame in enumerate(frames):
        try:
            with Image.open(io.BytesIO(frame)) as img:
                img.load()
                with img.convert("RGB") as rgb:
                    _resize_into(rgb, groups[k // temporal_patch][k % temporal_patch])
        except (OSError, ValueError, SyntaxError) as e:
            raise _Refused(f"video frame {k} of the frame list cannot be decoded: "
                           f"{type(e).__name__}") from None
    return groups


# ------------------------------------------------------------------ the loader


class VideoLoader:
    """Videos through a MediaLoader's fetching (same SSRF checks, own size and time
    limits) and its worker pool. Remembers the decoded frame size of the last
    DECODED_SIZES_KEPT videos (their rotation is known only once a frame is decoded), so a
    video sent again whose groups the engine's encoder cache holds need not be decoded."""

    def __init__(self, media: MediaLoader, settings: VideoSettings):
        self.media = media
        self.settings = settings
        self.limits = VideoLimits.of(media.config)
        self._decoded_hw: OrderedDict[bytes, tuple[int, int]] = OrderedDict()

    async def fetch(self, ref: MediaRef, sampling: VideoSampling) -> EncodedVideo:
        """Encoded bytes of the video `ref` names, with its header checked and sized."""
        url = ref.take()
        max_bytes = self.media.config.max_video_bytes
        if url[:5].lower() == "data:":
            media_type, start = data_url_media_type(url, "video")
            if media_type == FRAME_LIST_TYPE:
                frames = await self.media.run_in_pool(split_frame_list, url, start, max_bytes)
                url = None
                encoded = await self.media.run_in_pool(probe_frame_list, frames,
                                                self.limits.max_pixels, self.settings, sampling)
                frames = None
                encoded.decoded_hw = self._decoded_hw.get(encoded.key)
                return encoded
        data = await self.media.fetch_url(url, "video")
        url = None
        encoded = await self.media.run_in_pool(probe_video, data, self.limits, self.settings, sampling)
        data = None
        encoded.decoded_hw = self._decoded_hw.get(encoded.key)
        return encoded

    async def decode(self, video: EncodedVideo) -> list[ImageInput]:
        """One ImageInput per temporal group: frames [1 or 2, H, W, 3], grid (1, h, w), the
        group's key and temporal position; moves the encoded bytes out of `video` (R1)."""
        settings = self.settings
        slack = 0 if video.count_exact else max(2, video.total_frames // 100)
        groups = await self.media.run_in_pool(
            _decode_then_trim, video.take(), video.indices, video.resized_hw,
            (video.height, video.width), settings.temporal_patch_size, slack)
        p = settings.patch_size
        positions = video.layout.temporal_positions
        inputs = [ImageInput(g, (1, g.shape[1] // p, g.shape[2] // p),
                             group_key(video.key, i), video=True, temporal_pos=positions[i])
                  for i, g in enumerate(groups)]
        if groups:
            self._remember(video.key, groups[0].shape[1:3])
        groups = None
        return inputs

    def _remember(self, key: bytes, hw: tuple[int, int]) -> None:
        self._decoded_hw[key] = tuple(int(v) for v in hw)
        self._decoded_hw.move_to_end(key)
        while len(self._decoded_hw) > DECODED_SIZES_KEPT:  # R4: bounded
            self._decoded_hw.popitem(last=False)
