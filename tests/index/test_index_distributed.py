"""Indexing as a distributed job (index.distributed, format.merged_parts): the merge of
part indexes is byte-identical to one build, finished parts are reused and stale ones
never, a failed or killed rank stops the job with its name, and a rerun redoes only the
missing parts (real gloo jobs of several processes)."""

from __future__ import annotations

import errno
import io
import itertools
import json
import os
import re
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wds_pad.index.distributed as dist_mod
import wds_pad.index.output as output_mod
from dist_helpers import ROOT, launch
from wds_pad.cli.synth import make_image_shards
from wds_pad.errors import ConfigError, IndexFormatError, WriteError
from wds_pad.index.build import build_index
from wds_pad.index.distributed import build_index_distributed, part_layout, parts_dir
from wds_pad.index.codec import load_index, serialize
from wds_pad.index.merge import merged_parts

pytest_plugins = ["conftest_servers"]


def file_bytes(index) -> bytes:
    return b"".join(bytes(p) for p in serialize(index))


def merged_bytes(parts, name: str) -> bytes:
    return b"".join(bytes(p) for p in merged_parts(parts, name=name))


# -- merge identity: a property over random shard sets ------------------------------------------
def _tar(path: str, samples: list[tuple[str, dict[str, bytes]]]) -> str:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime = len(data), 1_700_000_000
                tf.addfile(info, io.BytesIO(data))
    return path


def label_or_none(key: str, data: dict) -> object:
    """A callable bucket: the json label, None (excluded) for label 0."""
    label = json.loads(data["json"])["label"]
    return None if label == 0 else label


EXTS = ("jpg", "png", "txt", "cls", "webp")
shard_st = st.lists(  # a shard: samples of (label, width, height, extra member extensions, payload size)
    st.tuples(st.integers(0, 4), st.integers(1, 40), st.integers(1, 40), st.sets(st.sampled_from(EXTS), max_size=3),
              st.integers(0, 700)),
    max_size=6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shards=st.lists(shard_st, min_size=1, max_size=7), cuts=st.lists(st.integers(1, 6), max_size=4),
       spec=st.sampled_from(["none", "aspect", "json:label", "callable", "skip-bad"]))
