"""build_index end to end on generated shards: grouping, buckets, update, errors (verify: test_verify.py)."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile

import fsspec
import numpy as np
import pytest
import webdataset as wds

import wds_pad.index.build as indexer_mod
from wds_pad.cli.synth import make_blob_shards, make_image_shards
from wds_pad.index.buckets.spec import parse_bucket_by
from wds_pad.index.buckets import AspectBuckets, ImageBuckets, JsonField, wrap_callable
from wds_pad.errors import BucketError, ConfigError, ShardError, TarFormatError
from wds_pad.index.codec import load_index
from wds_pad.index.build import build_index, expand_urls
from wds_pad.index.verify import verify_index  # a built index verifies clean
from wds_pad.tar.scan import parse_sample

pytest_plugins = ["conftest_servers"]

# -- helpers ------------------------------------------------------------------------------


def wds_samples(urls: list[str]) -> list[dict]:
    """What webdataset itself yields for these shards, in order."""
    return list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))


def payloads(sample: dict) -> dict[str, bytes]:
    return {k: v for k, v in sample.items() if not k.startswith("__")}


def read_range(url: str, offset: int, length: int) -> bytes:
    with open(url, "rb") as f:
        f.seek(offset)
        return f.read(length)


def make_tar(path: str, members: list[tuple[str, bytes]], fmt: int = tarfile.GNU_FORMAT) -> str:
    """A tar of regular members ``(name, payload)``; a name ending in '/' is a directory."""
    with tarfile.open(path, "w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name.rstrip("/"))
            info.mtime = 1_700_000_000
            if name.endswith("/"):
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


def offsets_of(url: str) -> dict[str, int]:
    """Header offset of every member, by name (tarfile's view)."""
    with tarfile.open(url) as tf:
        return {m.name: m.offset for m in tf.getmembers()}


def rows_of(index, si: int) -> list[tuple]:
    """Shard ``si``'s rows in byte order (an index groups its rows by bucket)."""
    ids = np.flatnonzero(index.shard == si)
    ids = ids[np.argsort(index.offset[ids], kind="stable")]
    return [(index.key(int(i)), int(index.offset[i]), int(index.length[i]), index.buckets[int(index.bucket[i])],
             index.sample_exts(int(i))) for i in ids]


@pytest.fixture(scope="module")
def image_shards(tmp_path_factory) -> list[str]:
    return make_image_shards(tmp_path_factory.mktemp("img"), samples=60, shards=3, seed=3)


@pytest.fixture()
def shards(tmp_path) -> list[str]:
    return make_image_shards(tmp_path / "shards", samples=45, shards=3, seed=5)


def json_of(urls: list[str]) -> dict[str, dict]:
    return {s["__key__"]: json.loads(s["json"]) for s in wds_samples(urls)}


# -- grouping matches webdataset --------------------------------------------------------------
def test_grouping_and_ranges_match_webdataset(image_shards) -> None:
    index = build_index(image_shards, workers=2)
    ref = wds_samples(image_shards)
    assert [index.key(i) for i in range(len(index))] == [s["__key__"] for s in ref]
    assert [index.url(i) for i in range(len(index))] == [os.path.abspath(s["__url__"]) for s in ref]
    for i, sample in enumerate(ref):
        off, n = int(index.offset[i]), int(index.length[i])
        got = parse_sample(read_range(index.url(i), off, n), index.url(i), off, key=index.key(i))
        assert got == payloads(sample)
        assert set(index.sample_exts(i)) == set(payloads(sample))


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_grouping_of_awkward_archives_matches_webdataset(tmp_path, fmt) -> None:
    long_dir = "deep/" + "d" * 60 + "/" + "e" * 30  # > 100 chars with the file name
    members = [
        ("dir/", b""),
        ("dir/a.jpg", b"A-jpg"), ("dir/a.json", b'{"w": 1}'),
        ("b.seg.png", b"B-seg"), ("b.json", b"{}"),
        ("README", b"no extension: skipped"),
        ("__meta__", b"metadata: skipped"),
        ("C.JPG", b"upper-case suffix"), ("C.txt", b"c"),
        (f"{long_dir}/sample.txt", b"long"), (f"{long_dir}/sample.cls", b"7"),
        ("empty.txt", b""),
        ("ü/ñ.txt", b"unicode"),
    ]
    if fmt == tarfile.USTAR_FORMAT:
        members = [m for m in members if len(m[0].encode()) <= 100 and m[0].isascii()]
    url = make_tar(str(tmp_path / "awkward.tar"), members, fmt)
    index = build_index([url], workers=1)
    ref = wds_samples([url])
    assert [index.key(i) for i in range(len(index))] == [s["__key__"] for s in ref]
    assert len(ref) >= 4
    for i, sample in enumerate(ref):
        off, n = int(index.offset[i]), int(index.length[i])
        assert parse_sample(read_range(url, off, n), url, off) == payloads(sample)


def test_empty_shard_is_valid_with_zero_samples(tmp_path, image_shards) -> None:
    empty = make_tar(str(tmp_path / "empty.tar"), [])
    index = build_index([empty, image_shards[0]], workers=2, output=str(tmp_path / "i.wdsidx"))
    assert index.shards[0].samples == 0 and index.shards[0].error is None
    assert len(index) == index.shards[1].samples > 0
    only = build_index([empty], output=str(tmp_path / "e.wdsidx"))
    assert len(only) == 0 and only.buckets == () and only.excluded["shards"] == []
    assert len(load_index(str(tmp_path / "e.wdsidx"))) == 0


# -- bucket functions end to end ------------------------------------------------------------
def test_aspect_buckets_from_json(image_shards) -> None:
    index = build_index(image_shards, "aspect", workers=2)
    meta = json_of(image_shards)
    for i in range(len(index)):
        assert index.buckets[int(index.bucket[i])] == meta[index.key(i)]["ratio"]
    assert dict(index.bucket_by)["kind"] == "aspect" and index.excluded["count"] == 0
    # explicit fields and ratios through the CLI-style spec
    coarse = build_index(image_shards, parse_bucket_by("aspect:width,height", ratios="1:1,16:9"), workers=1)
    assert set(coarse.buckets) <= {"1:1", "16:9"}
    want = {k: ("16:9" if m["width"] / m["height"] >= 4 / 3 * 1.01 else "1:1") for k, m in meta.items()
            if m["ratio"] in ("1:1", "16:9")}
    for i in range(len(coarse)):
        if coarse.key(i) in want:
            assert coarse.buckets[int(coarse.bucket[i])] == want[coarse.key(i)]


def test_image_buckets_read_image_headers(image_shards) -> None:
    by_image = build_index(image_shards, ImageBuckets(), workers=2)
    by_json = build_index(image_shards, AspectBuckets(), workers=2)
    np.testing.assert_array_equal(by_image.bucket, by_json.bucket)
    assert by_image.buckets == by_json.buckets and len(by_image.buckets) == 5


def test_image_buckets_reread_when_size_is_beyond_head_bytes(tmp_path) -> None:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (48, 27)).save(buf, format="JPEG")
    jpeg = buf.getvalue()
    app = b"\xff\xef" + (65533 + 2).to_bytes(2, "big") + b"\0" * 65533  # a 64 KiB APP15 segment
    big = jpeg[:2] + app + app + jpeg[2:]  # SOF now lies ~128 KiB in
    url = make_tar(str(tmp_path / "big.tar"), [("a.jpg", big), ("b.jpg", jpeg)])
    index = build_index([url], ImageBuckets(head_bytes=1024), workers=1)
    assert [index.buckets[int(b)] for b in index.bucket] == ["16:9", "16:9"]


