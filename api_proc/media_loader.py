"""Fetch, check and decode request images; hand on only resized uint8 pixels + grid (R6).

Two steps so admission can size a request before any pixel is decoded (R4):

    encoded = await loader.fetch(ref)      # bytes + what the header says (w x h, grid)
    image = await loader.decode(encoded)   # ImageInput; takes encoded.data

Sources: data URLs (base64), http(s) URLs (public addresses only unless allowed, optional
host allowlist, redirects re-checked, DNS answer pinned for the connection, streamed with a
size cap) and file:// URLs under `allowed_local_media_path` (none by default).

Base64 decoding, header probing, decoding and resizing run in a thread pool, never on the
event loop. Threads, not processes: PIL releases the GIL while it decodes and resizes, and a
process pool pickles the encoded bytes there and the pixels back (two more copies per image,
plus a second process's RSS). Measured on the 2-core dev box (shared, so noisy), ms per image
with 2 workers vs serial: 1920x1080 JPEG 84 vs 93, 4000x3000 JPEG 340 vs 370 with threads;
107 and 386 with processes. Neither pool wins on throughput there; threads cost no copies.

R1: `MediaRef.take()` and `EncodedImage.take()` move the URL string and the encoded bytes
out of their holders, so once a step has run nothing the caller holds still reaches them;
the PIL image lives only inside the worker function.
"""

from __future__ import annotations

import asyncio
import binascii
import io
import ipaddress
import os
import socket
import stat
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import httpx
import numpy as np
import pybase64
from PIL import Image, ImageOps, UnidentifiedImageError

from api_proc.config import ApiConfig
from api_proc.errors import BadRequest, PayloadTooLarge
from api_proc.media_url import parse_http_url
from api_proc.png_chunks import metadata_follows_pixels
from shared.image_key import encoded_key
from shared.image_resize import resize_image, smart_resize
from shared.messages import ImageInput
from shared.model_config import ImageProcessorConfig

ALLOWED_FORMATS = frozenset({"JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"})
MAX_REDIRECTS = 5
_ORIENTATION_TAG = 0x0112
_SWAPS_SIDES = frozenset({5, 6, 7, 8})


class MediaRef:
    """Holder of one image or video URL; the loader takes the string out (R1)."""

    __slots__ = ("url", "kind")

    def __init__(self, url: str, kind: str = "image"):
        self.url: str | None = url
        self.kind = kind  # "image" | "video"

    def take(self) -> str:
        url, self.url = self.url, None
        if url is None:
            raise RuntimeError(f"{self.kind} URL already taken")
        return url


@dataclass
class EncodedImage:
    """Encoded bytes of one image plus what its header says. `take()` moves the bytes out."""

    data: bytes | None
    format: str
    mode: str
    width: int  # as displayed, after the EXIF orientation
    height: int
    orientation: int
    has_alpha: bool
    grid_thw: tuple[int, int, int]
    resized_hw: tuple[int, int]
    nbytes: int  # of the encoded data, still known after take()
    key: bytes = b""  # shared/image_key.py encoded_key: bytes + resize settings

    def take(self) -> bytes:
        data, self.data = self.data, None
        if data is None:
            raise RuntimeError("image bytes already taken")
        return data

    def held_by(self, engine) -> bool:
        """Whether `engine`'s encoder cache holds this image (its mirror says so)."""
        return engine.holds_image(self.key)

    def without_pixels(self) -> ImageInput:
        """What a request sends for an image the engine's encoder cache holds."""
        return ImageInput(None, self.grid_thw, self.key)

    @property
    def resized_bytes(self) -> int:
        """Bytes of the uint8 pixels handed to the engine."""
        return self.resized_hw[0] * self.resized_hw[1] * 3

    @property
    def need_bytes(self) -> int:
        """Peak bytes while this image is decoded and resized, counted before decoding for
        admission: the encoded bytes (alive until the job ends), the decoded image (PIL
        keeps 1, 2 or 4 bytes a pixel, RGB as 4), an RGB copy unless it is RGB already (three
        more images when transparency is composited on white), a transposed copy for an
        EXIF orientation, then the resized PIL image and its uint8 array."""
        pixels = self.width * self.height
        size = pixels * _pil_pixel_size(self.mode)
        if self.mode != "RGB" or self.has_alpha:
            size += pixels * 4
        if self.has_alpha:
            size += pixels * 12
        if self.orientation != 1:
            size += pixels * 4  # the transposed copy
        resized = self.resized_hw[0] * self.resized_hw[1] * 4 + self.resized_bytes
        return self.nbytes + size + resized


def _pil_pixel_size(mode: str) -> int:
    if mode in ("1", "L", "P"):
        return 1
    if mode.startswith("I;16"):
        return 2
    return 4