def test_merge_of_parts_is_byte_identical_to_one_build(shards, cuts, spec) -> None:
    """Any split of any shards into consecutive parts merges into the bytes (and digest)
    of one build: buckets, extensions, excluded samples and skipped shards included."""
    with tempfile.TemporaryDirectory() as tmp:
        urls, n = [], 0
        for s, samples in enumerate(shards):
            members = []
            for label, w, h, exts, size in samples:
                doc = {"label": label, "width": w, "height": h}
                members.append((f"s{n:05d}", {"json": json.dumps(doc).encode(),
                                               **{e: bytes(size) for e in sorted(exts)}}))
                n += 1
            urls.append(_tar(f"{tmp}/shard-{s:03d}.tar", members))
        kw: dict = {"bucket_by": {"none": None, "aspect": "aspect", "json:label": "json:label",
                                  "callable": label_or_none, "skip-bad": "aspect"}[spec]}
        if spec == "skip-bad":  # a shard that is no tar: skipped, recorded in excluded
            Path(f"{tmp}/bad.tar").write_bytes(b"not a tar" * 200)
            urls.insert(len(urls) // 2, f"{tmp}/bad.tar")
        if spec in ("skip-bad", "callable"):
            kw["on_error"] = "skip"
        whole = build_index(urls, name="train", **kw)
        bounds = sorted({0, len(urls), *[c for c in np.cumsum(cuts) if c < len(urls)]})
        parts = []
        for j, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            build_index(urls[lo:hi], name="part", output=f"{tmp}/p{j}.wdsidx", **kw)
            parts.append(load_index(f"{tmp}/p{j}.wdsidx"))
        got = merged_bytes(parts, "train")
        assert got == file_bytes(whole)
        Path(f"{tmp}/m.wdsidx").write_bytes(got)
        assert load_index(f"{tmp}/m.wdsidx").digest == whole.digest


def test_merge_refuses_parts_bucketed_differently(tmp_path) -> None:
    paths = make_image_shards(tmp_path / "s", samples=20, shards=2, seed=1)
    a = build_index(paths[:1], "aspect", output=str(tmp_path / "a.wdsidx"))
    b = build_index(paths[1:], None, output=str(tmp_path / "b.wdsidx"))
    with pytest.raises(IndexFormatError, match="bucketed differently"):
        merged_bytes([load_index(a.path), load_index(b.path)], "x")
    with pytest.raises(IndexFormatError, match="no index parts"):
        merged_bytes([], "x")


def test_part_layout_depends_on_the_shards_only() -> None:
    assert part_layout(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert part_layout(0, 3) == []
    with pytest.raises(ConfigError, match="part_shards must be an int >= 1"):
        part_layout(7, 0)


# -- in one process (a gloo group of one): reuse, stale parts, refusals -------------------------
@pytest.fixture()
def group():
    import torch.distributed as dist
    from dist_helpers import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture()
def shards(tmp_path) -> list[str]:
    return make_image_shards(tmp_path / "shards", samples=80, shards=8, seed=5)


def _scanned_parts(monkeypatch) -> list[list[str]]:
    """Record the shards of every part the job scans."""
    seen: list[list[str]] = []
    real = dist_mod.scan_shards

    def spy(urls, *a, **kw):
        seen.append(list(urls))
        return real(urls, *a, **kw)

    monkeypatch.setattr(dist_mod, "scan_shards", spy)
    return seen


def test_distributed_needs_a_process_group(tmp_path, shards) -> None:
    with pytest.raises(ConfigError, match="needs a torch.distributed process group"):
        build_index_distributed(shards, output=str(tmp_path / "x.wdsidx"))


def test_rerun_reuses_finished_parts_and_never_a_stale_one(tmp_path, shards, monkeypatch, group) -> None:
    out = str(tmp_path / "train.wdsidx")
    single = build_index(shards, "aspect", name="train")
    seen = _scanned_parts(monkeypatch)
    real_write = dist_mod._write

    def crash_on_third(path, chunks, so):  # the "crash": the 3rd part's write fails
        if len(seen) == 3:
            raise KeyboardInterrupt
        real_write(path, chunks, so)

    monkeypatch.setattr(dist_mod, "_write", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        build_index_distributed(shards, "aspect", output=out, part_shards=2, workers=2)
    assert not os.path.exists(out)
    written = sorted(os.listdir(parts_dir(out)))
    assert [n[:11] for n in written] == ["part-000000", "part-000001"]
    monkeypatch.setattr(dist_mod, "_write", real_write)
    seen.clear()
    # a shard of part 1 changes: its finished part is stale (another digest), redone
    os.utime(shards[3], (1_600_000_000, 1_600_000_000))
    index = build_index_distributed(shards, "aspect", output=out, part_shards=2, workers=2)
    assert seen == [shards[2:4], shards[4:6], shards[6:8]]  # part 0 reused
    assert not os.path.exists(parts_dir(out))  # removed after the merge
    single = build_index(shards, "aspect", name="train").located(out)  # one build, written where the job wrote
    assert Path(out).read_bytes() == file_bytes(single) and index.digest == single.digest


def test_a_part_file_that_lies_is_refused(tmp_path, shards, monkeypatch, group) -> None:
    """A part whose file holds other shards than its name says (copied by hand) is refused."""
    out = str(tmp_path / "train.wdsidx")
    seen = _scanned_parts(monkeypatch)
    real = dist_mod._merge

    def plant(paths, *a, **kw):  # before the merge, part 1's file is replaced by part 0's
        os.replace(paths[0], paths[1])
        os.link(paths[1], paths[0])
        return real(paths, *a, **kw)

    monkeypatch.setattr(dist_mod, "_merge", plant)
    with pytest.raises(IndexFormatError, match=r"does not hold shards 2-3 .*delete .*train.wdsidx.parts"):
        build_index_distributed(shards, "aspect", output=out, part_shards=2)
    assert len(seen) == 4 and not os.path.exists(out)


def test_distributed_refuses_a_bad_output_before_scanning(tmp_path, shards, monkeypatch, group) -> None:
    seen = _scanned_parts(monkeypatch)
    with pytest.raises(ConfigError, match="is one of the input shards"):
        build_index_distributed(shards, "aspect", output=shards[0])
    assert seen == []


@pytest.mark.parametrize("full_at", ["part", "merge"])
def test_a_full_disk_is_a_write_error_and_a_rerun_keeps_what_was_finished(tmp_path, shards, monkeypatch, group,
                                                                          full_at) -> None:
    """No space for the 3rd part (or for the merged index): one WriteError naming the file,
    no temp file left, the finished parts kept; the rerun scans only what is missing."""
    out = str(tmp_path / "train.wdsidx")
    seen = _scanned_parts(monkeypatch)
    real = output_mod.atomic_write
    writes: list[str] = []

    def full(path, parts, **kw):
        writes.append(path)
        if (full_at == "part" and len(writes) == 3) or (full_at == "merge" and path == out):
            list(itertools.islice(parts, 1))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, parts, **kw)

    monkeypatch.setattr(output_mod, "atomic_write", full)
    with pytest.raises(WriteError, match=r"No space left on device \(ENOSPC\); nothing was written") as info:
        build_index_distributed(shards, "aspect", output=out, part_shards=2)
    failed = writes[-1]
    assert f"{failed!r}" in str(info.value) and "free space there" in str(info.value)
    assert (failed == out) == (full_at == "merge") and not os.path.exists(out)
    left = sorted(os.listdir(parts_dir(out)))
    assert len(left) == (4 if full_at == "merge" else 2) and all(n.endswith(".wdsidx") for n in left)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    monkeypatch.setattr(output_mod, "atomic_write", real)
    seen.clear()
    index = build_index_distributed(shards, "aspect", output=out, part_shards=2)
    assert seen == ([] if full_at == "merge" else [shards[4:6], shards[6:8]])
    assert index.digest == build_index(shards, "aspect", name="train").located(out).digest


def test_rescan_redoes_only_the_part_of_a_shard_rewritten_in_place(tmp_path, shards, monkeypatch, group) -> None:
    """A member's size rewritten with the shard's size and mtime kept: an update reuses the
    old rows; with rescan= only the part holding that shard is scanned, and only that shard
    in it; a part a plain update left behind is not reused for it."""
    from data_helpers import rewrite_member_header
    from wds_pad.tar.scan import scan_tar

    out = str(tmp_path / "train.wdsidx")
    build_index_distributed(shards, "aspect", output=out, part_shards=2)
    with open(shards[3], "rb") as f:
        sample = next(iter(scan_tar(f, shards[3])))
    st = os.stat(shards[3])
    blob = bytearray(open(shards[3], "rb").read())
    rewrite_member_header(blob, sample.members[0], "size", size=sample.members[0].size - 1)
    open(shards[3], "r+b").write(blob)
    os.utime(shards[3], ns=(st.st_atime_ns, st.st_mtime_ns))
    fresh = build_index(shards, "aspect", name="train").located(out)
    assert load_index(out).digest != fresh.digest  # the index holds the old size
    real_remove = dist_mod._remove_parts
    monkeypatch.setattr(dist_mod, "_remove_parts", lambda *a: None)  # a plain update's parts stay behind
    assert build_index_distributed(shards, "aspect", output=out, update=out, part_shards=2).digest != fresh.digest
    monkeypatch.setattr(dist_mod, "_remove_parts", real_remove)
    seen = _scanned_parts(monkeypatch)
    scanned: list[str] = []
    real_scan = dist_mod.scan_shards

    def count(urls, *a, **kw):
        rows = real_scan(urls, *a, **kw)
        scanned.extend(u for u in urls if u in kw["rescan"])
        return rows

    monkeypatch.setattr(dist_mod, "scan_shards", count)
    index = build_index_distributed(shards, "aspect", output=out, update=out, rescan=[shards[3]], part_shards=2)
    assert seen == [shards[2:4]]  # the other parts, left by the plain update, reused
    assert scanned == [shards[3]] and index.digest == fresh.digest and Path(out).read_bytes() == file_bytes(fresh)
    assert not os.path.exists(parts_dir(out))
    with pytest.raises(ConfigError, match="needs an update|without update"):
        build_index_distributed(shards, "aspect", output=out, rescan=[shards[3]], part_shards=2)


# -- real jobs: 4 gloo processes ----------------------------------------------------------------
WORKER = """
import os, signal, sys
import wds_pad.index.distributed as d
from wds_pad.cli.app import main

rank = int(os.environ["RANK"])
mode, *argv = sys.argv[1:]
written = []
real_write = d._write
def write(path, chunks, so):
    real_write(path, chunks, so)
    written.append(path)
    if mode == "kill" and rank == 2 and len(written) == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # killed half way, after two whole parts
real_scan = d.scan_shards
def scan(urls, *a, **kw):
    if mode == "fail" and rank == 1:
        from wds_pad.errors import ShardError
        raise ShardError(f"shard {urls[0]!r} is broken (planted by the test)")
    return real_scan(urls, *a, **kw)
d._write, d.scan_shards = write, scan
sys.exit(main(["index", "--distributed", *argv]))
"""


def _job(tmp_path, mode: str, world: int, argv: list[str], expect_ok: bool):
    script = tmp_path / "index_worker.py"
    script.write_text(WORKER)
    env = {"PYTHONPATH": str(ROOT)}
    return launch([sys.executable, str(script), mode, *argv], world, timeout=150, expect_ok=expect_ok, env=env)


def _parts_written(results) -> set[int]:
    return {int(m) for r in results for m in re.findall(r"part (\d+) \(shards", r.stderr)}


@pytest.mark.slow
def test_killed_rank_then_rerun_redoes_only_missing_parts(tmp_path) -> None:
    paths = make_image_shards(tmp_path / "shards", samples=240, shards=32, seed=7)
    out = str(tmp_path / "train.wdsidx")
    argv = [os.path.join(os.path.dirname(paths[0]), "shard-{000000..000031}.tar"), "-o", out, "--bucket-by",
            "aspect", "--part-shards", "2", "--workers", "2", "--timeout", "5", "--no-progress"]
    first = _job(tmp_path, "kill", 4, argv, expect_ok=False)
    assert first[2].returncode == -9  # SIGKILL
    assert not os.path.exists(out)
    on_disk = {int(n[5:11]) for n in os.listdir(parts_dir(out)) if n.endswith(".wdsidx")}
    assert {2, 6} <= on_disk and len(on_disk) < 16  # rank 2 had 2, 6, 10, 14: it wrote two
    assert _parts_written([first[2]]) == {2}  # killed inside the write of part 6, after its rename
    assert first[0].returncode == 1 and "rank 2 stopped answering" in first[0].stderr, first[0].stderr
    # the rerun, on another world size, redoes exactly the missing parts
    second = _job(tmp_path, "run", 3, argv, expect_ok=True)
    assert _parts_written(second) == set(range(16)) - on_disk
    assert not os.path.exists(parts_dir(out))
    single = build_index(paths, "aspect", name="train").located(out)
    assert Path(out).read_bytes() == file_bytes(single)
    assert load_index(out).digest == single.digest
    assert "indexed 32 shards" in second[0].stdout and second[1].stdout == "" == second[2].stdout


@pytest.mark.slow
def test_a_failed_rank_stops_every_rank_with_its_name(tmp_path) -> None:
    paths = make_image_shards(tmp_path / "shards", samples=60, shards=12, seed=8)
    out = str(tmp_path / "train.wdsidx")
    argv = [*paths, "-o", out, "--bucket-by", "aspect", "--part-shards", "2", "--timeout", "30", "--no-progress"]
    results = _job(tmp_path, "fail", 3, argv, expect_ok=False)
    for r in results:
        assert r.returncode == 1, (r.rank, r.stderr)
        named = "" if r.rank == 1 else r"rank 1 failed: ShardError: "  # rank 1 says its own error
        assert re.search(rf"error: {named}shard .* is broken", r.stderr), (r.rank, r.stderr)
    assert not os.path.exists(out)



@pytest.mark.slow
def test_cli_rescan_on_two_ranks_makes_verify_deep_pass(tmp_path, capsys) -> None:
    """`wds-pad index --update -o INDEX --rescan SHARD --distributed`, as verify --deep
    prints it, run by torchrun-style ranks: the shard rewritten in place is scanned again."""
    from data_helpers import rewrite_member_header
    from wds_pad.cli.app import main
    from wds_pad.tar.scan import scan_tar

    paths = make_image_shards(tmp_path / "shards", samples=40, shards=6, seed=4)
    out = str(tmp_path / "train.wdsidx")
    assert main(["index", *paths, "-o", out, "--bucket-by", "aspect", "--no-progress"]) == 0
    with open(paths[4], "rb") as f:
        sample = next(iter(scan_tar(f, paths[4])))
    st = os.stat(paths[4])
    blob = bytearray(open(paths[4], "rb").read())
    member = next(m for m in sample.members if not m.name.endswith(".json"))  # the image: its header stays whole
    rewrite_member_header(blob, member, "size", size=member.size - 1)
    open(paths[4], "r+b").write(blob)
    os.utime(paths[4], ns=(st.st_atime_ns, st.st_mtime_ns))
    capsys.readouterr()
    assert main(["verify", out, "--deep"]) == 1 and f"--rescan {paths[4]}" in capsys.readouterr().out
    results = _job(tmp_path, "run", 2, ["--update", "-o", out, "--rescan", paths[4], "--part-shards", "2",
                                        "--timeout", "30", "--no-progress"], expect_ok=True)
    assert "update: 1 shard scanned, 5 unchanged" in results[0].stdout and results[1].stdout == ""
    assert main(["verify", out, "--deep"]) == 0 and capsys.readouterr().out == "6 shards OK (deep)\n"
    assert load_index(out).digest == build_index(paths, "aspect", name="train").located(out).digest


def test_parts_and_output_on_s3(tmp_path, shards, moto_server, s3_bucket, monkeypatch, group) -> None:
    """A remote output: parts are objects beside it, rank 0 fetches them, merges into a
    local temp file and uploads it once; a rerun reuses the parts already there."""
    import fsspec

    for p in shards:
        moto_server.upload(p, f"s3://{s3_bucket}/{os.path.basename(p)}")
    urls = [f"s3://{s3_bucket}/{os.path.basename(p)}" for p in shards]
    opts = moto_server.storage_options
    out = f"s3://{s3_bucket}/train.wdsidx"
    seen = _scanned_parts(monkeypatch)
    real_merge = dist_mod._merge
    monkeypatch.setattr(dist_mod, "_merge", lambda *a, **kw: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):  # killed before the merge: every part is written
        build_index_distributed(urls, "aspect", output=out, part_shards=3, storage_options=opts)
    fs = fsspec.filesystem("s3", **opts)
    assert len(fs.ls(f"{s3_bucket}/train.wdsidx.parts")) == 3 and len(seen) == 3
    monkeypatch.setattr(dist_mod, "_merge", real_merge)
    index = build_index_distributed(urls, "aspect", output=out, part_shards=3, storage_options=opts)
    assert len(seen) == 3  # nothing scanned again
    assert not fs.exists(f"{s3_bucket}/train.wdsidx.parts/part-000000") and index.path == out
    single = build_index(urls, "aspect", name="train", storage_options=opts).located(out)
    assert fs.cat_file(f"{s3_bucket}/train.wdsidx") == file_bytes(single)
    assert b'"url": "shard-000000.tar"' in file_bytes(single)  # stored relative to the index's folder


API_WORKER = """
import json, os, sys
import torch.distributed as dist
import wds_pad.index.distributed as d
from wds_pad.errors import ShardError, WdsPadError

out, *shards = sys.argv[1:]
dist.init_process_group("gloo")
rank = dist.get_rank()
real = d.scan_shards
def broken(urls, *a, **kw):
    if rank == 1:
        raise ShardError("planted")
    return real(urls, *a, **kw)
d.scan_shards = broken
try:
    d.build_index_distributed(shards, "aspect", output=out, part_shards=1, timeout=30)
    first = "ok"
except WdsPadError as exc:
    first = str(exc)
d.scan_shards = real  # a second job in the same process group: the first one's keys are not its own
index = d.build_index_distributed(shards, "aspect", output=out, part_shards=1, timeout=30)
print(json.dumps({"rank": rank, "first": first, "second": None if index is None else index.digest}))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_jobs_one_after_another_in_one_process_group(tmp_path) -> None:
    """The Python API on two ranks: a failed job, then a good one in the same group (the
    second must not read the first's verdict), byte-identical to one build."""
    from gloo_jobs import run_gloo_job

    paths = make_image_shards(tmp_path / "shards", samples=30, shards=4, seed=9)
    out = str(tmp_path / "train.wdsidx")
    results = run_gloo_job(tmp_path, API_WORKER, world=2, args=(out, *paths))
    assert results[0]["first"].startswith("rank 1 failed: ShardError: planted") and results[1]["first"] == "planted"
    single = build_index(paths, "aspect", name="train").located(out)
    assert results[0]["second"] == single.digest and results[1]["second"] is None
    assert Path(out).read_bytes() == file_bytes(single)