def test_json_length_bands(image_shards) -> None:
    index = build_index(image_shards, parse_bucket_by("json:width", boundaries="32,48"), workers=2)
    meta = json_of(image_shards)

    def band(w: int) -> str:
        return "<32" if w < 32 else ("32-48" if w < 48 else ">=48")

    for i in range(len(index)):
        assert index.buckets[int(index.bucket[i])] == band(meta[index.key(i)]["width"])
    raw = build_index(image_shards, JsonField("label"), workers=1)
    assert set(raw.buckets) == set(range(10))


def test_map_file_buckets_exclude_unmapped_keys(tmp_path, image_shards) -> None:
    keys = [s["__key__"] for s in wds_samples(image_shards)]
    mapped = {k: ("even" if int(k) % 2 == 0 else "odd") for k in keys[::3]}
    path = tmp_path / "buckets.tsv"
    path.write_text("# key\tbucket\n" + "".join(f"{k}\t{b}\n" for k, b in mapped.items()))
    index = build_index(image_shards, f"map:{path}", workers=2)
    assert {index.key(i): index.buckets[int(index.bucket[i])] for i in range(len(index))} == mapped
    excl = index.excluded
    assert excl["count"] == len(keys) - len(mapped) == len(excl["samples"])
    assert {e["key"] for e in excl["samples"]} == set(keys) - set(mapped)
    assert all(e["reason"] == "bucket function returned None" for e in excl["samples"])


