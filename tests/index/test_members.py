"""The index's member table (format v2 sections member_start/member_ext/member_size):
recorded for plain samples by the scan, kept by --update and by merges, absent from
indexes that never had it."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest

from wds_pad.index.build import build_index
from wds_pad.index.format import MEMBER_ARRAYS, load_index, merged_parts, serialize
from wds_pad.index.tarscan import parse_sample


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


def test_member_table_records_plain_samples(shards: list[str]) -> None:
    index = build_index(shards, None)
    assert index.has_members
    plain = 0
    for i in range(len(index)):
        url, off, ln = index.url(i), int(index.offset[i]), int(index.length[i])
        with open(url, "rb") as f:
            f.seek(off)
            members = parse_sample(f.read(ln), url, off, index.key(i))
        got = _members(index, i)
        if len(index.key(i)) > 100:
            assert got == []  # a pax header: streaming parses it
        else:
            plain += 1
            assert got == [(e, len(v)) for e, v in members.items()]
    assert plain == len(index) - 10


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
    index.digest = index._compute_digest()
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