# ------------------------------------------------------------------ worker-pool jobs


def too_large(kind: str, max_bytes: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"{kind} is larger than max_{kind}_bytes={max_bytes} bytes",
                           param=f"{kind}_url", code=f"{kind}_too_large")


def data_url_media_type(url: str, kind: str = "image") -> tuple[str, int]:
    """(media type, index where the payload starts) of a base64 data URL, checked."""
    param = f"{kind}_url"
    head, sep, _ = url[:256].partition(",")
    if not sep or not head.lower().startswith("data:"):
        raise BadRequest("malformed data URL: expected data:<mime>;base64,<data>", param=param)
    meta = head[5:].lower().split(";")
    if "base64" not in meta[1:]:
        raise BadRequest("data URLs must be base64-encoded", param=param)
    if meta[0] and not meta[0].startswith(kind + "/"):
        what = {"image": "an image", "video": "a video"}[kind]
        raise BadRequest(f"data URL media type {meta[0]!r} is not {what}", param=param)
    return meta[0], len(head) + 1


def decode_base64(text: str, kind: str = "image") -> bytes:
    """pybase64's SIMD decoder for strict base64 (~70x the standard library's on a 4 MB
    data URL); anything it refuses (line breaks, stray characters) goes through the lenient
    standard decoder, so what is accepted is the same as before."""
    try:
        return pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        pass
    try:
        data = binascii.a2b_base64(text)
    except (binascii.Error, ValueError):
        data = None
    if data is None:
        raise BadRequest("data URL is not valid base64", param=f"{kind}_url")
    return data


def decode_data_url(url: str, max_bytes: int, kind: str = "image") -> bytes:
    _, start = data_url_media_type(url, kind)
    if (len(url) - start) * 3 // 4 > max_bytes + 2:
        raise too_large(kind, max_bytes)
    data = decode_base64(url[start:], kind)
    if len(data) > max_bytes:
        raise too_large(kind, max_bytes)
    return data


def read_local_file(path_text: str, root: str, max_bytes: int, kind: str = "image") -> bytes:
    param = f"{kind}_url"
    path = Path(path_text)
    if not path.is_absolute():
        raise BadRequest(f"file:// {kind} URLs need an absolute path", param=param)
    if "\x00" in path_text:
        raise BadRequest(f"{kind} URL path: a NUL byte (%00) names no file", param=param,
                         code=f"invalid_{kind}_url")
    try:
        real = path.resolve(strict=True)  # follows symlinks and '..'
    except (OSError, RuntimeError):
        real = None
    if real is None:
        raise BadRequest(f"{kind} file not found", param=param)
    if not real.is_relative_to(root):
        raise BadRequest(f"{kind} file is outside allowed_local_media_path", param=param)
    try:  # O_NONBLOCK: a FIFO planted under the folder must not hang a worker
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        fd = -1
    if fd < 0:
        raise BadRequest(f"{kind} file cannot be opened", param=param)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise BadRequest(f"{kind} path is not a regular file", param=param)
    if info.st_size > max_bytes:
        os.close(fd)
        raise too_large(kind, max_bytes)
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise too_large(kind, max_bytes)
    return data