def test_none_is_one_bucket(image_shards) -> None:
    index = build_index(image_shards, None, workers=1)
    assert index.buckets == ("all",) and index.bucket_counts() == {"all": 60}
    assert build_index(image_shards, "none").digest == index.digest


def label_bucket(key: str, data: dict) -> int | None:
    label = json.loads(data["json"])["label"]
    return None if label == 9 else label % 3


def test_python_callable(image_shards) -> None:
    index = build_index(image_shards, label_bucket, workers=2)
    meta = json_of(image_shards)
    assert set(index.buckets) == {0, 1, 2}
    for i in range(len(index)):
        assert index.buckets[int(index.bucket[i])] == meta[index.key(i)]["label"] % 3
    assert index.excluded["count"] == sum(m["label"] == 9 for m in meta.values())
    assert dict(index.bucket_by)["function"].endswith("label_bucket")
    same = build_index(image_shards, wrap_callable(label_bucket, members=("json",)))
    np.testing.assert_array_equal(same.bucket, index.bucket)


# -- determinism, update ----------------------------------------------------------------------
def test_workers_do_not_change_the_index_file(tmp_path, shards) -> None:
    missing = str(tmp_path / "shards" / "missing.tar")
    bad = str(tmp_path / "shards" / "bad.tar")
    with open(bad, "wb") as f:
        f.write(b"not a tar at all" * 64)
    urls = [shards[0], missing, shards[1], bad, shards[2]]
    paths = []
    for workers in (1, 4):
        out = str(tmp_path / f"w{workers}" / "idx.wdsidx")
        build_index(urls, "aspect", output=out, workers=workers, on_error="skip")
        paths.append(out)
    one, four = (open(p, "rb").read() for p in paths)
    assert one == four
    idx = load_index(paths[0])
    assert [s["url"] for s in idx.excluded["shards"]] == [missing, bad]


