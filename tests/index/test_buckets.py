"""Tests of wds_pad.index.buckets and wds_pad.index.imagesize: every built-in on crafted inputs."""

from __future__ import annotations

import bisect
import io
import json
import math
import pickle
import struct

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image, features

from wds_pad.index.imagesize import image_size_or_none
from wds_pad.index.buckets import (
    DEFAULT_RATIOS,
    AspectBuckets,
    BucketFn,
    CallableBuckets,
    ImageBuckets,
    JsonField,
    MappingBuckets,
    SingleBucket,
    check_bucket_key,
    image_size,
    parse_bucket_by,
    parse_ratios,
    wrap_callable,
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


def test_aspect_ratio_forms_normalise_to_labels() -> None:
    fn = AspectBuckets(ratios=["4:3", (16, 9), 1.5, "0.75", " 2.0 : 1 "])
    assert fn.ratios == ("4:3", "16:9", "1.5", "0.75", "2:1")
    assert fn("k", meta(width=149, height=100)) == "1.5"
    assert AspectBuckets(ratios="1:1,2:1").ratios == ("1:1", "2:1")


@pytest.mark.parametrize(
    ("step", "width", "height", "expected"),
    [(0.25, 1920, 1080, "1.75"), (0.25, 100, 100, "1.00"), (0.1, 126, 100, "1.3"), (1, 10, 100, "1"), (0.5, 1, 9, "0.5")],
)
def test_aspect_step_rounding(step: float, width: int, height: int, expected: str) -> None:
    assert AspectBuckets(step=step)("k", meta(width=width, height=height)) == expected


@settings(max_examples=300, deadline=None)
@given(
    ratios=st.lists(st.floats(0.05, 20.0), min_size=1, max_size=12, unique=True).filter(
        lambda rs: all(abs(math.log(a) - math.log(b)) > 1e-9 for i, a in enumerate(rs) for b in rs[:i])
    ),
    width=st.integers(1, 100_000),
    height=st.integers(1, 100_000),
)
def test_aspect_picks_nearest_in_log_space(ratios: list[float], width: int, height: int) -> None:
    fn = AspectBuckets(ratios=ratios)
    label = fn("k", meta(width=width, height=height))
    chosen = ratios[fn.ratios.index(label)]
    target = math.log(width / height)
    assert all(abs(target - math.log(chosen)) <= abs(target - math.log(r)) for r in ratios)


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


def test_parse_ratios() -> None:
    assert parse_ratios("1:1, 4:3,3:4,16:9") == ("1:1", "4:3", "3:4", "16:9")
    assert parse_ratios("1,1.333,0.75") == ("1", "1.333", "0.75")
    for bad in ("", "1:1,,2:1", "a:b", "1:-1"):
        with pytest.raises(ConfigError):
            parse_ratios(bad)


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


# --- mappings --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("m.json", '{"a": "x", "b/c": 3, "d": null}'),
        ("m.tsv", "# key\tbucket\na\tx\n\nb/c\t3\n"),
        ("m.csv", 'a,x\n"b/c",3\n'),
        ("m.txt", "\ufeffa\tx\r\nb/c\t3\r\n"),
    ],
)
def test_mapping_file_formats(tmp_path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    fn = MappingBuckets(str(path))
    assert fn.members == () and fn.head_bytes is None
    assert fn("a", {}) == "x"
    assert fn("b/c", {}) in (3, "3")
    assert fn("d", {}) is None and fn("nope", {}) is None
    desc = fn.describe()
    assert desc["source"] == str(path) and desc["kind"] == "map" and len(desc["sha256"]) == 64
    assert MappingBuckets(path.as_uri())("a", {}) == "x"  # fsspec URL


def test_mapping_in_memory_and_digest() -> None:
    one, two = MappingBuckets({"a": "x"}), MappingBuckets({"a": "y"})
    assert one("a", {}) == "x" and one.describe()["source"] is None
    assert one.describe()["sha256"] != two.describe()["sha256"]
    assert MappingBuckets({"a": np.int64(4)})("a", {}) == 4


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("a\tx\nb\ty\tz\n", "data line 2: expected"),
        ("a\tx\na\ty\n", "key 'a' maps to both 'x' and 'y'"),
        ("# only a comment\n", "non-empty"),
        ("{bad json", "not valid JSON"),
        ("[1, 2]", "non-empty"),
        ('{"a": true}', "bucket key True of type bool"),
    ],
)
def test_mapping_file_errors(tmp_path, text: str, needle: str) -> None:
    path = tmp_path / "m.tsv"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        MappingBuckets(str(path))


def test_mapping_missing_file_names_it(tmp_path) -> None:
    missing = tmp_path / "absent.tsv"
    with pytest.raises(ConfigError, match="cannot read bucket map .*absent.tsv") as err:
        MappingBuckets(str(missing))
    assert isinstance(err.value.__cause__, OSError)
    with pytest.raises(ConfigError):
        MappingBuckets(42)  # type: ignore[arg-type]


# --- user callables --------------------------------------------------------------------


