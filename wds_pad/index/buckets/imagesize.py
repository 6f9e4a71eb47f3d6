"""Image width and height from the first bytes of a PNG, JPEG or WebP file, without decoding.

Invariants:
    * Pure functions of the bytes given: no I/O, no PIL, no decoding.
    * The format comes from the magic bytes, never from a file name.
    * The size is the stored one (a JPEG EXIF orientation is not applied), which is what
      ``PIL.Image.open`` reports without ``ImageOps.exif_transpose``.
    * A damaged header raises :class:`BucketError`; a header that runs past the bytes
      given is reported as ``None`` by :func:`image_size_or_none`, so a caller that read
      only a prefix can read more and try again.
"""

from __future__ import annotations

import struct

from ...errors import BucketError

__all__ = ["image_size", "image_size_or_none"]

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_JPEG_MAGIC = b"\xff\xd8"
# SOF0..SOF15 except DHT (C4), JPG (C8) and DAC (CC), which share the range.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_STANDALONE = frozenset([0x01, 0xD8, *range(0xD0, 0xD8)])


def _png_size(data: bytes) -> tuple[int, int] | None:
    if len(data) < 24:
        return None
    if data[12:16] != b"IHDR":
        raise BucketError("PNG: first chunk is not IHDR; the file is damaged")
    return struct.unpack(">II", data[16:24])


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    pos, end = 2, len(data)
    while True:
        if pos >= end:
            return None
        if data[pos] != 0xFF:
            raise BucketError(
                f"JPEG: expected a marker at byte {pos}, found 0x{data[pos]:02x}; the file is damaged"
            )
        while pos < end and data[pos] == 0xFF:  # fill bytes may precede a marker
            pos += 1
        if pos >= end:
            return None
        marker = data[pos]
        pos += 1
        if marker in _JPEG_STANDALONE:
            continue
        if marker in (0xD9, 0xDA):
            name = "EOI" if marker == 0xD9 else "SOS"
            raise BucketError(f"JPEG: reached {name} at byte {pos - 2} before any SOF marker; no size to read")
        if marker in _JPEG_SOF:
            if pos + 7 > end:
                return None
            height, width = struct.unpack(">HH", data[pos + 3 : pos + 7])
            return width, height
        if pos + 2 > end:
            return None
        length = (data[pos] << 8) | data[pos + 1]
        if length < 2:
            raise BucketError(f"JPEG: segment 0x{marker:02x} at byte {pos - 2} has length {length} < 2")
        pos += length


def _webp_size(data: bytes) -> tuple[int, int] | None:
    if len(data) < 16:
        return None
    chunk = data[12:16]
    if chunk == b"VP8L":
        if len(data) < 25:
            return None
        if data[20] != 0x2F:
            raise BucketError("WebP: VP8L chunk lacks its 0x2f signature byte; the file is damaged")
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk not in (b"VP8 ", b"VP8X"):
        raise BucketError(f"WebP: unknown first chunk {chunk!r}; expected VP8, VP8L or VP8X")
    if len(data) < 30:
        return None
    if chunk == b"VP8X":
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    if data[23:26] != b"\x9d\x01\x2a":
        raise BucketError("WebP: VP8 key frame start code missing; the file is damaged or not a key frame")
    return int.from_bytes(data[26:28], "little") & 0x3FFF, int.from_bytes(data[28:30], "little") & 0x3FFF


def _magic_prefix(data: bytes) -> bool:
    """True if ``data`` is too short to tell, but could be the start of a known format."""
    if len(data) >= 12:
        return False
    webp = b"RIFF".startswith(data[:4]) and b"WEBP".startswith(data[8:])
    return webp or _PNG_MAGIC.startswith(data) or _JPEG_MAGIC.startswith(data)


def image_size_or_none(data: bytes) -> tuple[int, int] | None:
    """Like :func:`image_size`, but ``None`` when the header goes past the end of ``data``."""
    data = bytes(data[:]) if not isinstance(data, bytes) else data
    if data.startswith(_PNG_MAGIC):
        size = _png_size(data)
    elif data.startswith(_JPEG_MAGIC):
        size = _jpeg_size(data)
    elif data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        size = _webp_size(data)
    elif _magic_prefix(data):
        return None
    else:
        raise BucketError(f"not a PNG, JPEG or WebP image (starts with {data[:12]!r})")
    if size is not None and (size[0] == 0 or size[1] == 0):
        raise BucketError(f"image header gives a zero size {size[0]}x{size[1]}; the file is damaged")
    return size


def image_size(data: bytes) -> tuple[int, int]:
    """Return ``(width, height)`` of a PNG, JPEG or WebP image from its first bytes.

    Nothing is decoded: PNG's IHDR, JPEG's first SOFn marker (APPn, EXIF, ICC and other
    segments are skipped) or WebP's VP8 / VP8L / VP8X header is read. The format comes
    from the magic bytes, not the extension. The size is the stored one: a JPEG EXIF
    orientation is not applied, matching ``PIL.Image.open`` without ``exif_transpose``.

    Args:
        data: The image file's bytes, or a prefix of them.

    Returns:
        The stored width and height in pixels.

    Raises:
        BucketError: The format is unknown, the header is damaged, or ``data`` ends
            before the size (e.g. a JPEG whose SOF lies beyond the bytes read).
    """
    size = image_size_or_none(data)
    if size is None:
        raise BucketError(f"image header is truncated: no size found in the first {len(data)} bytes")
    return size