def test_update_rescans_only_changed_and_new_shards(tmp_path, shards, monkeypatch) -> None:
    out = str(tmp_path / "idx.wdsidx")
    first = build_index(shards[:2], "aspect", output=out)
    scanned: list[str] = []
    real = indexer_mod.scan_many

    def counting(sources, **kw):
        scanned.extend(url for _, url, *_ in sources)
        return real(sources, **kw)

    monkeypatch.setattr(indexer_mod, "scan_many", counting)
    same = build_index(shards[:2], "aspect", output=out, update=out)
    assert scanned == [] and same.digest == first.digest

    st = os.stat(shards[1])
    os.utime(shards[1], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touch: new change stamp
    second = build_index(shards, "aspect", output=out, update=out, workers=2)
    assert sorted(scanned) == sorted([shards[1], shards[2]])  # the touched one and the new one
    assert rows_of(second, 0) == rows_of(first, 0) and rows_of(second, 1) == rows_of(first, 1)
    assert second.digest != first.digest

    # replace one shard's content: only it is rescanned, the rest is reused verbatim
    scanned.clear()
    other = make_image_shards(tmp_path / "other", samples=10, shards=1, seed=99)[0]
    shutil.copyfile(other, shards[0])
    third = build_index(shards, "aspect", output=out, update=out)
    assert scanned == [shards[0]]
    assert rows_of(third, 1) == rows_of(second, 1) and rows_of(third, 2) == rows_of(second, 2)
    assert [r[0] for r in rows_of(third, 0)] == [s["__key__"] for s in wds_samples([shards[0]])]
    assert third.digest != second.digest
    # an update gives exactly what a full rebuild gives (written beside it: the shard
    # URLs are stored relative to the index's folder)
    full = build_index(shards, "aspect", output=str(tmp_path / "full.wdsidx"), name="idx")
    assert open(out, "rb").read() == open(str(tmp_path / "full.wdsidx"), "rb").read()
    assert full.digest == third.digest


def test_update_refuses_another_bucket_function(tmp_path, shards) -> None:
    out = str(tmp_path / "idx.wdsidx")
    build_index(shards, "aspect", output=out)
    with pytest.raises(ConfigError, match="rebuild without --update"):
        build_index(shards, "none", output=out, update=out)


@pytest.mark.parametrize("workers", [1, 3])
def test_interrupted_build_leaves_old_index_or_nothing(tmp_path, shards, monkeypatch, workers) -> None:
    real = indexer_mod.scan_many

    def dies_on_last(sources, **kw):
        if any(url == shards[-1] for _, url, *_ in sources):
            raise KeyboardInterrupt
        return real(sources, **kw)

    monkeypatch.setattr(indexer_mod, "scan_many", dies_on_last)
    fresh = tmp_path / "fresh" / "idx.wdsidx"
    with pytest.raises(KeyboardInterrupt):
        build_index(shards, output=str(fresh), workers=workers)
    assert not fresh.exists()

    out = tmp_path / "idx.wdsidx"
    monkeypatch.setattr(indexer_mod, "scan_many", real)
    build_index(shards[:2], output=str(out))
    before = out.read_bytes()
    monkeypatch.setattr(indexer_mod, "scan_many", dies_on_last)
    with pytest.raises(KeyboardInterrupt):
        build_index(shards, output=str(out), workers=workers)
    assert out.read_bytes() == before and len(load_index(str(out))) > 0
    assert sorted(os.listdir(tmp_path)) == ["idx.wdsidx", "shards"]  # no temp file, no empty dir


# -- bad input -------------------------------------------------------------------------------
def _corrupt_checksum(src: str, dst: str, member: str) -> int:
    data = bytearray(open(src, "rb").read())
    off = offsets_of(src)[member]
    data[off + 20] ^= 0x55  # inside the name field: the header checksum no longer matches
    open(dst, "wb").write(bytes(data))
    return off


def test_missing_shard(tmp_path, shards) -> None:
    missing = str(tmp_path / "shards" / "nope.tar")
    with pytest.raises(ShardError, match=rf"{missing}.*does not exist"):
        build_index([shards[0], missing])
    idx = build_index([shards[0], missing], on_error="skip")
    assert len(idx) == idx.shards[0].samples > 0
    assert idx.shards[1].error and idx.shards[1].samples == 0
    assert idx.excluded["shards"] == [{"url": missing, "reason": idx.shards[1].error, "samples_kept": 0}]


@pytest.mark.parametrize("content", [b"plain text, not a tar " * 40, b""])
def test_not_a_tar(tmp_path, shards, content) -> None:
    bad = str(tmp_path / "bad.tar")
    open(bad, "wb").write(content)
    with pytest.raises(TarFormatError, match=rf"{bad}: .*not a tar archive.*at byte offset 0"):
        build_index([shards[0], bad])
    idx = build_index([shards[0], bad], on_error="skip")
    assert len(idx) == idx.shards[0].samples
    assert idx.excluded["shards"][0]["url"] == bad and "not a tar" in idx.excluded["shards"][0]["reason"]


def test_corrupt_header_checksum(tmp_path, shards) -> None:
    members = list(offsets_of(shards[1]))
    victim = members[6]  # the fourth sample's first member
    bad = str(tmp_path / "corrupt.tar")
    off = _corrupt_checksum(shards[1], bad, victim)
    with pytest.raises(TarFormatError, match=rf"{bad}: invalid tar header \(bad header checksum\) at byte offset {off}"):
        build_index([bad])
    idx = build_index([shards[0], bad], on_error="skip")
    keys_before = [s["__key__"] for s in wds_samples([shards[1]])][:2]  # complete before the fault
    assert [r[0] for r in rows_of(idx, 1)] == keys_before
    skipped = idx.excluded["shards"]
    assert len(skipped) == 1 and skipped[0]["url"] == bad and skipped[0]["samples_kept"] == 2
    assert f"byte offset {off}" in skipped[0]["reason"]
    assert idx.shards[1].error is not None and idx.shards[1].samples == 2


def test_truncated_archive(tmp_path, shards) -> None:
    data = open(shards[2], "rb").read()
    with tarfile.open(shards[2]) as tf:
        member = max(tf.getmembers(), key=lambda m: m.offset)  # the last one
    payload = member.offset_data  # after its headers, whichever the producer wrote (pax, ustar)
    bad = str(tmp_path / "truncated.tar")
    open(bad, "wb").write(data[: payload + 5])  # headers of the last member, 5 bytes of payload
    name = member.name
    with pytest.raises(TarFormatError, match=rf"{bad}: truncated.*at byte offset {payload}.*{name}"):
        build_index([bad])
    idx = build_index([bad], on_error="skip")
    n = len(wds_samples([shards[2]]))
    assert len(idx) == n - 1  # every sample but the cut one
    assert "truncated" in idx.excluded["shards"][0]["reason"]


def failing_bucket(key: str, data: dict) -> str:
    if key.endswith("7"):
        raise ValueError("no good")
    return "ok"


def test_bucket_function_that_raises(shards) -> None:
    ref = wds_samples(shards)
    bad = next(s for s in ref if s["__key__"].endswith("7"))
    url = os.path.abspath(bad["__url__"])
    first = offsets_of(url)[next(n for n in offsets_of(url) if n.startswith(bad["__key__"] + "."))]
    with pytest.raises(BucketError, match=rf"{bad['__key__']}.*{url}.*byte offset {first}.*no good"):
        build_index(shards, failing_bucket, workers=1)
    idx = build_index(shards, failing_bucket, on_error="skip", workers=2)
    sevens = [s["__key__"] for s in ref if s["__key__"].endswith("7")]
    assert len(idx) == len(ref) - len(sevens)
    assert [e["key"] for e in idx.excluded["samples"]] == sevens
    assert idx.excluded["count"] == len(sevens)
    assert idx.excluded["samples"][0]["offset"] == first and "no good" in idx.excluded["samples"][0]["reason"]


def test_json_that_does_not_parse(tmp_path) -> None:
    url = make_tar(str(tmp_path / "j.tar"), [
        ("a.json", b'{"width": 4, "height": 3}'), ("a.txt", b"x"),
        ("b.json", b'{"width": 4, "hei'), ("b.txt", b"y"),
        ("c.json", b'{"width": 1, "height": 1}'),
    ])
    off = offsets_of(url)["b.json"]
    with pytest.raises(BucketError, match=rf"'b'.*{url}.*byte offset {off}.*not valid JSON"):
        build_index([url], "aspect")
    idx = build_index([url], "aspect", on_error="skip")
    assert {idx.key(i): idx.buckets[idx.bucket[i]] for i in range(len(idx))} == {"a": "4:3", "c": "1:1"}
    assert idx.buckets == ("1:1", "4:3")
    assert idx.excluded["samples"][0]["key"] == "b" and idx.excluded["samples"][0]["offset"] == off


# -- URLs, memory filesystem ------------------------------------------------------------------
def test_expand_urls() -> None:
    assert expand_urls("s3://b/t-{0..2}.tar") == ["s3://b/t-0.tar", "s3://b/t-1.tar", "s3://b/t-2.tar"]
    assert expand_urls(["rel.tar"]) == [os.path.abspath("rel.tar")]
    with pytest.raises(ConfigError, match="listed twice"):
        expand_urls(["s3://b/a.tar", "s3://b/{a,a}.tar"])


def test_memory_filesystem_shards_and_output(image_shards) -> None:
    fs = fsspec.filesystem("memory")
    try:
        for i, path in enumerate(image_shards):
            fs.pipe_file(f"/wds_pad_test_shards/shard-{i:06d}.tar", open(path, "rb").read())
        out = "memory://wds_pad_test_shards/idx.wdsidx"
        remote = build_index("memory://wds_pad_test_shards/shard-{000000..000002}.tar", "aspect",
                             output=out, workers=2)
        local = build_index(image_shards, "aspect")
        for k in ("offset", "length", "bucket_offsets", "exts", "keys", "key_offsets"):
            np.testing.assert_array_equal(remote.arrays[k], local.arrays[k])
        assert remote.urls[0] == "memory://wds_pad_test_shards/shard-000000.tar"
        back = load_index(out)
        assert back.digest == remote.digest and len(back) == 60
        assert verify_index(back) == [] and verify_index(back, deep=True) == []
    finally:
        fs.rm("/wds_pad_test_shards", recursive=True)


def test_blob_shards_byte_ranges_hold_their_sample(tmp_path) -> None:
    urls = make_blob_shards(tmp_path, samples=40, sample_bytes=3000, shards=2)
    index = build_index(urls, "aspect")
    for i in range(len(index)):
        off, n = int(index.offset[i]), int(index.length[i])
        sample = parse_sample(read_range(index.url(i), off, n), index.url(i), off, key=index.key(i))
        assert int.from_bytes(sample["bin"][:8], "little") == int(index.key(i))


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="on_error"):
        build_index(["x.tar"], on_error="ignore")
    with pytest.raises(ConfigError, match="workers"):
        build_index(["x.tar"], workers=0)
    with pytest.raises(ConfigError, match="bucket_by"):
        build_index(["x.tar"], bucket_by=42)


