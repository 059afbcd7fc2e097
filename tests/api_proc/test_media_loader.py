from __future__ import annotations

import os
import re
import struct
import threading
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

import api_proc.media_loader as ml
from api_proc.errors import BadRequest, PayloadTooLarge
from api_proc.media_loader import MediaLoader, MediaRef, is_public_address
from shared.image_resize import resize_image, to_rgb
from tests.api_proc.conftest import data_url, encode_image


@pytest.fixture
async def loader_factory(make_config, image_config):
    loaders = []

    def make(**kw) -> MediaLoader:
        loader = MediaLoader(make_config(**kw), image_config)
        loaders.append(loader)
        return loader
    yield make
    for loader in loaders:
        await loader.aclose()


async def load(loader: MediaLoader, url: str):
    encoded = await loader.fetch(MediaRef(url))
    return encoded, await loader.decode(encoded)


# ------------------------------------------------------------------ data URLs and decoding


async def test_data_url_decodes_to_resized_uint8_pixels(loader_factory, image_config):
    raw = encode_image(300, 200)
    encoded, image = await load(loader_factory(), data_url(raw))
    assert (encoded.width, encoded.height) == (300, 200)
    assert encoded.data is None  # taken by decode
    expected, grid = resize_image(Image.open(__import__("io").BytesIO(raw)), image_config)
    assert image.grid_thw == grid == encoded.grid_thw
    assert image.pixels.dtype == np.uint8 and image.pixels.shape == (*encoded.resized_hw, 3)
    np.testing.assert_array_equal(image.pixels, expected)
    assert image.nbytes == encoded.resized_bytes <= encoded.need_bytes


async def test_exif_orientation_is_applied(loader_factory):
    raw = encode_image(120, 60, fmt="JPEG", exif_orientation=6)  # rotated 90 degrees
    encoded, image = await load(loader_factory(), data_url(raw, "image/jpeg"))
    assert (encoded.width, encoded.height) == (60, 120)
    assert image.pixels.shape[0] > image.pixels.shape[1]


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    chunks, pos = [], 8
    while pos < len(data):
        n = int.from_bytes(data[pos:pos + 4], "big")
        chunks.append((data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]))
        pos += 12 + n
    return chunks


def _png_with_exif_after_pixels(width: int, height: int, orientation: int) -> bytes:
    """A PNG whose eXIf chunk comes after its pixel data (PIL writes it before)."""
    chunks = _png_chunks(encode_image(width, height, exif_orientation=orientation))
    exif = [c for c in chunks if c[0] == b"eXIf"]
    rest = [c for c in chunks if c[0] not in (b"eXIf", b"IEND")]
    assert len(exif) == 1 and rest[-1][0] == b"IDAT"
    return b"\x89PNG\r\n\x1a\n" + b"".join(_chunk(k, b) for k, b in rest + exif + [(b"IEND", b"")])


@pytest.mark.parametrize("exif_after_pixels", [False, True])
async def test_png_exif_orientation_is_applied_wherever_the_chunk_is(loader_factory,
                                                                     exif_after_pixels):
    raw = (_png_with_exif_after_pixels(120, 60, 6) if exif_after_pixels
           else encode_image(120, 60, exif_orientation=6))
    encoded, image = await load(loader_factory(), data_url(raw))
    assert (encoded.width, encoded.height) == (60, 120)
    assert image.pixels.shape[0] > image.pixels.shape[1]


@pytest.mark.parametrize("exif_orientation", [None, 6])
async def test_png_header_is_read_without_decoding_its_pixels(loader_factory, monkeypatch,
                                                              exif_orientation):
    # Sizing a PNG for admission (its EXIF included) must not decode it: that is the
    # decode the admission budget is there to bound, and a cache hit skips it altogether.
    loads = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self))
    raw = encode_image(120, 60, exif_orientation=exif_orientation)
    encoded = await loader_factory().fetch(MediaRef(data_url(raw)))
    assert (encoded.width, encoded.height) == ((60, 120) if exif_orientation else (120, 60))
    assert loads == []


@pytest.mark.parametrize("mode", ["RGBA", "L"])
async def test_other_modes_become_rgb(loader_factory, mode):
    _, image = await load(loader_factory(), data_url(encode_image(64, 64, mode=mode)))
    assert image.pixels.shape[2] == 3


