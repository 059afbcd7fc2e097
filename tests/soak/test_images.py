import base64
import io

import numpy as np
import pytest
from PIL import Image

from flatserve.soak.images import KINDS, POOL_BYTES, ImagePool, make_image


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_has_the_size_and_content(kind):
    image = make_image(kind, 96, np.random.default_rng(0))
    assert image.shape == (96, 96, 3) and image.dtype == np.uint8
    assert image.std() > 5  # not a blank image


@pytest.mark.parametrize("size", [32, 200])
def test_variants_decode_to_the_size_alternating_jpeg_and_png(size):
    pool = ImagePool(size, count=4, seed=1)
    formats = []
    for index in range(6):
        encoded = pool.variant(index)
        with Image.open(io.BytesIO(encoded.data)) as image:
            image.load()
            assert image.size == (size, size)
            assert image.format == encoded.format
            formats.append(image.format)
    assert formats == ["JPEG", "PNG"] * 3


def test_every_request_gets_new_bytes():
    pool = ImagePool(64, count=2)
    datas = {pool.variant(i).data for i in range(20)}
    assert len(datas) == 20


def test_png_variants_differ_in_pixels_from_their_base():
    pool = ImagePool(64, count=2)
    a, b = (np.asarray(Image.open(io.BytesIO(pool.variant(i).data))) for i in (1, 5))
    assert (a != b).any()


def test_data_url():
    encoded = ImagePool(16, count=2).variant(1)
    prefix = "data:image/png;base64,"
    url = encoded.data_url()
    assert url.startswith(prefix)
    assert base64.b64decode(url[len(prefix):]) == encoded.data


def test_huge_images_keep_a_small_pool():
    size = 3000
    pool = ImagePool(size, count=8)
    assert 2 <= len(pool) <= max(2, POOL_BYTES // (size * size * 3))