def test_image_size_beyond_head_bytes_rereads_the_sample(tmp_path) -> None:
    """A JPEG whose size marker lies past head_bytes: the indexer reads the sample's
    range again and buckets by the true size, in seek and in stream mode."""
    from PIL import Image

    def jpeg(w: int, h: int, pad: int) -> bytes:
        out = io.BytesIO()
        Image.new("RGB", (w, h), (9, 9, 9)).save(out, "JPEG")
        data = out.getvalue()
        segment = b"ICC_PROFILE\x00" + bytes(pad)  # an APP2 segment right after SOI
        return data[:2] + b"\xff\xe2" + (len(segment) + 2).to_bytes(2, "big") + segment + data[2:]

    path = make_tar(str(tmp_path / "big.tar"), [("a.jpg", jpeg(40, 30, 60000)), ("a.json", b"{}"),
                                                ("b.jpg", jpeg(30, 30, 10)), ("c.jpg", jpeg(30, 40, 60000))])
    fn = ImageBuckets(ratios=["4:3", "1:1", "3:4"], head_bytes=1024)
    for url in (path, "file://" + path):  # file:// streams through fsspec
        index = build_index([url], fn)
        got = {index.key(i): index.buckets[b] for i, b in enumerate(index.bucket)}
        assert got == {"a": "4:3", "b": "1:1", "c": "3:4"}


