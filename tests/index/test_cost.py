"""Costs in the index: ``--cost json:FIELD | image:pixels | bytes`` recorded per sample,
the cost order of each bucket, their storage (narrowest dtype, digest, optional), bad
costs (raise or skip), ``--update``, the merge of parts and a distributed build.

Every recorded cost is compared with what webdataset reads from the same shards.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

import wds_pad.index.build as build_mod
import wds_pad.index.samples as samples_mod
from wds_pad.cli.synth import make_image_shards
from wds_pad.errors import BucketError, ConfigError, IndexFormatError
from wds_pad.index.buckets import ImagePixels, JsonCost, PayloadBytes, parse_cost
from wds_pad.index.build import build_index
from wds_pad.index.codec import load_index, serialize
from wds_pad.index.layout import cost_values
from wds_pad.index.merge import merged_parts
from wds_pad.index.record import ShardInfo
from wds_pad.index.rows import make_index

BUCKET_BY = "aspect:width,height"


def _tar(path: str, samples: list[tuple[str, dict[str, bytes]]]) -> str:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime = len(data), 1_700_000_000
                tf.addfile(info, io.BytesIO(data))
    return path


def _json_tar(path: str, docs: list[object], start: int = 0) -> str:
    return _tar(path, [(f"k{start + i:04d}", {"json": json.dumps(d).encode(), "txt": b"x" * (i % 3)})
                       for i, d in enumerate(docs)])


def _by_key(index) -> dict[str, object]:
    return {index.key(i): index.cost[i].item() for i in range(len(index))}


def _assert_cost_order(index) -> None:
    """Every bucket's cost order: its rows, cheapest first, equal costs by row id."""
    bo = index.bucket_offsets
    for b in range(len(index.buckets)):
        lo, hi = int(bo[b]), int(bo[b + 1])
        rows = index.cost_order(lo, hi)
        want = sorted(range(lo, hi), key=lambda r: (index.cost[r], r))
        assert rows.dtype == np.int64 and rows.tolist() == want
        if hi > lo:
            ks = [0, (hi - lo) // 2, hi - lo - 1]
            assert index.cost_order(lo, hi, ks).tolist() == [want[k] for k in ks]


# -- the cost functions -----------------------------------------------------------------------


def test_parse_cost_forms_and_refusals() -> None:
    assert parse_cost("json:tokens") == JsonCost("tokens") and parse_cost("json:meta.frames").field == "meta.frames"
    assert parse_cost("image:pixels") == ImagePixels() and parse_cost("bytes") == PayloadBytes()
    assert parse_cost(" json:tokens ").describe() == "json:tokens"
    for bad in ("json", "json:", "image", "image:width", "bytes:x", "tokens", "json:a..b"):
        with pytest.raises(ConfigError, match="--cost|dotted field name"):
            parse_cost(bad)
    with pytest.raises(ConfigError, match="a string"):
        parse_cost(3)


def test_cost_values_are_exact_and_as_narrow_as_they_allow() -> None:
    assert cost_values([1, 2, 3]).dtype == np.int64
    assert cost_values([1.0, 2.0]).dtype == np.int64 and cost_values([1.0, 2.0]).tolist() == [1, 2]
    assert cost_values([1, 2.5]).dtype == np.float64
    assert cost_values([2**62 + 1]).tolist() == [2**62 + 1]  # no detour through float64


# -- recorded at build time -----------------------------------------------------------------


def test_json_image_and_bytes_costs_match_what_webdataset_reads(tmp_path) -> None:
    shards = make_image_shards(tmp_path / "s", samples=40, shards=3, seed=2)
    samples = {s["__key__"]: s for s in wds.WebDataset(shards, shardshuffle=False)}
    by_json = build_index(shards, BUCKET_BY, cost="json:width")
    by_pixels = build_index(shards, BUCKET_BY, cost="image:pixels")
    by_bytes = build_index(shards, BUCKET_BY, cost="bytes")
    assert by_json.cost_kind == "json:width" and by_pixels.cost_kind == "image:pixels"
    for key, s in samples.items():
        doc = json.loads(s["json"])
        image = next(s[e] for e in ("png", "jpg") if e in s)
        assert _by_key(by_json)[key] == doc["width"]
        assert _by_key(by_pixels)[key] == Image.open(io.BytesIO(image)).size[0] * Image.open(io.BytesIO(image)).size[1]
        assert _by_key(by_bytes)[key] == sum(len(v) for k, v in s.items() if not k.startswith("__"))
    for index in (by_json, by_pixels, by_bytes):
        _assert_cost_order(index)
    assert by_json.cost.dtype == np.int8 and by_pixels.cost.dtype == np.int16  # widths < 128, pixels < 32768


def test_nested_fields_floats_and_the_narrowest_dtype(tmp_path) -> None:
    a = _json_tar(str(tmp_path / "a.tar"), [{"m": {"t": 3}}, {"m": {"t": 300}}, {"m": {"t": 3}}])
    b = _json_tar(str(tmp_path / "b.tar"), [{"m": {"t": 70000}}], start=10)
    index = build_index([a, b], None, cost="json:m.t")
    assert index.cost.dtype == np.int32 and _by_key(index) == {"k0000": 3, "k0001": 300, "k0002": 3, "k0010": 70000}
    assert build_index([a], None, cost="json:m.t").cost.dtype == np.int16
    assert index.cost_order(0, 4).tolist() == [0, 2, 1, 3]  # equal costs by row id
    c = _json_tar(str(tmp_path / "c.tar"), [{"m": {"t": 1.5}}, {"m": {"t": 2.0}}, {"m": {"t": 0}}])
    floats = build_index([c], None, cost="json:m.t")
    assert floats.cost.dtype == np.float64 and floats.cost.tolist() == [1.5, 2.0, 0.0]


@pytest.mark.parametrize("doc, why", [({"x": 1}, "field 'tokens' is missing"),
                                      ({"tokens": -2}, "is negative"),
                                      ({"tokens": "12"}, "is not a number"),
                                      ({"tokens": True}, "is not a number"),
                                      ({"tokens": None}, "is not a number"),
                                      ({"tokens": float("inf")}, "is not finite")])
def test_a_bad_cost_names_shard_offset_key_and_field_or_is_skipped(tmp_path, doc, why) -> None:
    path = _json_tar(str(tmp_path / "a.tar"), [{"tokens": 5}, doc, {"tokens": 7}])
    with pytest.raises(BucketError, match=rf"cost 'json:tokens' failed for sample 'k0001' in '{path}' at byte "
                                          rf"offset \d+: .*{why}.*--on-error skip"):
        build_index([path], None, cost="json:tokens")
    skipped = build_index([path], None, cost="json:tokens", on_error="skip")
    assert _by_key(skipped) == {"k0000": 5, "k0002": 7}
    assert skipped.excluded["count"] == 1 and skipped.excluded["samples"][0]["key"] == "k0001"
    assert skipped.excluded["samples"][0]["reason"].startswith("cost: ")


def test_a_sample_the_bucket_function_excludes_needs_no_cost(tmp_path) -> None:
    path = _json_tar(str(tmp_path / "a.tar"), [{"lang": "en", "tokens": 4}, {"lang": "xx"}])
    from wds_pad.index.buckets import MappingBuckets

    index = build_index([path], MappingBuckets({"k0000": "en"}), cost="json:tokens")
    assert _by_key(index) == {"k0000": 4} and index.excluded["count"] == 1


def test_an_image_size_past_the_first_bytes_is_read_whole(tmp_path, monkeypatch) -> None:
    """image:pixels reads the header as --bucket-by image does: a JPEG whose size lies
    past head_bytes is read again whole."""
    out = io.BytesIO()
    Image.new("RGB", (40, 30)).save(out, format="JPEG")
    jpeg = out.getvalue()
    for _ in range(2):  # two maximal APP2 segments right after SOI push the size past 128 KiB
        segment = b"ICC_PROFILE\x00" + bytes(65000)
        jpeg = jpeg[:2] + b"\xff\xe2" + (len(segment) + 2).to_bytes(2, "big") + segment + jpeg[2:]
    path = _tar(str(tmp_path / "a.tar"), [("k0", {"jpg": jpeg})])
    reread: list[int] = []
    real = samples_mod._whole_members
    monkeypatch.setattr(samples_mod, "_whole_members", lambda *a: reread.append(1) or real(*a))
    index = build_index([path], None, cost="image:pixels")
    assert index.cost.tolist() == [1200] and reread == [1]


# -- storage ----------------------------------------------------------------------------------


def test_an_index_without_costs_has_no_trace_of_them(tmp_path) -> None:
    shards = make_image_shards(tmp_path / "s", samples=20, shards=2, seed=1)
    plain = build_index(shards, BUCKET_BY, output=str(tmp_path / "plain.wdsidx"))
    raw = Path(tmp_path / "plain.wdsidx").read_bytes()
    assert plain.cost is None and plain.cost_kind is None and b'"cost' not in raw
    with pytest.raises(IndexFormatError, match="has no costs"):
        plain.cost_order(0, len(plain))
    costed = build_index(shards, BUCKET_BY, output=str(tmp_path / "plain.wdsidx"), cost="bytes")
    assert costed.digest != plain.digest  # the costs and their kind are in the digest
    loaded = load_index(str(tmp_path / "plain.wdsidx"))
    assert loaded.cost_kind == "bytes" and loaded.digest == costed.digest
    assert isinstance(loaded.cost.base, (memoryview, bytes)) or loaded.cost.base is not None  # a view of the file
    extra = loaded.bytes_per_sample()
    assert extra["cost"] == loaded.cost.itemsize and extra["cost_order"] == 1.0


def test_a_changed_cost_byte_fails_the_digest(tmp_path) -> None:
    path = _json_tar(str(tmp_path / "a.tar"), [{"tokens": i} for i in range(9)])
    out = str(tmp_path / "i.wdsidx")
    index = build_index([path], None, output=out, cost="json:tokens")
    data = bytearray(Path(out).read_bytes())
    header = load_index(out)
    section = json.loads(bytes(data[24: 24 + int.from_bytes(data[16:24], "little")]))["sections"]["cost"]
    base = 24 + int.from_bytes(data[16:24], "little")
    base += -base % 64
    data[base + section["offset"] + 3] ^= 1
    Path(out).write_bytes(bytes(data))
    with pytest.raises(IndexFormatError, match="content digest mismatch"):
        load_index(out)
    assert header.digest == index.digest


def test_cost_order_refuses_a_range_that_is_not_a_bucket(tmp_path) -> None:
    a = _json_tar(str(tmp_path / "a.tar"), [{"w": 1 + i % 2, "tokens": 9 - i} for i in range(6)])
    index = build_index([a], "json:w", cost="json:tokens")
    assert list(index.buckets) == [1, 2]
    with pytest.raises(ConfigError, match="not the row range of one bucket"):
        index.cost_order(0, 2)
    with pytest.raises(ConfigError, match="rank out of range"):
        index.cost_order(0, 3, [3])
    _assert_cost_order(index)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 3), st.one_of(st.integers(0, 5), st.integers(0, 2**40),
                                                           st.floats(0, 10, allow_nan=False))),
                     max_size=40))
