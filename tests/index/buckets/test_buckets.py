"""Tests of wds_pad.index.buckets.builtin and wds_pad.index.buckets.imagesize: every built-in on crafted inputs."""

from __future__ import annotations

import bisect
import io
import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, features

from wds_pad.index.buckets.imagesize import image_size_or_none
from wds_pad.index.buckets import (
    DEFAULT_RATIOS,
    AspectBuckets,
    ImageBuckets,
    JsonField,
    image_size,
)
from wds_pad.errors import BucketError, ConfigError

SIZES = [(1, 1), (37, 23), (23, 37), (300, 4), (4, 300), (1025, 769)]


def encode(fmt: str, width: int, height: int, mode: str = "RGB", **save: object) -> bytes:
    """A real image of the given size, encoded by PIL."""
    pixels = np.random.default_rng(width * 7919 + height).integers(0, 256, (height, width, len(mode)), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, mode).save(buf, format=fmt, **save)
    return buf.getvalue()


def meta(**fields: object) -> dict[str, bytes]:
    return {"json": json.dumps(fields).encode()}


def with_segment_after_soi(jpeg: bytes, marker: int, payload: bytes) -> bytes:
    """Insert one APPn-style segment right after SOI."""
    return jpeg[:2] + bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload + jpeg[2:]


# --- image_size ------------------------------------------------------------------------

IMAGE_KINDS = [
    ("PNG", "RGB", {}),
    ("PNG", "L", {}),
    ("JPEG", "RGB", {}),
    ("JPEG", "RGB", {"progressive": True}),
    ("JPEG", "L", {"quality": 30}),
]
if features.check("webp"):
    IMAGE_KINDS += [
        ("WEBP", "RGB", {"lossless": True}),  # VP8L
        ("WEBP", "RGB", {"quality": 70}),  # VP8
        ("WEBP", "RGBA", {"quality": 70}),  # VP8X (alpha)
    ]


@pytest.mark.parametrize(("fmt", "mode", "save"), IMAGE_KINDS, ids=lambda v: str(v))
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_image_size_matches_pil(fmt: str, mode: str, save: dict, size: tuple[int, int]) -> None:
    if mode == "L":
        data = encode(fmt, *size, mode="RGB", **save)
        data = _reencode(data, "L", fmt, **save)
    else:
        data = encode(fmt, *size, mode=mode, **save)
    assert Image.open(io.BytesIO(data)).size == size
    assert image_size(data) == size
    assert image_size(memoryview(data)) == size


def _reencode(data: bytes, mode: str, fmt: str, **save: object) -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(data)).convert(mode).save(buf, format=fmt, **save)
    return buf.getvalue()


@pytest.mark.skipif(not features.check("webp"), reason="this PIL build has no WebP")
def test_webp_chunk_kinds_are_all_exercised() -> None:
    chunks = {encode("WEBP", 9, 5, mode=m, **s)[12:16] for _, m, s in IMAGE_KINDS[-3:]}
    assert chunks == {b"VP8 ", b"VP8L", b"VP8X"}


def test_jpeg_with_exif_before_sof_reports_stored_size() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90; the stored size is still reported
    exif[0x010E] = "x" * 5000  # ImageDescription: a sizeable APP1 before SOF
    data = encode("JPEG", 64, 20, exif=exif.tobytes())
    assert b"\xff\xe1" in data[:30] and data.index(b"\xff\xc0") > 5000  # APP0, APP1 (EXIF), ..., SOF0
    assert Image.open(io.BytesIO(data)).getexif()[0x0112] == 6
    assert image_size(data) == (64, 20)


def test_jpeg_fill_bytes_and_restart_markers_are_skipped() -> None:
    data = encode("JPEG", 30, 10)
    padded = data[:2] + b"\xff\xff\xff\xd0" + data[2:]  # fill bytes, then a standalone RST0
    assert image_size(padded) == (30, 10)
    # DHT (0xC4), JPG (0xC8) and DAC (0xCC) sit in the SOF range but are not SOF markers
    for marker in (0xC4, 0xC8, 0xCC):
        assert image_size(with_segment_after_soi(data, marker, bytes([0, 0, 0, 9, 9, 0, 9, 9]))) == (30, 10)