def probe_image(data: bytes, max_pixels: int, cfg: ImageProcessorConfig) -> EncodedImage:
    """Read the header only (no pixel is decoded) and size the image; refuse bombs here."""
    problem = None
    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt, mode = img.format or "", img.mode
            width, height = img.size
            orientation = 1
            has_alpha = "A" in mode or img.info.get("transparency") is not None
            if fmt in ALLOWED_FORMATS and width * height <= max_pixels:
                orientation = int(_header_exif(img, data).get(_ORIENTATION_TAG, 1) or 1)
    except Image.DecompressionBombError:
        problem = f"image declares more pixels than max_image_pixels={max_pixels}"
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        problem = "image data is not a supported image (JPEG, PNG, WEBP, GIF, BMP, TIFF)"
    if problem is not None:
        raise BadRequest(problem, param="image_url", code="invalid_image")
    if fmt not in ALLOWED_FORMATS:
        raise BadRequest(f"image format {fmt or 'unknown'} is not supported",
                              param="image_url", code="invalid_image")
    if width < 1 or height < 1:
        raise BadRequest("image has no pixels", param="image_url", code="invalid_image")
    if width * height > max_pixels:
        raise BadRequest(f"image is {width}x{height} = {width * height} pixels; "
                              f"max_image_pixels is {max_pixels}",
                              param="image_url", code="image_too_many_pixels")
    if orientation in _SWAPS_SIDES:
        width, height = height, width
    rh, rw = _smart_resize(height, width, cfg)
    p = cfg.patch_size
    return EncodedImage(data=data, format=fmt, mode=mode, width=width, height=height,
                        orientation=orientation, has_alpha=has_alpha, grid_thw=(1, rh // p, rw // p),
                        resized_hw=(rh, rw), nbytes=len(data), key=encoded_key(data, cfg))


def _header_exif(img: Image.Image, data: bytes) -> Image.Exif:
    """The EXIF that decoding will apply, without decoding where the header has it all: a
    PNG's `getexif()` decodes every pixel unless its EXIF came ahead of the data, so when no
    metadata follows the data (png_chunks.py) PIL's base method reads what the header gave."""
    if img.format == "PNG" and not metadata_follows_pixels(data):
        return Image.Image.getexif(img)
    return img.getexif()


def _smart_resize(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    try:
        return smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    except ValueError as e:  # e.g. extreme aspect ratio
        message = f"image of {width}x{height} cannot be resized for the model: {e}"
    raise BadRequest(message, param="image_url", code="invalid_image")


def decode_and_resize(data: bytes, cfg: ImageProcessorConfig,
                      expect_grid: tuple[int, int, int]) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Decode, apply the EXIF orientation, resize. Runs in a pool thread."""
    problem = None
    try:
        pixels, grid = _decode_and_resize(data, cfg)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        problem = f"image cannot be decoded: {type(e).__name__}"
    data = None  # R1: an error raised below must not pin the encoded bytes in this frame
    if problem is not None:
        raise BadRequest(problem, param="image_url", code="invalid_image")
    if tuple(grid) != tuple(expect_grid):
        raise BadRequest("image pixels do not match the size its header declares",
                              param="image_url", code="invalid_image")
    return pixels, tuple(int(g) for g in grid)


def _decode_and_resize(data: bytes, cfg: ImageProcessorConfig):
    # The PIL images live only in this frame: gone when it returns or its error is handled.
    with Image.open(io.BytesIO(data)) as img:
        img.seek(0)
        img.load()
        if _orientation(img) != 1:
            with ImageOps.exif_transpose(img) as oriented:
                return resize_image(oriented, cfg)
        return resize_image(img, cfg)


def _orientation(img: Image.Image) -> int:
    return int(img.getexif().get(_ORIENTATION_TAG, 1) or 1)


# ------------------------------------------------------------------ address checks


def is_public_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address):
        mapped = ip.ipv4_mapped or ip.sixtofour
        if mapped is not None:
            return is_public_address(mapped)
    return not (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
                or ip.is_reserved or ip.is_unspecified or not ip.is_global)


# ------------------------------------------------------------------ the loader


class MediaLoader:
    def __init__(self, config: ApiConfig, image_config: ImageProcessorConfig,
                 executor: Executor | None = None):
        self.config = config
        self.image_config = image_config
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(config.num_media_workers,
                                                        thread_name_prefix="flatserve-media")
        self._http: httpx.AsyncClient | None = None

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def run_in_pool(self, fn, *args):
        """fn(*args) in the media worker pool (decoding never runs on the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- step 1: bytes and header

    async def fetch(self, ref: MediaRef) -> EncodedImage:
        """Encoded bytes of the image `ref` names, with its header checked and sized."""
        data = await self.fetch_bytes(ref)
        return await self.run_in_pool(probe_image, data, self.config.max_image_pixels, self.image_config)

    async def fetch_bytes(self, ref: MediaRef) -> bytes:
        kind = ref.kind
        url = ref.take()
        return await self.fetch_url(url, kind)

    async def fetch_url(self, url: str, kind: str = "image") -> bytes:
        """The bytes a data:, http(s):// or file:// URL names, within the kind's limits."""
        scheme = url[:8].split(":", 1)[0].lower()
        max_bytes = self._max_bytes(kind)
        param = f"{kind}_url"
        if scheme == "data":
            return await self.run_in_pool(decode_data_url, url, max_bytes, kind)
        if scheme in ("http", "https"):
            return await self._fetch_http(url, kind)
        if scheme == "file":
            root = self.config.allowed_local_media_path
            if root is None:
                raise BadRequest(f"file:// {kind} URLs are disabled (no "
                                 "allowed_local_media_path)", param=param)
            try:
                parts = urlsplit(url)
            except ValueError:
                parts = None
            if parts is None or parts.netloc not in ("", "localhost"):
                raise BadRequest(f"file:// {kind} URLs must name a local path", param=param)
            return await self.run_in_pool(read_local_file, unquote(parts.path), root, max_bytes, kind)
        raise BadRequest(f"{param} must be a data:, http(s):// or file:// URL", param=param)

    def _max_bytes(self, kind: str) -> int:
        return self.config.max_video_bytes if kind == "video" else self.config.max_image_bytes

    def _fetch_timeout(self, kind: str) -> tuple[str, float]:
        if kind == "video":
            return "video_fetch_timeout_s", self.config.video_fetch_timeout_s
        return "media_fetch_timeout_s", self.config.media_fetch_timeout_s

    # -- step 2: pixels

    async def decode(self, image: EncodedImage) -> ImageInput:
        """Resized uint8 pixels + grid; moves the encoded bytes out of `image` (R1)."""
        grid = image.grid_thw
        pixels, grid = await self.run_in_pool(decode_and_resize, image.take(), self.image_config, grid)
        return ImageInput(pixels=pixels, grid_thw=grid, key=image.key)

    # -- http(s)

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            # No keep-alive: connections are made to a pinned IP with the name only in SNI and
            # Host, and a pooled connection must never serve another name. Each fetch has its
            # own deadline (_fetch_http); this one bounds a single read or connect.
            self._http = httpx.AsyncClient(
                follow_redirects=False, trust_env=False,
                limits=httpx.Limits(max_keepalive_connections=0),
                timeout=httpx.Timeout(max(self.config.media_fetch_timeout_s,
                                          self.config.video_fetch_timeout_s)))
        return self._http

    def _check_host(self, host: str, kind: str = "image") -> None:
        allowed = self.config.allowed_media_domains
        if allowed is not None and host.lower().rstrip(".") not in allowed:
            raise BadRequest(f"{kind} host {host!r} is not in allowed_media_domains",
                             param=f"{kind}_url", code="media_host_not_allowed")

    async def _resolve(self, host: str, port: int, kind: str = "image") -> str:
        """One IP for `host`, every answer checked; the connection is pinned to it so a second
        DNS lookup cannot point somewhere else (rebinding)."""
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                                 type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            infos = []
        if not infos:
            raise BadRequest(f"{kind} host {host!r} cannot be resolved", param=f"{kind}_url")
        ips = [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]
        if not self.config.allow_private_media_addresses:
            for ip in ips:
                if not is_public_address(ip):
                    raise BadRequest(
                        f"{kind} host {host!r} resolves to a non-public address ({ip}); "
                        "refused", param=f"{kind}_url", code="media_host_not_allowed")
        return str(ips[0])

    async def _fetch_http(self, url: str, kind: str = "image") -> bytes:
        name, timeout = self._fetch_timeout(kind)
        try:
            return await asyncio.wait_for(self._follow(url, kind), timeout)
        except asyncio.TimeoutError:
            message = f"fetching the {kind} took longer than {name}={timeout:g}"
        except httpx.HTTPError as e:  # the text names the part (e.g. a malformed location)
            message = f"fetching the {kind} failed: {type(e).__name__}: {str(e)[:200]}"
        raise BadRequest(message, param=f"{kind}_url", code="media_fetch_failed")

    async def _follow(self, url: str, kind: str = "image") -> bytes:
        for hop in range(MAX_REDIRECTS + 1):
            target = parse_http_url(url, f"{kind} URL redirect" if hop else f"{kind} URL")
            self._check_host(target.host, kind)
            port = target.port or (443 if target.scheme == "https" else 80)
            ip = await self._resolve(target.host, port, kind)
            headers = {"Host": target.netloc.decode("ascii"), "Accept-Encoding": "identity",
                       "Accept": f"{kind}/*"}
            extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
            request = self._client().build_request("GET", target.copy_with(host=ip),
                                                   headers=headers, extensions=extensions)
            response = await self._client().send(request, stream=True)
            try:
                if response.is_redirect:
                    location = response.headers.get("location")
                    if not location:
                        raise BadRequest(f"{kind} URL redirect has no location",
                                         param=f"{kind}_url")
                    url = urljoin(url, location)
                    continue
                return await self._read_body(response, kind)
            finally:
                await response.aclose()
        raise BadRequest(f"{kind} URL redirected more than {MAX_REDIRECTS} times",
                         param=f"{kind}_url")

    async def _read_body(self, response: httpx.Response, kind: str = "image") -> bytes:
        max_bytes = self._max_bytes(kind)
        param = f"{kind}_url"
        if response.status_code != 200:
            raise BadRequest(f"{kind} URL answered HTTP {response.status_code}",
                             param=param, code="media_fetch_failed")
        encoding = response.headers.get("content-encoding", "identity").lower()
        if encoding not in ("identity", ""):
            raise BadRequest(f"{kind} URL sent content-encoding {encoding!r}",
                             param=param, code="media_fetch_failed")
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise too_large(kind, max_bytes)
        chunks: list[bytes] = []
        total = 0
        async for chunk in response.aiter_raw():
            total += len(chunk)
            if total > max_bytes:
                raise too_large(kind, max_bytes)
            chunks.append(chunk)
        return b"".join(chunks)