def test_cost_order_property_over_random_costs(rows) -> None:
    """For any bucket assignment and costs: each bucket's cost order is its rows sorted
    by cost, equal costs by row id; the k-th cheapest is O(1); the dtype is exact."""
    n = len(rows)
    shards = [ShardInfo(url="/x/a.tar", size=1, stamp="", samples=n)]
    arrays = {"shard": np.zeros(n, np.int32), "offset": np.arange(n, dtype=np.int64) * 512,
              "length": np.full(n, 512, np.int64), "bucket": np.asarray([b for b, _ in rows], np.int64),
              "exts": np.zeros(n, np.uint64), "cost": cost_values([c for _, c in rows])}
    index = make_index(shards, arrays, [0, 1, 2, 3], [f"k{i}" for i in range(n)], bucket_by={"kind": "x"},
                       exts=(), cost_kind="json:t")
    want = cost_values([c for _, c in rows])
    assert sorted(_by_key(index).items()) == sorted((f"k{i}", want[i].item()) for i in range(n))
    _assert_cost_order(index)
    if all(isinstance(c, int) for _, c in rows):
        assert index.cost.dtype.kind == "i" and index.cost.dtype.itemsize <= 8


def test_make_index_refuses_a_negative_or_infinite_cost() -> None:
    shards = [ShardInfo(url="/x/a.tar", size=1, stamp="", samples=1)]
    for bad in (-1, float("nan")):
        arrays = {"shard": np.zeros(1, np.int32), "offset": np.zeros(1, np.int64), "length": np.full(1, 512),
                  "bucket": np.zeros(1, np.int64), "exts": np.zeros(1, np.uint64), "cost": np.asarray([bad])}
        with pytest.raises(ConfigError, match="non-negative finite"):
            make_index(shards, arrays, ["all"], ["k"], bucket_by={"kind": "none"}, exts=(), cost_kind="json:t")


