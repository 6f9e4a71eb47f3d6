"""A cache never changes the answer: a job with a warm node cache streams the same bytes, or
raises the same error, as the same job without one (io/nodecheck.py, io/nodecache.py).

Shards are served by loopback nginx (whose ETag is its file's mtime and size); the store is
rewritten under a warm ``cache_dir`` and cached files are damaged on disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from data_helpers import serve_dir, wds_reference
from wds_pad.cli.synth import make_image_shards
from wds_pad.core.topology import Topology
from wds_pad.errors import ConfigError, StaleShardError
from wds_pad.index.build import build_index
from wds_pad.index.codec import load_index
from wds_pad.io.ranges import ReadOptions
from wds_pad.stream.dataset import BucketedWebDataset

pytest_plugins = ["conftest_servers"]
pytestmark = [pytest.mark.timeout(180),
              pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning")]

SHARDS = 4
BLOCK = 16 * 1024


@pytest.fixture
def served(nginx_server: Any, tmp_path: Path) -> tuple[Path, str]:
    gen = tmp_path / "gen"
    src = tmp_path / "src"
    src.mkdir()
    for i, path in enumerate(make_image_shards(gen, samples=80, shards=SHARDS, seed=4)):
        os.replace(path, src / f"train-{i:06d}.tar")
    base = serve_dir(nginx_server, src, f"nc-{tmp_path.name}")
    return nginx_server.root_dir / f"nc-{tmp_path.name}", base


def index_of(base: str, out: Path) -> Any:
    return build_index(f"{base}/train-{{000000..{SHARDS - 1:06d}}}.tar", "aspect:width,height", output=str(out))


def stream(index: Any, cache: Path | None, **read: Any) -> tuple[dict[str, dict[str, Any]], Any]:
    """Every streamed sample by key, and the reader's counters (one process, dp 1), as a
    job of its own (a run id of its own: a job checks a cached copy once)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHELASTIC_RUN_ID", f"job-{next(_JOBS)}")
        return _stream(index, cache, **read)


_JOBS = itertools.count()


def _stream(index: Any, cache: Path | None, **read: Any) -> tuple[dict[str, dict[str, Any]], Any]:
    opts = ReadOptions(block_bytes=BLOCK, cache_dir=None if cache is None else str(cache), **read)
    ds = BucketedWebDataset(index, batch_size=4, topology=Topology(1, 0), seed=5, locality="shard", window=2,
                            read_options=opts, check_agreement=False)
    out = {s["__key__"]: s for batch in ds for s in batch}
    return out, ds.read_stats


def outcome(index: Any, cache: Path | None, **read: Any) -> Any:
    try:
        return {k: {m: v for m, v in s.items() if not m.startswith("__")}
                for k, s in stream(index, cache, **read)[0].items()}
    except StaleShardError as exc:
        return ("StaleShardError", str(exc))


def rewrite(path: Path, keep_mtime: bool) -> None:
    """New bytes of the same size inside a payload of the shard (its layout unchanged)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            if m.size >= 64 and not m.name.endswith((".json", ".cls", ".txt")):
                off = m.offset_data + m.size // 2
                data[off:off + 16] = bytes(b ^ 0x5A for b in data[off:off + 16])
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:  # a new mtime in the store's whole seconds (nginx's ETag), however soon after the last write
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))


def test_a_remote_index_records_each_shard_s_content_and_a_local_one_none(served: tuple[Path, str],
                                                                         tmp_path: Path) -> None:
    root, base = served
    remote = index_of(base, tmp_path / "ix.wdsidx")
    for info in remote.shards:
        want = hashlib.blake2b((root / info.url.rsplit("/", 1)[1]).read_bytes(), digest_size=16).hexdigest()
        assert info.content == f"blake2b={want}"
    local = build_index(str(root / f"train-{{000000..{SHARDS - 1:06d}}}.tar"), "aspect:width,height",
                        output=str(tmp_path / "local.wdsidx"))
    assert all(s.content == "" for s in local.shards)
    table = json.loads(local.json_blobs()["shards"])
    assert all("content" not in s for s in table)  # the file an index without it always wrote
    loaded = load_index(str(tmp_path / "local.wdsidx"))
    assert loaded.digest == local.digest == loaded.compute_digest()


def test_a_warm_cache_raises_the_stale_error_a_job_without_it_raises_with_one_head_per_shard(
        served: tuple[Path, str], tmp_path: Path) -> None:
    root, base = served
    index = index_of(base, tmp_path / "ix.wdsidx")
    cache = tmp_path / "cache"
    first = outcome(index, cache)
    assert first == outcome(index, None)
    again, stats = stream(index, cache)  # a second job on the warm cache: one HEAD per shard
    assert 0 < stats.store_checks <= SHARDS
    rewrite(root / "train-000001.tar", keep_mtime=False)  # new bytes, new mtime: a new ETag
    without = outcome(index, None)
    assert without[0] == "StaleShardError"
    assert outcome(index, cache) == without


def test_a_shard_rewritten_with_its_size_and_mtime_then_indexed_again_is_fetched_again(
        served: tuple[Path, str], tmp_path: Path) -> None:
    root, base = served
    cache = tmp_path / "cache"
    outcome(index_of(base, tmp_path / "ix.wdsidx"), cache)  # warm
    rewrite(root / "train-000002.tar", keep_mtime=True)  # the same ETag
    index = index_of(base, tmp_path / "ix2.wdsidx")
    got = outcome(index, cache)
    assert got == outcome(index, None)
    ref = wds_reference(str(root / f"train-{i:06d}.tar") for i in range(SHARDS))
    assert all(got[k][m] == ref[k][m] for k in got for m in got[k])


def test_a_damaged_cached_file_is_dropped_and_fetched_again(served: tuple[Path, str], tmp_path: Path) -> None:
    root, base = served
    index = index_of(base, tmp_path / "ix.wdsidx")
    cache = tmp_path / "cache"
    clean = outcome(index, cache)
    copies = sorted(cache.glob("*.shard"))
    assert copies
    for copy in copies:
        data = bytearray(copy.read_bytes())
        data[3000:3064] = bytes(b ^ 0xFF for b in data[3000:3064])
        copy.write_bytes(bytes(data))
    assert outcome(index, cache) == clean
    ref = {p.read_bytes() for p in root.glob("*.tar")}
    assert {p.read_bytes() for p in cache.glob("*.shard")} <= ref


def on_disk(folder: Path) -> int:
    """The bytes of every file in ``folder``."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