def lang_of(key: str, data: dict[str, bytes]) -> str | None:
    return json.loads(data["json"]).get("lang")


def test_wrap_callable_receives_raw_bytes() -> None:
    seen: list[tuple[str, dict]] = []

    def spy(key: str, data: dict[str, bytes]) -> str:
        seen.append((key, dict(data)))
        return "b"

    fn = wrap_callable(spy, members=("json", "txt"), head_bytes=128)
    assert fn.members == ("json", "txt") and fn.head_bytes == 128
    assert fn("k1", {"json": b'{"a": 1}', "txt": b"hi"}) == "b"
    assert seen == [("k1", {"json": b'{"a": 1}', "txt": b"hi"})]
    assert isinstance(seen[0][1]["json"], bytes)


def test_wrap_callable_results_and_pickling() -> None:
    fn = wrap_callable(lang_of)
    assert fn("k", meta(lang="fr")) == "fr"
    assert fn("k", meta()) is None
    assert fn.describe() == {"kind": "callable", "function": f"{__name__}.lang_of", "members": ["json"], "head_bytes": None}
    assert pickle.loads(pickle.dumps(fn))("k", meta(lang="it")) == "it"
    assert wrap_callable(lambda k, d: np.int32(3))("k", {}) == 3
    assert type(wrap_callable(lambda k, d: np.float32(0.5))("k", {})) is float


def test_wrap_callable_errors_name_the_key() -> None:
    def boom(key: str, data: dict) -> str:
        raise KeyError("width")

    with pytest.raises(BucketError, match=r"sample 's/9': bucket function .*boom raised KeyError: 'width'") as err:
        wrap_callable(boom)("s/9", {})
    assert isinstance(err.value.__cause__, KeyError)
    with pytest.raises(BucketError, match="sample 's/1': bucket key True of type bool"):
        wrap_callable(lambda k, d: True)("s/1", {})
    with pytest.raises(BucketError, match="not a str, int or float"):
        wrap_callable(lambda k, d: ("a", 1))("s/2", {})
    with pytest.raises(BucketError, match="not finite"):
        wrap_callable(lambda k, d: float("inf"))("s/3", {})