# -- update, merge, distributed ----------------------------------------------------------------


def test_update_keeps_costs_rescans_changed_shards_and_refuses_another_cost(tmp_path, monkeypatch) -> None:
    paths = [_json_tar(str(tmp_path / f"s{i}.tar"), [{"tokens": 10 * i + j} for j in range(4)], start=10 * i)
             for i in range(3)]
    out = str(tmp_path / "i.wdsidx")
    build_index(paths[:2], None, output=out, cost="json:tokens")
    scanned: list[str] = []
    real = build_mod.scan_many
    monkeypatch.setattr(build_mod, "scan_many", lambda sources, **kw: scanned.extend(u for _, u, *_ in sources)
                        or real(sources, **kw))
    _json_tar(paths[1], [{"tokens": 100 + j} for j in range(4)], start=10)  # changed: new costs
    os.utime(paths[1], (1_800_000_000, 1_800_000_000))
    updated = build_index(paths, None, output=out, update=out, cost="json:tokens")
    assert sorted(scanned) == sorted(paths[1:])  # the unchanged shard's rows and costs are reused
    assert _by_key(updated)["k0010"] == 100 and _by_key(updated)["k0000"] == 0
    full = build_index(paths, None, output=str(tmp_path / "full.wdsidx"), cost="json:tokens", name="i")
    assert Path(out).read_bytes() == Path(tmp_path / "full.wdsidx").read_bytes()
    with pytest.raises(ConfigError, match=r"recorded costs 'json:tokens', this update asks for --cost bytes"):
        build_index(paths, None, output=out, update=out, cost="bytes")
    with pytest.raises(ConfigError, match=r"recorded costs 'json:tokens', this update asks for no --cost"):
        build_index(paths, None, output=out, update=out)
    assert full.cost_kind == "json:tokens"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shards=st.lists(st.lists(st.tuples(st.integers(0, 2), st.one_of(st.integers(0, 4), st.integers(0, 300),
                                                                       st.sampled_from([0.5, 2.25]))),
                                max_size=6), min_size=1, max_size=6),
       cuts=st.lists(st.integers(1, 4), max_size=3))