@pytest.mark.parametrize("workers", [1, 3])
def test_skip_leaves_out_a_shard_whose_read_fails_midway(shards, monkeypatch, workers) -> None:
    """on_error="skip": a shard whose stream fails part way is recorded as skipped, and
    the shards scanned with it in the same group keep exactly their rows."""

    class Failing(io.RawIOBase):
        def __init__(self, path: str) -> None:
            self._f, self.read_so_far = open(path, "rb"), 0

        def readable(self) -> bool:
            return True

        def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
            if self.read_so_far > 3000:
                raise OSError("connection reset by peer")
            got = self._f.readinto(b)
            self.read_so_far += got
            return got

        def close(self) -> None:
            self._f.close()
            super().close()

    real = indexer_mod.open_for_scan
    bad = shards[1]
    monkeypatch.setattr(indexer_mod, "open_for_scan",
                        lambda url, so, **kw: (Failing(url), False) if url == bad else real(url, so, **kw))
    index = build_index(shards, "aspect", on_error="skip", workers=workers)
    assert [s["url"] for s in index.excluded["shards"]] == [bad]
    assert "connection reset" in index.excluded["shards"][0]["reason"]
    monkeypatch.setattr(indexer_mod, "open_for_scan", real)
    good = build_index([shards[0], shards[2]], "aspect")
    assert [rows_of(index, 0), rows_of(index, 2)] == [rows_of(good, 0), rows_of(good, 1)]
    with pytest.raises(ShardError, match="connection reset"):
        monkeypatch.setattr(indexer_mod, "open_for_scan",
                            lambda url, so, **kw: (Failing(url), False) if url == bad else real(url, so, **kw))
        build_index(shards, "aspect", workers=workers)


# -- globs, raw exceptions, messages -----------------------------------------------------------
def test_glob_patterns_local(tmp_path, shards, monkeypatch) -> None:
    """`*`, `?`, `[...]` match sorted files; braces expand first, then each result globs;
    directories are left out of a glob; a relative pattern comes out absolute."""
    root = os.path.dirname(shards[0])
    (tmp_path / "shards" / "sub").mkdir()  # a directory: never a match
    ref = build_index(sorted(shards))
    for pattern in (f"{root}/*.tar", f"{root}/shard-00000?.tar", f"{root}/shard-00000[0-2].tar",
                    f"{root}/shard-{{000000,000001,000002}}*"):
        index = build_index(pattern)
        assert list(index.urls) == sorted(shards) and index.digest == ref.digest, pattern
    assert expand_urls(f"{root}/shard-{{000002,000000}}.t?r") == [shards[2], shards[0]]  # brace order kept
    assert expand_urls(f"{root}/**/*.tar") == sorted(shards)
    monkeypatch.chdir(tmp_path)
    assert expand_urls("shards/*.tar") == sorted(shards)
    odd = make_tar(str(tmp_path / "odd[1].tar"), [("a.txt", b"1")])  # an existing name is taken literally
    assert expand_urls(odd) == [odd]