def test_every_prefix_gives_none_or_the_true_size() -> None:
    kinds = [("PNG", {}), ("JPEG", {"progressive": True})] + ([("WEBP", {})] if features.check("webp") else [])
    for fmt, save in kinds:
        data = encode(fmt, 33, 17, **save)
        if fmt == "JPEG":
            data = with_segment_after_soi(data, 0xE1, b"Exif\x00\x00" + bytes(300))
        results = {image_size_or_none(data[:n]) for n in range(len(data[:600]) + 1)}
        assert results == {None, (33, 17)}, fmt


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"GIF89a" + bytes(40), "not a PNG, JPEG or WebP"),
        (b"\x89PNG\r\n\x1a\n" + bytes(4) + b"IDAT" + bytes(20), "IHDR"),
        (b"\xff\xd8\x00\x00" + bytes(20), "expected a marker at byte 2"),
        (b"\xff\xd8\xff\xda" + bytes(20), "SOS"),
        (b"\xff\xd8\xff\xe0\x00\x01" + bytes(20), "length 1"),
        (b"RIFF\x00\x00\x00\x00WEBPVP8 " + bytes(20), "start code"),
        (b"RIFF\x00\x00\x00\x00WEBPXXXX" + bytes(20), "unknown first chunk"),
        (b"\x89PNG\r\n\x1a\n" + struct.pack(">I4sII", 13, b"IHDR", 0, 5), "zero size"),
    ],
)
def test_damaged_headers_raise(data: bytes, needle: str) -> None:
    with pytest.raises(BucketError, match=needle):
        image_size(data)


def test_truncated_header_is_none_or_error() -> None:
    png = encode("PNG", 10, 10)
    assert image_size_or_none(png[:20]) is None
    assert image_size_or_none(b"") is None
    assert image_size_or_none(b"RIFF\x00\x00\x00\x00WE") is None
    with pytest.raises(BucketError, match="truncated: no size found in the first 20 bytes"):
        image_size(png[:20])


# --- aspect ratios ---------------------------------------------------------------------


def test_aspect_default_ratios_and_fields() -> None:
    fn = AspectBuckets()
    assert fn.ratios == DEFAULT_RATIOS
    assert fn.members == ("json",) and fn.head_bytes is None
    assert fn("k", meta(width=1920, height=1080)) == "16:9"
    assert fn("k", meta(width=1000, height=1010)) == "1:1"
    assert fn("k", meta(width=768, height=1024)) == "3:4"
    dotted = AspectBuckets("size.w", "size.h", ratios=["1:1", (2, 1)])
    assert dotted("k", meta(size={"w": 190, "h": 100})) == "2:1"



@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"height": 10}, "'width' is missing"),
        ({"width": "640", "height": 10}, "'width' = '640' is not a number"),
        ({"width": 10, "height": 0}, "'height' = 0 must be a positive number"),
        ({"width": -1, "height": 10}, "must be a positive number"),
        ({"width": True, "height": 10}, "is not a number"),
    ],
)
def test_aspect_bad_fields_name_key_and_field(doc: dict, needle: str) -> None:
    with pytest.raises(BucketError, match=needle) as err:
        AspectBuckets()("shard/000042", meta(**doc))
    assert "'shard/000042'" in str(err.value)


