"""Whether a PNG's metadata is all ahead of its pixel data, read from its chunk headers.

PIL reads a PNG's chunks up to the first IDAT when it opens the file; chunks after the
pixel data (an eXIf or a text chunk that may hold EXIF) are read only by `load()`, which
decodes every pixel. So `PngImageFile.getexif()` loads the whole image whenever the EXIF is
not ahead of the data, to be sure it misses none. Walking the chunk headers (8 bytes each,
no decompression) tells when there is nothing after the data for `load()` to find, so that
the EXIF PIL already read is the whole answer.
"""

from __future__ import annotations

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def metadata_follows_pixels(data: bytes) -> bool:
    """True when some chunk other than IDAT or IEND comes after the first IDAT chunk of
    `data` (or the chunk list is cut short or malformed): then only a full load sees all
    the metadata. False when nothing after the pixel data can change the image's info."""
    if not data.startswith(PNG_SIGNATURE):
        return True
    pos, end = len(PNG_SIGNATURE), len(data)
    seen_pixels = False
    while pos + 8 <= end:
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind = data[pos + 4:pos + 8]
        if kind == b"IEND":
            return False
        if kind == b"IDAT":
            seen_pixels = True
        elif seen_pixels:
            return True
        pos += 12 + length  # length, type, body, CRC
    return True
