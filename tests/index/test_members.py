"""The index's member table (format v2 sections member_start/member_ext/member_size/
member_offset): recorded for every sample and header form by the scan, files from before
member_offset still loading, kept by --update and by merges, absent from
indexes that never had it."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from wds_pad.index.build import build_index
from wds_pad.index.codec import load_index, serialize
from wds_pad.index.layout import MEMBER_ARRAYS
from wds_pad.index.merge import merged_parts
from wds_pad.tar.scan import parse_sample


def _shard(path: Path, start: int, count: int, odd: bool) -> str:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT if odd else tarfile.GNU_FORMAT) as tf:
        for i in range(start, start + count):
            key = f"{i:05d}"
            if odd and i % 3 == 0:
                key = "k" * 110 + key  # a pax path record: not plain
            for ext, size in (("jpg" if i % 2 else "PNG", 10 + i % 700), ("json", 5 + i % 3)):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = size
                tf.addfile(info, io.BytesIO(os.urandom(size)))
    return str(path)


@pytest.fixture
def shards(tmp_path: Path) -> list[str]:
    return [_shard(tmp_path / f"s{k}.tar", 30 * k, 30, odd=k == 1) for k in range(3)]


def _members(index, i: int) -> list[tuple[str, int]]:
    ms = index.arrays["member_start"]
    lo, hi = int(ms[i]), int(ms[i + 1])
    return [(index.exts[e], int(n)) for e, n in zip(index.arrays["member_ext"][lo:hi], index.arrays["member_size"][lo:hi])]


def test_member_table_records_every_sample_with_its_payload_offsets(shards: list[str]) -> None:
    """Plain and pax samples alike: each member's extension, size and payload offset."""
    index = build_index(shards, None)
    assert index.has_members and "member_offset" in index.arrays
    ms = index.arrays["member_start"]
    pax = 0
    for i in range(len(index)):
        url, off, ln = index.url(i), int(index.offset[i]), int(index.length[i])
        with open(url, "rb") as f:
            f.seek(off)
            data = f.read(ln)
        members = parse_sample(data, url, off, index.key(i))
        assert _members(index, i) == [(e, len(v)) for e, v in members.items()]
        lo, hi = int(ms[i]), int(ms[i + 1])
        at = np.arange(lo, hi)
        got = {index.exts[int(e)]: data[o : o + n] for e, o, n in
               zip(index.arrays["member_ext"][at], index.member_offsets(at, np.array([hi - lo])),
                   index.arrays["member_size"][at])}
        assert got == members
        pax += len(index.key(i)) > 100
    assert pax == 10 and index.members_missing() == (0, "")


def _legacy(index: Any) -> Any:
    """``index`` as a file written before member_offset: pax samples record no members."""
    ms = index.arrays["member_start"].astype(np.int64)
    counts = np.diff(ms)
    plain = np.array([len(index.key(i)) <= 100 for i in range(len(index))])
    keep = np.repeat(plain, counts)
    index.arrays["member_ext"] = index.arrays["member_ext"][keep]
    index.arrays["member_size"] = index.arrays["member_size"][keep]
    new_start = np.zeros(len(index) + 1, np.int64)
    np.cumsum(np.where(plain, counts, 0), out=new_start[1:])
    index.arrays["member_start"] = new_start.astype(index.arrays["member_start"].dtype)
    del index.arrays["member_offset"]
    index.digest = index.compute_digest()
    return index


def test_an_index_from_before_member_offset_loads_streams_and_update_rescans_its_pax_shards(
        shards: list[str], tmp_path: Path) -> None:
    out = tmp_path / "old.wdsidx"
    fresh = build_index(shards, None)
    out.write_bytes(b"".join(bytes(p) for p in serialize(_legacy(build_index(shards, None)))))
    old = load_index(str(out))
    assert "member_offset" not in old.arrays and old.has_members
    missing, why = old.members_missing()
    assert missing == 10 and "wds-pad index --update" in why
    # plain samples: their offsets follow from the sizes, exactly as a fresh scan records them
    ms_old, ms_new = old.arrays["member_start"].astype(np.int64), fresh.arrays["member_start"].astype(np.int64)
    for i in range(len(old)):
        if ms_old[i + 1] > ms_old[i]:
            at_old = np.arange(ms_old[i], ms_old[i + 1])
            at_new = np.arange(ms_new[i], ms_new[i + 1])
            np.testing.assert_array_equal(old.member_offsets(at_old, np.array([at_old.size])),
                                          fresh.arrays["member_offset"][at_new])
    # it streams: plain samples through the member table, the others parsed (and counted)
    from wds_pad import BucketedWebDataset, Topology

    def stream(index: Any) -> tuple[list[list[tuple[str, Any]]], Any]:
        ds = BucketedWebDataset(index, batch_size=1, seed=3, topology=Topology(world_size=1, rank=0),
                                check_agreement=False)
        return [sorted((k, v) for k, v in s.items()) for b in ds for s in b], ds.read_stats

    got, stats = stream(old)
    want, fresh_stats = stream(fresh)
    assert got == want and fresh_stats.exact_samples == 0
    assert stats.exact_samples == stats.exact_batches == 10
    updated = build_index(shards, None, update=str(out))  # the pax shard is rescanned, the others reused
    assert updated.members_missing() == (0, "")
    for k in fresh.numeric_sections():
        np.testing.assert_array_equal(updated.arrays[k], fresh.arrays[k], err_msg=k)


def test_member_table_round_trips_file_update_and_merge(shards: list[str], tmp_path: Path) -> None:
    out = str(tmp_path / "all.wdsidx")
    full = build_index(shards, None, output=out)
    loaded = load_index(out)
    for k in MEMBER_ARRAYS:
        np.testing.assert_array_equal(loaded.arrays[k], full.arrays[k], err_msg=k)
    os.utime(shards[2], (1, 1))  # one shard rescanned, two reused
    updated = build_index(shards, None, update=out)
    for k in full.numeric_sections():
        np.testing.assert_array_equal(updated.arrays[k], full.arrays[k], err_msg=k)
    assert updated.numeric_sections() == full.numeric_sections()
    parts = [build_index(shards[:2], None), build_index(shards[2:], None)]
    merged = b"".join(bytes(p) for p in merged_parts(parts, name="x"))
    assert merged == b"".join(bytes(p) for p in serialize(build_index(shards, None, name="x")))


def test_an_index_without_member_table_round_trips(shards: list[str], tmp_path: Path) -> None:
    index = build_index(shards, None)
    for k in MEMBER_ARRAYS:
        index.arrays.pop(k)
    index.digest = index.compute_digest()
    out = tmp_path / "bare.wdsidx"
    out.write_bytes(b"".join(bytes(p) for p in serialize(index)))
    again = load_index(str(out))
    assert not again.has_members and again.digest == index.digest
    # merged with a part that has one: its samples record no members
    with_table = build_index(shards[2:], None)
    without = load_index(str(out))
    merged_path = tmp_path / "m.wdsidx"
    merged_path.write_bytes(b"".join(bytes(p) for p in merged_parts([without, with_table], name="m")))
    merged = load_index(str(merged_path))
    counts = np.diff(merged.arrays["member_start"].astype(np.int64))
    from_without = merged.shard < len(without.shards)
    assert not counts[from_without].any() and counts[~from_without].all()