@pytest.mark.parametrize(
    ("args", "needle"),
    [(("not callable",), "callable"), ((lang_of, "json"), "string 'json'"), ((lang_of, ("json",), 0), "positive int")],
)
def test_wrap_callable_config_errors(args: tuple, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        wrap_callable(*args)


# --- the CLI spec ----------------------------------------------------------------------


def test_parse_bucket_by_accepted(tmp_path) -> None:
    mapping = tmp_path / "m.tsv"
    mapping.write_text("a\tx\n")
    assert parse_bucket_by("none") == SingleBucket()
    assert parse_bucket_by("aspect") == AspectBuckets()
    assert parse_bucket_by(" aspect:w, h ", ratios="1:1,4:3") == AspectBuckets("w", "h", ratios=("1:1", "4:3"))
    assert parse_bucket_by("aspect", step=0.25) == AspectBuckets(step=0.25)
    assert parse_bucket_by("json:meta.lang") == JsonField("meta.lang")
    assert parse_bucket_by("json:n", boundaries="128, 256,512") == JsonField("n", boundaries=(128, 256, 512))
    assert parse_bucket_by("json:n", boundaries="0.5,1e3").boundaries == (0.5, 1000.0)
    assert parse_bucket_by("IMAGE", ratios="1,1.5") == ImageBuckets(ratios=("1", "1.5"))
    assert parse_bucket_by(f"map:{mapping}")("a", {}) == "x"
    assert parse_bucket_by(f"map:{mapping.as_uri()}")("a", {}) == "x"


@pytest.mark.parametrize(
    ("spec", "options", "needle"),
    [
        ("aspects", {}, "accepted forms: none | aspect"),
        ("", {}, "accepted forms"),
        ("json", {}, "accepted forms"),
        ("json:", {}, "accepted forms"),
        ("map:", {}, "accepted forms"),
        ("none:x", {}, "accepted forms"),
        ("image:png", {}, "accepted forms"),
        ("aspect:w", {}, "accepted forms"),
        ("aspect:w,h,d", {}, "accepted forms"),
        ("none", {"ratios": "1:1"}, "--ratios/--step apply only"),
        ("json:n", {"step": 0.1}, "--ratios/--step apply only"),
        ("aspect", {"boundaries": "1,2"}, "--boundaries applies only"),
        ("json:n", {"boundaries": "1,x"}, "--boundaries '1,x'"),
        ("json:n", {"boundaries": "2,1"}, "strictly increasing"),
        ("aspect", {"ratios": "1:1,,2:1"}, "comma-separated"),
        ("aspect", {"ratios": "1:1", "step": 0.5}, "either ratios or step"),
    ],
)
def test_parse_bucket_by_rejected(spec: str, options: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as err:
        parse_bucket_by(spec, **options)
    assert "\n" not in str(err.value)


# --- the protocol ----------------------------------------------------------------------


def test_builtins_follow_the_protocol(tmp_path) -> None:
    fns = [SingleBucket(), AspectBuckets(), AspectBuckets(step=0.1), JsonField("n", boundaries=(1, 2)),
           ImageBuckets(), MappingBuckets({"a": 1}), wrap_callable(lang_of)]
    for fn in fns:
        assert isinstance(fn, BucketFn)
        assert isinstance(fn.members, tuple) and (fn.head_bytes is None or fn.head_bytes > 0)
        desc = fn.describe()
        assert json.loads(json.dumps(desc)) == desc and isinstance(desc["kind"], str)
        assert pickle.loads(pickle.dumps(fn)) == fn
    assert SingleBucket()("any", {}) == "all"
    assert isinstance(wrap_callable(lang_of), CallableBuckets)


def test_frozen() -> None:
    with pytest.raises(AttributeError):
        AspectBuckets().step = 0.5  # type: ignore[misc]


def test_check_bucket_key() -> None:
    assert check_bucket_key("a", "k") == "a" and check_bucket_key(None, "k") is None
    assert check_bucket_key(np.uint8(3), "k") == 3
    with pytest.raises(BucketError, match="sample 'k': bucket key nan is not finite"):
        check_bucket_key(float("nan"), "k")


_doc_value = st.one_of(st.integers(-3, 4000), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                       st.none(), st.text(max_size=3), st.just(10**400), st.just(2**60))


@settings(max_examples=200, deadline=None)
@given(docs=st.lists(st.one_of(
    st.fixed_dictionaries({"width": _doc_value, "height": _doc_value}),
    st.fixed_dictionaries({"meta": st.fixed_dictionaries({"w": _doc_value, "h": _doc_value})}),
    st.dictionaries(st.sampled_from(["width", "height", "meta.w", "meta.h", "x"]), _doc_value, max_size=4),
    st.lists(st.integers(), max_size=2)), max_size=12),
    raw=st.lists(st.sampled_from([None, b"", b"{", b' {"width": 4, "height": 3} ', b"\xff\xfe{}",
                                  b'{"width": 4, "height": 3} x', b'{"width": 4e400, "height": 1}']), max_size=3),
    fields=st.sampled_from([("width", "height"), ("meta.w", "meta.h")]),
    step=st.none() | st.sampled_from([0.25, 0.1]))
@example(docs=[{"width": 10842130985062.0, "height": 2.4124542225372354e-295}], raw=[],
         fields=("width", "height"), step=0.25)  # a ratio past the float maximum once divided by the step
@example(docs=[{"width": 43368523940248.0, "height": 2.4124542225372354e-295}, {"width": 5e-324, "height": 7}],
         raw=[], fields=("width", "height"), step=None)  # ratios that overflow to inf and underflow to 0
def test_aspect_many_equals_one_call_per_sample(docs, raw, fields, step) -> None:
    """AspectBuckets.many (the indexer's batch path) gives what __call__ gives, sample by
    sample: the same bucket, or an exception of the same type and message."""
    import json as _json

    fn = AspectBuckets(fields[0], fields[1], step=step)
    payloads = [_json.dumps(d).encode() for d in docs] + raw
    keys = [f"k{i}" for i in range(len(payloads))]
    got = fn.many(keys, {"json": payloads})
    for key, payload, result in zip(keys, payloads, got):
        try:
            want = fn(key, {} if payload is None else {"json": payload})
        except Exception as exc:  # noqa: BLE001
            assert type(result) is type(exc) and str(result) == str(exc)
        else:
            assert result == want


_good_number = st.one_of(st.integers(1, 5000), st.floats(0.5, 1e5))


@settings(max_examples=200, deadline=None)
@given(docs=st.lists(st.fixed_dictionaries({"width": _good_number, "height": _good_number}), min_size=1, max_size=10),
       odd=st.sampled_from([None, True, 0, -1.5, float("inf"), "7", [3], 10**400, 1e-320, 1e300]),
       where=st.integers(0, 9), field=st.sampled_from(["width", "height"]),
       tail=st.sampled_from([b"", b" ", b"\n", b" x", b"{}"]), step=st.none() | st.just(0.25))
def test_aspect_many_batch_path_equals_one_call_per_sample(docs, odd, where, field, tail, step) -> None:
    """Columns of plain documents take many()'s whole-column path; one odd value (or
    trailing bytes) anywhere must still give exactly the per-sample results."""
    import json as _json

    fn = AspectBuckets(step=step)
    docs = list(docs)
    if odd is not None:
        docs[where % len(docs)] = {**docs[where % len(docs)], field: odd}
    payloads = [_json.dumps(d).encode() for d in docs]
    payloads[-1] += tail
    keys = [f"k{i}" for i in range(len(payloads))]
    for key, payload, result in zip(keys, payloads, fn.many(keys, {"json": payloads})):
        try:
            want = fn(key, {"json": payload})
        except Exception as exc:  # noqa: BLE001
            assert type(result) is type(exc) and str(result) == str(exc)
        else:
            assert result == want