SIDE_FILES = 4096  # a copy's checksum and the jobs that checked it: a few dozen bytes each


def test_folder_bytes_stay_within_cache_bytes_plus_the_shard_in_flight_old_copies_included(
        served: tuple[Path, str], tmp_path: Path) -> None:
    root, base = served
    largest = max(p.stat().st_size for p in root.glob("*.tar"))
    bound = 2 * largest + 1  # two shards of four
    cache = tmp_path / "cache"
    first = index_of(base, tmp_path / "ix.wdsidx")
    assert outcome(first, cache, cache_bytes=bound) == outcome(first, None)
    assert 0 < on_disk(cache) <= bound + SIDE_FILES  # nothing in flight once the job ends
    kept = {p.name for p in cache.glob("*.shard")}
    for i in range(SHARDS):  # every shard indexed again with other bytes: its copy here is an old one
        rewrite(root / f"train-{i:06d}.tar", keep_mtime=True)
    again = index_of(base, tmp_path / "ix2.wdsidx")
    for _ in range(2):
        assert outcome(again, cache, cache_bytes=bound) == outcome(again, None)
        assert on_disk(cache) <= bound + SIDE_FILES
    assert not kept & {p.name for p in cache.glob("*.shard")}  # the old copies went first


@contextlib.contextmanager
def read_only(folder: Path, view: Path) -> Iterator[Path]:
    """``folder`` seen read-only: a read-only bind mount at ``view`` for root (whom modes do
    not stop), else the folder itself without write permission."""
    if os.geteuid() == 0:
        view.mkdir()
        subprocess.run(["mount", "--bind", str(folder), str(view)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
            yield view
        finally:
            subprocess.run(["umount", str(view)], check=True)
    else:
        os.chmod(folder, 0o555)
        try:
            yield folder
        finally:
            os.chmod(folder, 0o755)


def test_a_read_only_folder_with_every_shard_streams_and_a_damaged_copy_there_is_one_error_naming_it(
        served: tuple[Path, str], tmp_path: Path) -> None:
    root, base = served
    index = index_of(base, tmp_path / "ix.wdsidx")
    cache = tmp_path / "cache"
    clean = outcome(index, cache)
    before = sorted(p.name for p in cache.iterdir())
    with read_only(cache, tmp_path / "ro") as folder:
        assert outcome(index, folder) == clean  # every shard there: streams from it, writes nothing
    assert sorted(p.name for p in cache.iterdir()) == before
    copy = sorted(cache.glob("*.shard"))[0]
    data = bytearray(copy.read_bytes())
    data[100:164] = bytes(b ^ 0xFF for b in data[100:164])
    copy.write_bytes(bytes(data))
    with read_only(cache, tmp_path / "ro2") as folder:
        with pytest.raises(ConfigError, match="damaged.*cannot be written"):
            outcome(index, folder)


def test_a_read_only_folder_lacking_a_shard_is_one_error_naming_the_folder(
        served: tuple[Path, str], tmp_path: Path) -> None:
    _, base = served
    index = index_of(base, tmp_path / "ix.wdsidx")
    cache = tmp_path / "cache"
    cache.mkdir()
    with read_only(cache, tmp_path / "ro") as folder:
        with pytest.raises(ConfigError, match=f"shard folder '{folder}' cannot be written.*make it writable"):
            outcome(index, folder)


def test_a_foreign_entry_is_skipped_and_reported_once_and_one_in_a_shard_s_place_is_one_error(
        served: tuple[Path, str], tmp_path: Path) -> None:
    _, base = served
    index = index_of(base, tmp_path / "ix.wdsidx")
    cache = tmp_path / "cache"
    clean = outcome(index, cache)
    odd = cache / ("0" * 32 + "-100.shard")
    odd.mkdir()  # named like a cached file, yet a directory
    with pytest.warns(UserWarning, match="not regular files") as seen:
        assert outcome(index, cache) == clean
        assert outcome(index, cache) == clean
    assert sum("not regular files" in str(w.message) for w in seen) == 1
    assert odd.is_dir()  # left alone
    taken = sorted(p for p in cache.glob("*.shard") if p.is_file())[0]
    for p in cache.glob(taken.stem + ".*"):
        p.unlink()
    taken.mkdir()
    with pytest.raises(ConfigError, match=f"{taken.name}.* is not a file the cache wrote.*remove it"):
        outcome(index, cache)


def test_a_full_disk_is_one_error_with_the_figures(served: tuple[Path, str], tmp_path: Path) -> None:
    root, base = served
    index = index_of(base, tmp_path / "ix.wdsidx")
    disk = tmp_path / "disk"
    disk.mkdir()
    size = max(p.stat().st_size for p in root.glob("*.tar")) * 3 // 2
    if os.geteuid() != 0:
        pytest.skip("a small disk is a tmpfs mount, which needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], check=True)
    try:
        with pytest.raises(ConfigError, match=r"is full: \d+ bytes free, the folder holds \d+ bytes.*cache_bytes"):
            outcome(index, disk)
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)  # a fetch thread may still hold a file


def test_a_cache_dir_with_locality_none_is_said_to_be_unused(served: tuple[Path, str], tmp_path: Path) -> None:
    _, base = served
    index = index_of(base, tmp_path / "ix.wdsidx")
    opts = ReadOptions(cache_dir=str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="cache_dir=.* is not used with locality='none'.*locality='shard'"):
        BucketedWebDataset(index, batch_size=4, topology=Topology(1, 0), seed=5, locality="none",
                           read_options=opts, check_agreement=False)


def _own_folder_outcome(index: Any, tmp: Path, local_world_size: int | None) -> tuple[Any, list[str]]:
    """Rank 0 of 2 as a job of its own: with ``local_world_size=2`` its shards go through
    the job's own folder (no ``cache_dir``), else its memory; the outcome, and the names of
    the files the own folder held once the epoch was read."""
    import tempfile

    from wds_pad.io.nodefolder import default_folder

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHELASTIC_RUN_ID", f"own-{next(_JOBS)}")
        mp.setattr(tempfile, "tempdir", str(tmp))
        ds = BucketedWebDataset(index, batch_size=4, topology=Topology(2, 0, local_world_size=local_world_size),
                                seed=5, locality="shard", window=2, read_options=ReadOptions(block_bytes=BLOCK),
                                check_agreement=False)
        try:
            got: Any = {s["__key__"]: {m: v for m, v in s.items() if not m.startswith("__")}
                        for batch in ds for s in batch}
        except StaleShardError as exc:
            got = ("StaleShardError", str(exc))
        folder = Path(default_folder())
        return got, sorted(p.suffix for p in folder.iterdir()) if folder.is_dir() else []


def test_the_job_s_own_folder_keeps_no_checksum_and_answers_as_the_job_s_memory(
        served: tuple[Path, str], tmp_path: Path) -> None:
    """A folder that goes with the job serves its copies only to the job that fetched them,
    as memory does: no blake2b of each copy (nobody reads a ``.sum`` there), and the same
    bytes or error as the job with its shards in memory, where a ``cache_dir``, whose copies
    later jobs serve, refuses a copy that is not the index's ``content``."""
    root, base = served
    index = index_of(base, tmp_path / "ix.wdsidx")
    (tmp_path / "tmp").mkdir()
    memory, none = _own_folder_outcome(index, tmp_path / "tmp", None)
    own, files = _own_folder_outcome(index, tmp_path / "tmp", 2)
    assert ".shard" not in none and isinstance(own, dict) and own == memory
    assert ".shard" in files and ".ok" in files and ".sum" not in files
    rewrite(root / "train-000001.tar", keep_mtime=True)  # new bytes, the same size and ETag
    memory, _ = _own_folder_outcome(index, tmp_path / "tmp", None)
    own, files = _own_folder_outcome(index, tmp_path / "tmp", 2)
    assert isinstance(memory, dict) and own == memory and ".sum" not in files
    assert outcome(index, tmp_path / "cache")[0] == "StaleShardError"