def test_aspect_missing_member_and_bad_json() -> None:
    with pytest.raises(BucketError, match="sample 'k7' has no .json member"):
        AspectBuckets()("k7", {"txt": b"x"})
    with pytest.raises(BucketError, match="sample 'k8': .json member is not valid JSON") as err:
        AspectBuckets()("k8", {"json": b"{oops"})
    assert isinstance(err.value.__cause__, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"ratios": ["1:1"], "step": 0.1}, "either ratios or step"),
        ({"step": 0}, "step must be a positive number"),
        ({"step": True}, "step must be a positive number"),
        ({"ratios": []}, "ratios is empty"),
        ({"ratios": ["1:1", "2:2"]}, "same ratio"),
        ({"ratios": ["4:0"]}, "not a positive ratio"),
        ({"ratios": ["wide"]}, "not a positive ratio"),
        ({"ratios": [(1, 2, 3)]}, "pair"),
        ({"width_field": ""}, "dotted field name"),
        ({"height_field": "a..b"}, "dotted field name"),
        ({"member": ".json"}, "member extension"),
    ],
)
def test_aspect_config_errors(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        AspectBuckets(**kwargs)


# --- JSON fields -----------------------------------------------------------------------


def test_json_field_values() -> None:
    fn = JsonField("meta.lang")
    assert fn.members == ("json",)
    assert fn("k", meta(meta={"lang": "de"})) == "de"
    assert JsonField("n")("k", meta(n=7)) == 7
    assert JsonField("x")("k", meta(x=0.5)) == 0.5
    assert JsonField("flag")("k", meta(flag=True)) == "true"
    assert JsonField("t", member="info")("k", {"info": b'{"t": "a"}'}) == "a"


@pytest.mark.parametrize("value", [None, [1], {"a": 1}])
def test_json_field_non_scalar_is_an_error(value: object) -> None:
    with pytest.raises(BucketError, match=r"sample 'k9': field 'v' = .* is not a string or number"):
        JsonField("v")("k9", meta(v=value))
    with pytest.raises(BucketError, match=r"sample 'k9': field 'v.w' is missing .*\(no 'w'\)"):
        JsonField("v.w")("k9", meta(v=3))


@pytest.mark.parametrize(
    ("value", "band"),
    [(-5, "<128"), (127.99, "<128"), (128, "128-256"), (255.5, "128-256"), (256, "256-1024"),
     (1023, "256-1024"), (1024, ">=1024"), (10**9, ">=1024")],
)
def test_json_boundaries_edges(value: float, band: str) -> None:
    assert JsonField("n", boundaries=(128, 256, 1024))("k", meta(n=value)) == band


def test_json_boundaries_float_labels_and_errors() -> None:
    fn = JsonField("x", boundaries=(0.5, 1.25))
    assert [fn("k", meta(x=v)) for v in (0.1, 0.5, 1.0, 2)] == ["<0.5", "0.5-1.25", "0.5-1.25", ">=1.25"]
    with pytest.raises(BucketError, match="sample 'z': field 'x' = 'long' is not a finite number"):
        fn("z", meta(x="long"))
    for bad in ((), (2, 1), (1, 1), (1, float("nan")), ("a",)):
        with pytest.raises(ConfigError):
            JsonField("x", boundaries=bad)


@settings(max_examples=200, deadline=None)
@given(
    bounds=st.lists(st.integers(-1000, 1000), min_size=1, max_size=8, unique=True).map(sorted),
    value=st.integers(-2000, 2000),
)
def test_json_band_is_bisect(bounds: list[int], value: int) -> None:
    fn = JsonField("n", boundaries=tuple(bounds))
    labels = [f"<{bounds[0]}"] + [f"{a}-{b}" for a, b in zip(bounds, bounds[1:])] + [f">={bounds[-1]}"]
    assert fn("k", meta(n=value)) == labels[bisect.bisect_right(bounds, value)]


# --- images ----------------------------------------------------------------------------


def test_image_buckets_first_present_member() -> None:
    fn = ImageBuckets(ratios=["1:1", "16:9", "9:16"])
    assert fn.members == ("png", "jpg", "jpeg", "webp") and fn.head_bytes == 65536
    wide, tall = encode("JPEG", 64, 36), encode("PNG", 36, 64)
    assert fn("k", {"jpg": wide, "json": b"{}"}) == "16:9"
    assert fn("k", {"jpg": wide, "png": tall}) == "9:16"  # png is listed first
    assert ImageBuckets(exts=("jpg", "png"), ratios="1:1,16:9,9:16")("k", {"jpg": wide, "png": tall}) == "16:9"
    assert ImageBuckets(step=0.5)("k", {"png": tall}) == "0.5"


def test_image_buckets_errors_name_key() -> None:
    fn = ImageBuckets()
    with pytest.raises(BucketError, match=r"sample 'a/1' has no image member \(looked for .png, .jpg"):
        fn("a/1", {"json": b"{}"})
    with pytest.raises(BucketError, match=r"sample 'a/2': .jpg member: not a PNG"):
        fn("a/2", {"jpg": b"hello world, not an image"})
    with pytest.raises(BucketError, match=r"sample 'a/3': .png member is truncated after 10 bytes"):
        fn("a/3", {"png": encode("PNG", 5, 5)[:10]})


def test_image_buckets_sof_beyond_head_bytes() -> None:
    jpeg = encode("JPEG", 40, 30)
    for _ in range(2):  # two maximal APP2 segments push SOF past 128 KiB
        jpeg = with_segment_after_soi(jpeg, 0xE2, b"ICC_PROFILE\x00" + bytes(65000))
    assert Image.open(io.BytesIO(jpeg)).size == (40, 30)
    fn = ImageBuckets(ratios=["4:3", "1:1"])
    head = {"jpg": jpeg[: fn.head_bytes]}
    assert fn.needs_more(head)
    with pytest.raises(BucketError, match="sample 'big': .jpg member: image size not found in the first 65536"):
        fn("big", head)
    assert not fn.needs_more({"jpg": jpeg})
    assert fn("big", {"jpg": jpeg}) == "4:3"
    assert not fn.needs_more({"jpg": encode("JPEG", 4, 3)})  # short member: complete, no re-read
    assert not ImageBuckets(head_bytes=None).needs_more(head)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"exts": ()}, "non-empty"), ({"exts": "png"}, "non-empty tuple"), ({"head_bytes": 10}, ">= 64"),
     ({"step": -1}, "positive"), ({"exts": ("png", "")}, "member extension")],
)
def test_image_buckets_config_errors(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ImageBuckets(**kwargs)