def test_glob_that_matches_nothing_or_cannot_list(tmp_path, shards) -> None:
    root = os.path.dirname(shards[0])
    with pytest.raises(ShardError, match=rf"shard pattern '{root}/nope-\*\.tar' matches no files; check the directory"):
        build_index(f"{root}/nope-*.tar")
    with pytest.raises(ShardError, match=r"matches no files"):
        build_index([shards[0], f"{root}/x[0-9].tar"])
    with pytest.raises(ConfigError, match=r"https:// cannot list files; globs need a listable store"):
        expand_urls("https://example.com/train-*.tar")
    assert expand_urls("https://example.com/a.tar?X-Sig=1") == ["https://example.com/a.tar?X-Sig=1"]  # a query
    with pytest.raises(ConfigError, match="listed twice"):
        expand_urls([shards[0], f"{root}/*.tar"])


def test_glob_on_s3(moto_server, s3_bucket, shards) -> None:
    """A glob lists the bucket (sorted), combined with braces; a prefix is no shard."""
    for i, path in enumerate(shards):
        moto_server.upload(path, f"s3://{s3_bucket}/train/shard-{i:03d}.tar")
    moto_server.upload(shards[0], f"s3://{s3_bucket}/val/shard-000.tar")
    opts = moto_server.storage_options
    want = [f"s3://{s3_bucket}/train/shard-{i:03d}.tar" for i in range(3)]
    index = build_index(f"s3://{s3_bucket}/train/*.tar", storage_options=opts)
    assert list(index.urls) == want and len(index) == len(build_index(shards))
    assert expand_urls(f"s3://{s3_bucket}/{{val,train}}/shard-00[01].tar", opts) == [
        f"s3://{s3_bucket}/val/shard-000.tar", *want[:2]]
    with pytest.raises(ShardError, match=rf"shard pattern 's3://{s3_bucket}/test/\*\.tar' matches no files"):
        build_index(f"s3://{s3_bucket}/test/*.tar", storage_options=opts)
    prefix = f"s3://{s3_bucket}/train"
    with pytest.raises(ShardError, match=rf"shard '{prefix}' is a directory, not a tar file"):
        build_index([prefix, want[0]], storage_options=opts)
    index = build_index([prefix, want[0]], storage_options=opts, on_error="skip")
    assert [s["url"] for s in index.excluded["shards"]] == [prefix] and index.shards[1].samples > 0


def test_bad_patterns_and_types_are_config_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"shard URL pattern 'shards/\{a' has unbalanced braces"):
        build_index("shards/{a")
    for bad in (None, 7, b"shard.tar", {"a.tar": 1}):
        with pytest.raises(ConfigError, match="shard URLs must be a str or a list of str"):
            build_index(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="shard URLs must be a str or a list of str"):
        build_index(["a.tar", None])  # type: ignore[list-item]


@pytest.mark.parametrize("workers", [1, 3])
def test_directory_given_as_a_shard(tmp_path, shards, workers) -> None:
    folder = os.path.dirname(shards[0])
    with pytest.raises(ShardError, match=rf"shard '{folder}' is a directory, not a tar file; .*'{folder}/\*\.tar'"):
        build_index([shards[0], folder], workers=workers)
    index = build_index([shards[0], folder, shards[1]], workers=workers, on_error="skip")
    assert [s["url"] for s in index.excluded["shards"]] == [folder]
    assert index.shards[1].error and "is a directory" in index.shards[1].error
    assert len(index) == index.shards[0].samples + index.shards[2].samples > 0


def _many_exts(path: str, prefix: str, n: int) -> str:
    return make_tar(path, [(f"s{i // 5:02d}.{prefix}{i:02d}", b"x") for i in range(n)])


@pytest.mark.parametrize("workers", [1, 2])
def test_extension_limit_names_the_shard_and_skip_skips_it(tmp_path, shards, workers) -> None:
    """More than 64 extensions in one shard, or in the shards together: the message names
    the shard and extensions; with on_error="skip" that shard is left out, not the build."""
    many = _many_exts(str(tmp_path / "many.tar"), "e", 70)
    with pytest.raises(ShardError, match=rf"{many}: more than 64 distinct member extensions \('e00', .*on_error='skip'"):
        build_index([shards[0], many], workers=workers)
    index = build_index([shards[0], many, shards[1]], on_error="skip", workers=workers)
    assert [s["url"] for s in index.excluded["shards"]] == [many]
    assert len(index) == index.shards[0].samples + index.shards[2].samples
    a, b = _many_exts(str(tmp_path / "a.tar"), "e", 40), _many_exts(str(tmp_path / "b.tar"), "f", 40)
    with pytest.raises(ShardError, match=rf"shard '{b}' adds member extensions \['f00', .* more than the 64"):
        build_index([a, b, shards[0]], workers=workers)
    index = build_index([a, b, shards[0]], on_error="skip", workers=workers)
    assert [s["url"] for s in index.excluded["shards"]] == [b] and len(index.exts) <= 64
    assert index.shards[2].samples > 0


