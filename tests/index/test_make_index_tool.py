"""Tests of tools/make_index.py (synthetic version-2 indexes) and format.columns_parts."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from wds_pad import Topology, plan_epoch
from wds_pad.core.dataset import bucket_order
from wds_pad.errors import IndexFormatError
from wds_pad.index.codec import columns_parts, load_index, serialize
from wds_pad.index.layout import FORMAT_VERSION
from wds_pad.index.record import ShardInfo
from wds_pad.index.rows import make_index

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "make_index.py"


def _tool_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_index_tool", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mi") / "syn.wdsidx"
    # a small chunk would need the module; the CLI's own chunk (2**21 rows) covers it whole,
    # so chunking is tested separately below
    out = run(str(TOOL), "--samples", "30000", "--shards", "37", "--buckets", "25", "--seed", "5", "-o", str(path))
    assert out.returncode == 0, out.stderr
    assert "wrote 30,000 samples, 37 shards, 25 buckets" in out.stderr
    return path


def test_index_is_valid_and_counts_are_the_requested_ones(synthetic: Path) -> None:
    index = load_index(str(synthetic), verify=True)  # the digest is recomputed and matches
    assert index.header()["version"] == FORMAT_VERSION == 2
    assert len(index) == 30000 and len(index.shards) == 37 and len(index.buckets) == 25
    assert list(index.buckets) == sorted(index.buckets, key=bucket_order)
    expected = _tool_module().bucket_sizes(30000, 25, 1.5, 5)
    assert list(index.bucket_counts().values()) == expected.tolist()
    assert min(expected) >= 1 and max(expected) > 5 * np.median(expected)  # skewed, log-normal
    assert sum(s.samples for s in index.shards) == 30000
    assert np.bincount(index.shard, minlength=37).tolist() == [s.samples for s in index.shards]
    assert index.bucket_by["kind"] == "aspect" and index.exts == ("jpg", "json", "png", "txt")
    # a file written by columns_parts is what serialize writes for the same index
    assert b"".join(bytes(p) for p in serialize(index)) == synthetic.read_bytes()


def test_offsets_and_lengths_are_a_tar_layout(synthetic: Path) -> None:
    index = load_index(str(synthetic))
    shard = index.shard.astype(np.int64)
    off, ln = index.offset.astype(np.int64), index.length.astype(np.int64)
    assert np.all(off % 512 == 0) and np.all(ln % 512 == 0) and np.all(ln >= 4 * 512)
    # rows grouped by bucket, then shard, then byte order
    bucket = index.bucket.astype(np.int64)
    order = np.lexsort((off, shard, bucket))
    assert np.array_equal(order, np.arange(len(index)))
    # inside each shard the samples sit back to back from byte 0, the shard's size after the last one
    by_shard = np.lexsort((off, shard))
    s, o, n = shard[by_shard], off[by_shard], ln[by_shard]
    same = s[1:] == s[:-1]
    assert np.array_equal(o[1:][same], (o + n)[:-1][same])
    starts = np.flatnonzero(np.r_[True, ~same])
    assert np.all(o[starts] == 0)
    ends = (o + n)[np.r_[starts[1:] - 1, len(s) - 1]]
    sizes = np.asarray([sh.size for sh in index.shards])[s[starts]]
    assert np.all(sizes >= ends + 1024) and np.all(sizes % 10240 == 0) and np.all(sizes - ends < 1024 + 10240)
    # keys: unique, fixed width, <shard><position>, increasing inside a shard
    keys = [index.key(int(i)) for i in by_shard]
    assert len(set(keys)) == len(keys) and {len(k) for k in keys} == {9}
    assert all(a < b for a, b, sm in zip(keys, keys[1:], same) if sm)
    masks = index.arrays["exts"]
    assert set(np.unique(masks).tolist()) <= {0b1011, 0b1110}  # jpg|json|txt, png|json|txt
    # the member table: 3 members a sample, each a 512-byte header and its padded payload
    assert index.has_members
    start = index.arrays["member_start"].astype(np.int64)
    size, ext = index.arrays["member_size"].astype(np.int64), index.arrays["member_ext"].astype(np.int64)
    assert np.array_equal(start, 3 * np.arange(len(index) + 1))
    assert np.array_equal(np.add.reduceat(512 + -(-size // 512) * 512, start[:-1]), ln)
    bits = np.zeros(len(index), np.int64)
    for j in range(3):
        bits |= 1 << ext[start[:-1] + j]
    assert np.array_equal(bits, masks.astype(np.int64))
    assert np.all(np.diff(ext.reshape(-1, 3), axis=1) > 0)  # archive order: sorted by extension


def test_inspect_and_plan_work_on_it(synthetic: Path) -> None:
    out = run("-m", "wds_pad.cli", "inspect", str(synthetic))
    assert out.returncode == 0, out.stderr
    assert "format v2" in out.stdout and "30000" in out.stdout and "shards: 37" in out.stdout
    out = run("-m", "wds_pad.cli", "plan", str(synthetic), "--world-size", "8", "--rank", "3", "--batch-size", "4",
              "--seed", "1", "--json")
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    index = load_index(str(synthetic))
    plan = plan_epoch(index, Topology(8, 3), seed=1, batch_size=4, warn=False)
    assert [r["samples"] for r in records] == [b.samples.tolist() for b in plan]


def test_chunked_rows_equal_one_chunk_and_int_keys(tmp_path: Path) -> None:
    mod = _tool_module()
    whole = mod.SyntheticIndex(5000, 9, 6, seed=2, key_kind="int", name="n")
    small = mod.SyntheticIndex(5000, 9, 6, seed=2, key_kind="int", name="n", chunk=7)
    a, b = str(tmp_path / "a.wdsidx"), str(tmp_path / "b.wdsidx")
    whole.write(a)
    small.write(b)
    ia, ib = load_index(a, verify=True), load_index(b, verify=True)
    assert ia.buckets == tuple(range(6)) and ia.bucket_by["kind"] == "json"
    # the chunking changes the random draws (seeded per chunk), never the layout's rules
    assert np.array_equal(ia.shard, ib.shard) and np.array_equal(ia.bucket_offsets, ib.bucket_offsets)
    assert [ia.key(i) for i in range(len(ia))] == [ib.key(i) for i in range(len(ib))]
    for ix in (ia, ib):
        o, n, s = ix.offset.astype(np.int64), ix.length.astype(np.int64), ix.shard.astype(np.int64)
        k = np.lexsort((o, s))
        same = s[k][1:] == s[k][:-1]
        assert np.array_equal(o[k][1:][same], (o[k] + n[k])[:-1][same])


def test_key_width_no_members_and_bad_arguments(tmp_path: Path) -> None:
    path = tmp_path / "w.wdsidx"
    out = run(str(TOOL), "--samples", "1e3", "--shards", "4", "--buckets", "3", "--key-width", "12", "--no-members",
              "-o", str(path))
    assert out.returncode == 0, out.stderr
    index = load_index(str(path), verify=True)
    assert index.key(0) == "000000000000" and not index.has_members
    out = run(str(TOOL), "--samples", "1e3", "--shards", "4", "--buckets", "3", "--key-width", "2", "-o", str(path))
    assert out.returncode == 2 and "--key-width 2 is too narrow" in out.stderr
    out = run(str(TOOL), "--samples", "2", "--shards", "4", "--buckets", "3", "-o", str(path))
    assert out.returncode == 2 and "--samples 2 must be at least --buckets 3" in out.stderr


def test_columns_parts_equals_serialize_and_checks_its_producers(tmp_path: Path) -> None:
    shards = [ShardInfo(f"s{i}.tar", 10240, "x", 2) for i in range(2)]
    rows = {"shard": np.array([0, 0, 1, 1]), "offset": np.array([0, 512, 0, 1024]),
            "length": np.array([512, 512, 1024, 512]), "bucket": np.array([1, 0, 1, 0]), "exts": np.array([1, 1, 3, 1])}
    index = make_index(shards, rows, ["b", "a"], ["k0", "k1", "k2", "key3"], bucket_by={"kind": "x"},
                       exts=["a", "b"], name="t")
    producers = {k: (lambda k=k: iter(np.array_split(np.asarray(index.arrays[k]), 3))) for k in index.arrays}
    got = b"".join(bytes(p) for p in columns_parts(
        "t", index.shards, index.buckets, index.bucket_by, index.exts, index.excluded, producers, samples=4,
        key_bytes=int(index.arrays["key_offsets"][-1]), max_offset=1024, max_length=1024))
    assert got == b"".join(bytes(p) for p in serialize(index))
    with pytest.raises(IndexFormatError, match=r"no producer for section\(s\) \['keys'\]"):
        list(columns_parts("t", shards, index.buckets, {}, index.exts, {}, {k: v for k, v in producers.items()
                                                                           if k != "keys"},
                           samples=4, key_bytes=9, max_offset=1024, max_length=1024))


def test_cost_tokens_writes_costs_and_each_buckets_cost_order(tmp_path: Path) -> None:
    path = tmp_path / "costs.wdsidx"
    out = run(str(TOOL), "--samples", "20000", "--shards", "9", "--buckets", "12", "--seed", "3", "--cost", "tokens",
              "--cost-median", "300", "--cost-max", "4000", "-o", str(path))
    assert out.returncode == 0, out.stderr
    index = load_index(str(path), verify=True)
    assert index.cost_kind == "json:tokens" and index.cost.dtype == np.int16
    assert int(index.cost.min()) >= 1 and int(index.cost.max()) <= 4000 and 250 < np.median(index.cost) < 360
    bo = index.bucket_offsets
    for b in range(len(index.buckets)):
        lo, hi = int(bo[b]), int(bo[b + 1])
        rows = index.cost_order(lo, hi)
        assert rows.tolist() == sorted(range(lo, hi), key=lambda r: (int(index.cost[r]), r))
    assert b"".join(bytes(p) for p in serialize(index)) == path.read_bytes()
    plain = tmp_path / "plain.wdsidx"
    assert run(str(TOOL), "--samples", "20000", "--shards", "9", "--buckets", "12", "--seed", "3",
               "-o", str(plain)).returncode == 0
    without = load_index(str(plain))
    assert without.cost is None and np.array_equal(without.offset, index.offset)  # the same rows, without costs