@pytest.mark.parametrize("mode, decoded_per_pixel", [("RGB", 4), ("L", 1 + 4)])
async def test_admission_counts_the_encoded_bytes_and_only_real_copies(loader_factory, mode,
                                                                       decoded_per_pixel):
    # An RGB image is resized as it is (no RGB copy); other modes are converted first. The
    # encoded bytes live until the decode job ends, so they are part of what it needs.
    raw = encode_image(300, 200, mode=mode)
    encoded = await loader_factory().fetch(MediaRef(data_url(raw)))
    rh, rw = encoded.resized_hw
    assert encoded.mode == mode and encoded.nbytes == len(raw)
    assert encoded.need_bytes == len(raw) + 300 * 200 * decoded_per_pixel + rh * rw * (4 + 3)
    assert encoded.take() == raw and encoded.nbytes == len(raw)  # still counted once taken


def test_an_rgb_image_is_not_copied_to_become_rgb():
    rgb = Image.new("RGB", (8, 8), (1, 2, 3))
    assert to_rgb(rgb) is rgb
    gray = Image.new("L", (8, 8), 7)
    assert to_rgb(gray).mode == "RGB"
    with_transparency = Image.new("RGB", (8, 8), (1, 2, 3))
    with_transparency.info["transparency"] = (1, 2, 3)
    assert to_rgb(with_transparency).getpixel((0, 0)) == (255, 255, 255)  # over white


@pytest.mark.parametrize("url, match", [
    ("data:image/png,notbase64", "base64"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("data:image/png;base64,aGVsbG8gd29ybGQ=", "not a supported image"),
    ("data:image/png;base64," + "A" * 7, "not valid base64"),
    ("ftp://example.com/x.png", "data:, http"),
    ("nodata", "data:, http"),
])
async def test_bad_data_urls_are_400(loader_factory, url, match):
    with pytest.raises(BadRequest, match=match) as e:
        await load(loader_factory(), url)
    assert e.value.status == 400


async def test_encoded_size_cap_is_413_naming_the_limit(loader_factory):
    raw = encode_image(256, 256)
    with pytest.raises(PayloadTooLarge, match=f"max_image_bytes={len(raw) - 1}") as e:
        await load(loader_factory(max_image_bytes=len(raw) - 1), data_url(raw))
    assert e.value.status == 413


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares width x height but which has almost no pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + _chunk(b"IEND", b""))


def _real_bomb(side: int) -> bytes:
    """A valid grey PNG of side x side zeros: tiny encoded, side*side bytes decoded."""
    comp = zlib.compressobj(9)
    row = b"\0" * (side + 1)
    idat = b"".join(comp.compress(row) for _ in range(side)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


@pytest.mark.parametrize("payload", [_png_header_only(60000, 60000), _real_bomb(3000)])
async def test_decompression_bomb_is_refused_from_the_header(loader_factory, monkeypatch, payload):
    loads = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self))
    loader = loader_factory(max_image_pixels=4_000_000)
    with pytest.raises(BadRequest, match="max_image_pixels") as e:
        await loader.fetch(MediaRef(data_url(payload)))
    assert e.value.status == 400
    assert len(payload) < 200_000
    assert loads == []  # refused before any pixel was decoded


async def test_decode_runs_in_the_worker_pool(loader_factory, monkeypatch):
    threads = []
    real = ml.resize_image

    def spy(img, cfg):
        threads.append(threading.current_thread())
        return real(img, cfg)
    monkeypatch.setattr(ml, "resize_image", spy)
    await load(loader_factory(), data_url(encode_image()))
    assert threads and threads[0] is not threading.main_thread()


async def test_media_ref_is_taken(loader_factory):
    ref = MediaRef(data_url(encode_image()))
    await loader_factory().fetch(ref)
    assert ref.url is None
    with pytest.raises(RuntimeError):
        ref.take()


# ------------------------------------------------------------------ SSRF


@pytest.mark.parametrize("ip, public", [
    ("8.8.8.8", True), ("2606:4700::1111", True), ("127.0.0.1", False), ("10.1.2.3", False),
    ("172.16.0.1", False), ("192.168.1.1", False), ("169.254.169.254", False), ("::1", False),
    ("fe80::1", False), ("fc00::1", False), ("224.0.0.1", False), ("0.0.0.0", False),
    ("240.0.0.1", False), ("::ffff:127.0.0.1", False), ("::ffff:8.8.8.8", True),
    ("100.64.0.1", False),
])
def test_public_address_classification(ip, public):
    import ipaddress
    assert is_public_address(ipaddress.ip_address(ip)) is public


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "169.254.169.254",
                                  "10.0.0.1", "0.0.0.0", "[::ffff:127.0.0.1]", "224.0.0.1"])