# -- a shard costs at most one request beyond its reads ----------------------------------------
def _requests_per_shard(proxy, names: list[str]) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {n: [] for n in names}
    for r in proxy.requests:
        name = r.target.split("?")[0].rsplit("/", 1)[-1]
        if name in seen:
            seen[name].append(r.method if r.header("Range") is None else f"{r.method} range")
    return seen


def test_a_shard_over_http_costs_one_head_and_its_reads(tmp_path, nginx_server, fault_proxy) -> None:
    """Build and update over HTTP: one HEAD per shard (its size and stamp), then its reads;
    fsspec's open is handed the size, so it asks for none of its own."""
    folder = nginx_server.root_dir / f"heads-{tmp_path.name}"
    paths = make_blob_shards(folder, samples=24, sample_bytes=500, shards=4, seed=0)
    proxy = fault_proxy(nginx_server)
    names = [os.path.basename(p) for p in paths]
    urls = [f"{proxy.url}/{folder.name}/{n}" for n in names]
    out = str(tmp_path / "x.wdsidx")
    index = build_index(urls, "aspect:width,height", output=out, workers=2)
    assert index.arrays["offset"].tolist() == build_index(paths, "aspect:width,height").arrays["offset"].tolist()
    seen = _requests_per_shard(proxy, names)
    assert all(methods == ["HEAD", "GET range"] for methods in seen.values()), seen  # small shards: one read
    proxy.reset_counters()
    build_index(urls, "aspect:width,height", update=out)  # unchanged: one HEAD, no read
    assert all(methods == ["HEAD"] for methods in _requests_per_shard(proxy, names).values())


def test_a_shard_on_s3_costs_one_head_and_its_reads(tmp_path, moto_server, s3_bucket, fault_proxy) -> None:
    paths = make_blob_shards(tmp_path / "s", samples=24, sample_bytes=500, shards=3, seed=1)
    names = [os.path.basename(p) for p in paths]
    for p, n in zip(paths, names):
        moto_server.upload(p, f"s3://{s3_bucket}/{n}")
    proxy = fault_proxy(moto_server)
    opts = moto_server.storage_options_via(proxy.url)
    index = build_index([f"s3://{s3_bucket}/{n}" for n in names], "aspect:width,height", storage_options=opts,
                        workers=1)
    assert len(index) == 24
    seen = _requests_per_shard(proxy, names)
    assert all(methods == ["HEAD", "GET range"] for methods in seen.values()), seen


def test_an_interrupt_while_groups_are_submitted_cancels_the_groups_not_started(tmp_path, monkeypatch) -> None:
    """A signal (Ctrl-C, SIGTERM) landing while ``scan_shards`` still submits groups to its
    pool must cancel the queued ones, not wait for every one of them to be scanned (the
    pool's ``with`` exit waits: a busy machine saw 5 of 8 groups scanned after SIGTERM)."""
    import concurrent.futures
    import threading

    import wds_pad.index.build as build
    from wds_pad.cli.synth import make_image_shards

    shards = [str(p) for p in make_image_shards(tmp_path, samples=40, shards=40, seed=3)]
    release = threading.Event()
    scanned: list[int] = []
    real_group = build._scan_group

    def slow_group(urls, *a, **kw):
        release.wait(30)
        scanned.append(len(urls))
        return real_group(urls, *a, **kw)

    real_submit = concurrent.futures.ThreadPoolExecutor.submit
    submitted: list[int] = []

    def submit(self, fn, *args, **kw):
        if len(submitted) == 5:  # the 6th group: the signal arrives
            release.set()
            raise KeyboardInterrupt
        submitted.append(1)
        return real_submit(self, fn, *args, **kw)

    monkeypatch.setattr(build, "_scan_group", slow_group)
    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit", submit)
    with pytest.raises(KeyboardInterrupt):
        build.build_index(shards, "aspect:width,height", workers=2)
    assert len(scanned) <= 2  # the two running when it came; the three queued were cancelled