def test_merged_parts_with_costs_are_byte_identical_to_one_build(shards, cuts) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        urls, n = [], 0
        for s, samples in enumerate(shards):
            docs = [{"label": label, "tokens": tokens} for label, tokens in samples]
            urls.append(_json_tar(f"{tmp}/shard-{s:03d}.tar", docs, start=n))
            n += len(docs)
        whole = build_index(urls, "json:label", name="train", cost="json:tokens")
        bounds = sorted({0, len(urls), *[c for c in np.cumsum(cuts) if c < len(urls)]})
        parts = [build_index(urls[lo:hi], "json:label", name="part", cost="json:tokens")
                 for lo, hi in zip(bounds, bounds[1:])]
        got = b"".join(bytes(p) for p in merged_parts(parts, name="train"))
        assert got == b"".join(bytes(p) for p in serialize(whole))


def test_merge_refuses_parts_with_different_costs(tmp_path) -> None:
    a = _json_tar(str(tmp_path / "a.tar"), [{"tokens": 1}])
    b = _json_tar(str(tmp_path / "b.tar"), [{"tokens": 2}], start=5)
    with pytest.raises(IndexFormatError, match="record different costs"):
        list(merged_parts([build_index([a], None, cost="json:tokens"), build_index([b], None)], name="x"))


def test_a_distributed_build_keeps_costs_and_their_order(tmp_path) -> None:
    import torch.distributed as dist

    from dist_helpers import free_port
    from wds_pad.index.distributed import build_index_distributed

    shards = make_image_shards(tmp_path / "shards", samples=60, shards=6, seed=5)
    out = str(tmp_path / "train.wdsidx")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        index = build_index_distributed(shards, BUCKET_BY, output=out, part_shards=2, cost="image:pixels")
    finally:
        dist.destroy_process_group()
    single = build_index(shards, BUCKET_BY, name="train", cost="image:pixels").located(out)
    assert Path(out).read_bytes() == b"".join(bytes(p) for p in serialize(single))
    assert index.cost_kind == "image:pixels" and index.digest == single.digest
    _assert_cost_order(index)