async def test_non_public_hosts_are_refused(loader_factory, http_server, host):
    url = http_server.serve_bytes("/img.png", encode_image()).replace("127.0.0.1", host)
    with pytest.raises(BadRequest, match="non-public") as e:
        await loader_factory().fetch(MediaRef(url))
    assert e.value.status == 400


async def test_private_hosts_when_allowed(loader_factory, http_server):
    url = http_server.serve_bytes("/img.png", encode_image(80, 80))
    encoded, image = await load(loader_factory(allow_private_media_addresses=True), url)
    assert (encoded.width, encoded.height) == (80, 80)


async def test_domain_allowlist(loader_factory, http_server):
    url = http_server.serve_bytes("/img.png", encode_image())
    loader = loader_factory(allow_private_media_addresses=True, allowed_media_domains=("example.com",))
    with pytest.raises(BadRequest, match="allowed_media_domains"):
        await loader.fetch(MediaRef(url))
    ok = loader_factory(allow_private_media_addresses=True, allowed_media_domains=("127.0.0.1",))
    await ok.fetch(MediaRef(url))


async def test_redirect_to_a_disallowed_host_is_refused(loader_factory, http_server):
    target = http_server.serve_bytes("/img.png", encode_image())
    hop = http_server.redirect("/hop", target.replace("127.0.0.1", "localhost"))
    loader = loader_factory(allow_private_media_addresses=True, allowed_media_domains=("127.0.0.1",))
    with pytest.raises(BadRequest, match="'localhost' is not in allowed_media_domains"):
        await loader.fetch(MediaRef(hop))
    same_host = http_server.redirect("/hop2", "/img.png")
    await loader.fetch(MediaRef(same_host))


async def test_redirect_to_a_private_address_is_refused(loader_factory, http_server, monkeypatch):
    # the first hop is treated as public; the redirect target is loopback
    http_server.serve_bytes("/img.png", encode_image())
    hop = http_server.redirect("/hop", http_server.url("/img.png", host="localhost"))
    checked = []
    real = ml.is_public_address

    def first_public(ip):
        checked.append(ip)
        return len(checked) == 1 or real(ip)
    monkeypatch.setattr(ml, "is_public_address", first_public)
    with pytest.raises(BadRequest, match="non-public"):
        await loader_factory().fetch(MediaRef(hop))


async def test_redirect_loops_stop(loader_factory, http_server):
    loop_url = http_server.redirect("/loop", "/loop")
    with pytest.raises(BadRequest, match="redirected more than"):
        await loader_factory(allow_private_media_addresses=True).fetch(MediaRef(loop_url))


@pytest.mark.parametrize("chunked", [False, True])
async def test_download_size_cap_is_413(loader_factory, http_server, chunked):
    body = os.urandom(300_000)
    url = http_server.serve_bytes("/big", body, chunked=chunked)
    loader = loader_factory(allow_private_media_addresses=True, max_image_bytes=100_000)
    with pytest.raises(PayloadTooLarge, match="max_image_bytes=100000"):
        await loader.fetch(MediaRef(url))


async def test_download_errors_are_400(loader_factory, http_server):
    loader = loader_factory(allow_private_media_addresses=True, media_fetch_timeout_s=0.3)
    with pytest.raises(BadRequest, match="HTTP 404"):
        await loader.fetch(MediaRef(http_server.url("/missing")))
    with pytest.raises(BadRequest, match="media_fetch_timeout_s"):
        await loader.fetch(MediaRef(http_server.slow("/slow", 2.0)))
    gz = http_server.serve_bytes("/gz", b"x", headers={"Content-Encoding": "gzip"})
    with pytest.raises(BadRequest, match="content-encoding"):
        await loader.fetch(MediaRef(gz))
    with pytest.raises(BadRequest, match="cannot be resolved"):
        await loader.fetch(MediaRef("http://no-such-host.invalid/x.png"))


@pytest.mark.parametrize("url, part", [
    ("http://0177.0.0.1:8499/x.png", "host: '0177.0.0.1' is not a dotted-decimal IPv4"),
    ("http://0x7f.1/x.png", "host: '0x7f.1' is not a dotted-decimal IPv4"),
    ("http://2130706433/x.png", "host: '2130706433' is not a dotted-decimal IPv4"),
    ("http://[::1/x.png", "host: Invalid IPv6 URL"),
    ("http://[zz]/x.png", "host: "),
    ("http://a\x00b.example/x.png", "host: control character '\\x00' at position 8"),
    ("http://example.com/x\x00.png", "path: control character"),
    ("http://exa mple.com/x.png", "host: 'exa mple.com' is not a valid domain name"),
    ("http://a..b/x.png", "host: 'a..b' is not a valid domain name"),
    ("http://xn--zz/x.png", "host: 'xn--zz' is not a valid domain name"),
    ("http:///x.png", "host: missing"),
    ("http://user@/x.png", "host: missing"),
    ("http://example.com:99999/x.png", "port: '99999' is not a port number"),
    ("http://example.com:abc/x.png", "port: 'abc' is not a port number"),
    ("http://example.com:0/x.png", "port: 0 is not a port number"),
])
async def test_malformed_http_urls_are_400_naming_the_part(loader_factory, url, part):
    with pytest.raises(BadRequest) as e:
        await loader_factory().fetch(MediaRef(url))
    assert e.value.status == 400 and e.value.code == "invalid_image_url"
    assert e.value.message.startswith(f"image URL {part}"), e.value.message


@pytest.mark.parametrize("location, match", [
    ("http://[::1/x.png", "Invalid URL in location header: Invalid port"),
    ("http://0177.0.0.1/x.png", "Invalid URL in location header: Invalid IPv4 address"),
    ("http://a..b/x.png", "image URL redirect host: 'a..b'"),
])
async def test_malformed_redirect_location_is_400(loader_factory, http_server, location, match):
    hop = http_server.redirect("/hop", location)
    with pytest.raises(BadRequest, match=re.escape(match)) as e:
        await loader_factory(allow_private_media_addresses=True).fetch(MediaRef(hop))
    assert e.value.status == 400


async def test_malformed_file_url_is_400(loader_factory, media_root):
    loader = loader_factory(allowed_local_media_path=str(media_root))
    with pytest.raises(BadRequest, match="must name a local path"):
        await loader.fetch(MediaRef("file://[::1/x.png"))
    with pytest.raises(BadRequest, match="NUL byte") as e:
        await loader.fetch(MediaRef(f"file://{media_root}/ok%00.png"))
    assert e.value.status == 400


# ------------------------------------------------------------------ local files


@pytest.fixture
def media_root(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "ok.png").write_bytes(encode_image(40, 30))
    outside = tmp_path / "secret.png"
    outside.write_bytes(encode_image(40, 30))
    (root / "link_out.png").symlink_to(outside)
    (root / "link_in.png").symlink_to(root / "ok.png")
    (root / "sub").mkdir()
    return root


async def test_local_files_are_off_by_default(loader_factory, media_root):
    with pytest.raises(BadRequest, match="disabled"):
        await loader_factory().fetch(MediaRef(f"file://{media_root}/ok.png"))


async def test_local_file_under_the_allowed_folder(loader_factory, media_root):
    loader = loader_factory(allowed_local_media_path=str(media_root))
    encoded, _ = await load(loader, f"file://{media_root}/ok.png")
    assert (encoded.width, encoded.height) == (40, 30)
    await loader.fetch(MediaRef(f"file://{media_root}/link_in.png"))


@pytest.mark.parametrize("rel, match", [
    ("link_out.png", "outside"),
    ("sub/../../secret.png", "outside"),
    ("../secret.png", "outside"),
    ("missing.png", "not found"),
    ("sub", "not a regular file"),
])
async def test_local_file_escapes_are_refused(loader_factory, media_root, rel, match):
    loader = loader_factory(allowed_local_media_path=str(media_root))
    with pytest.raises(BadRequest, match=match):
        await loader.fetch(MediaRef(f"file://{media_root}/{rel}"))


async def test_local_file_other_forms_are_refused(loader_factory, media_root):
    loader = loader_factory(allowed_local_media_path=str(media_root))
    with pytest.raises(BadRequest, match="local path"):
        await loader.fetch(MediaRef(f"file://evil.example.com{media_root}/ok.png"))
    with pytest.raises(BadRequest, match="absolute"):
        await loader.fetch(MediaRef("file:ok.png"))


async def test_local_file_size_cap_is_413(loader_factory, media_root):
    loader = loader_factory(allowed_local_media_path=str(media_root), max_image_bytes=100)
    with pytest.raises(PayloadTooLarge, match="max_image_bytes=100"):
        await loader.fetch(MediaRef(f"file://{media_root}/ok.png"))
