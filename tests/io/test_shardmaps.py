"""Tests of wds_pad.io.shardmaps: which mapping of a local shard a process keeps, for whom,
for how long, and the checks that keep a copy out of it from ever touching a lost page."""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Iterator

import pytest

from wds_pad.errors import ConfigError
from wds_pad.io import shardmaps
from wds_pad.io.ranges import RangeReader, ReadOptions


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    """Each test starts and ends with nothing seen, nothing kept, mapping on."""
    shardmaps._forget()
    yield
    shardmaps._forget()


def _file(path: Path, data: bytes) -> tuple[str, int]:
    path.write_bytes(data)
    return str(path), os.open(path, os.O_RDONLY)


def test_a_shard_is_mapped_from_its_second_stream_on_and_the_mapping_kept(tmp_path: Path) -> None:
    path, fd = _file(tmp_path / "a.tar", b"abc" * 5000)
    try:
        assert shardmaps.mapped(path, fd) is None  # the first stream reads with os.pread
        view = shardmaps.mapped(path, fd)
        assert view is not None and view.readonly and bytes(view) == b"abc" * 5000
        assert shardmaps.mapped(path, fd) is view  # kept: no new mapping, no new page faults
    finally:
        os.close(fd)


def test_a_file_changed_or_replaced_is_mapped_again(tmp_path: Path) -> None:
    path, fd = _file(tmp_path / "a.tar", b"1" * 8192)
    shardmaps.mapped(path, fd)
    first = shardmaps.mapped(path, fd)
    assert first is not None
    os.utime(path, ns=(1, 1))  # the same file, another modification time
    second = shardmaps.mapped(path, fd)
    assert second is not None and second is not first
    other = tmp_path / "b.tar"
    other.write_bytes(b"2" * 9000)
    os.replace(other, path)  # another file under the same path (a rewrite by rename)
    fd2 = os.open(path, os.O_RDONLY)
    try:
        third = shardmaps.mapped(path, fd2)
        assert third is not None and bytes(third) == b"2" * 9000
        assert bytes(second) == b"1" * 8192  # the old mapping still shows the old file: no fault
    finally:
        os.close(fd)
        os.close(fd2)


def test_kept_mappings_are_bounded_in_count_and_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = [_file(tmp_path / f"{i}.tar", bytes([i]) * 4096 * (i + 1)) for i in range(4)]
    try:
        for path, fd in files:
            shardmaps.mapped(path, fd)
        monkeypatch.setattr(shardmaps, "MAX_MAPS", 2)
        for path, fd in files:
            assert shardmaps.mapped(path, fd) is not None
        assert list(shardmaps._MAPS) == [files[2][0], files[3][0]]  # the least recently asked for go
        monkeypatch.setattr(shardmaps, "MAX_MAPS", 10)
        monkeypatch.setattr(shardmaps, "MAX_MAP_BYTES", 4096 * 5)
        for path, fd in files:
            shardmaps.mapped(path, fd)
        assert list(shardmaps._MAPS) == [files[3][0]]  # 16 KiB alone; with the 12 KiB one it would be 28
    finally:
        for _, fd in files:
            os.close(fd)


KEPT_WITHIN_BUDGET = """
import os, resource, sys
from wds_pad.io import shardmaps
from wds_pad.io.descriptors import fd_budget
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
paths = []
for i in range(3 * fd_budget() // 2):
    path = os.path.join(sys.argv[1], f"{i}.tar")
    with open(path, "wb") as f:
        f.write(bytes([i]) * 4096)
    fd = os.open(path, os.O_RDONLY)
    shardmaps.mapped(path, fd)
    assert shardmaps.mapped(path, fd) is not None
    os.close(fd)
    paths.append(path)
def target(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the listing's own descriptor, closed by now
        return None
held = sum(target(fd) in paths for fd in os.listdir("/proc/self/fd"))
print(fd_budget(), len(shardmaps._MAPS), held, list(shardmaps._MAPS) == paths[-fd_budget():])
"""


def test_kept_mappings_hold_no_more_descriptors_than_the_budget(tmp_path: Path) -> None:
    """Each mapping holds a descriptor of its own (Python's mmap duplicates the file's): a
    process streaming more shards than a quarter of its descriptor limit keeps only that
    many mapped, so the limit is left for its readers, pipes and sockets."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", KEPT_WITHIN_BUDGET, str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["32", "32", "32", "True"]


def test_an_empty_or_unmappable_file_is_read_with_pread(tmp_path: Path) -> None:
    path, fd = _file(tmp_path / "empty.tar", b"")
    r, w = os.pipe()
    try:
        for _ in range(2):
            assert shardmaps.mapped(path, fd) is None
            assert shardmaps.mapped("a-pipe", r) is None
    finally:
        for x in (fd, r, w):
            os.close(x)


def test_shrunk_notices_a_file_cut_short_or_a_descriptor_gone(tmp_path: Path) -> None:
    path, fd = _file(tmp_path / "a.tar", b"x" * 20000)
    try:
        shardmaps.mapped(path, fd)
        maps = {path: shardmaps.mapped(path, fd)}
        assert not shardmaps.shrunk({path: fd}, maps, {path})
        assert shardmaps.shrunk({}, maps, {path})
        os.truncate(path, 10000)
        assert shardmaps.shrunk({path: fd}, maps, {path})
    finally:
        os.close(fd)


def test_a_forked_child_starts_with_nothing_seen_and_mapping_on(tmp_path: Path) -> None:
    path, fd = _file(tmp_path / "a.tar", b"y" * 4096)
    shardmaps.mapped(path, fd)
    assert shardmaps.mapped(path, fd) is not None
    shardmaps.stop("a test")
    pid = os.fork()
    if pid == 0:  # a DataLoader worker lives one epoch: it reads with os.pread
        ok = shardmaps.stopped() is None and shardmaps.mapped(path, fd) is None and not shardmaps._MAPS
        os._exit(0 if ok and shardmaps.mapped(path, fd) is not None else 1)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0
    assert shardmaps.stopped() == "a test"


def test_stop_drops_the_mappings_and_maps_no_more(tmp_path: Path) -> None:
    path, fd = _file(tmp_path / "a.tar", b"z" * 4096)
    try:
        shardmaps.mapped(path, fd)
        assert shardmaps.mapped(path, fd) is not None and shardmaps.stopped() is None
        shardmaps.stop("the disk")
        assert shardmaps.stopped() == "the disk" and not shardmaps._MAPS
        assert shardmaps.mapped(path, fd) is None
    finally:
        os.close(fd)


def test_mapping_is_tried_again_a_while_after_a_copy_waited(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page cache trimmed once (another job, the host reclaiming memory) costs a while of
    os.pread, not the rest of the job; waiting again stops it again."""
    path, fd = _file(tmp_path / "a.tar", b"w" * 4096)
    now = [1000.0]
    monkeypatch.setattr(shardmaps.time, "monotonic", lambda: now[0])
    try:
        shardmaps.mapped(path, fd)
        shardmaps.stop("the disk")
        now[0] += shardmaps.RETRY_SECONDS - 1
        assert shardmaps.stopped() == "the disk" and shardmaps.mapped(path, fd) is None
        now[0] += 1
        assert shardmaps.mapped(path, fd) is not None and shardmaps.stopped() is None
        shardmaps.stop("the disk again")
        assert shardmaps.stopped() == "the disk again" and shardmaps.mapped(path, fd) is None
        now[0] += shardmaps.RETRY_SECONDS
        assert shardmaps.stopped() is None and shardmaps.mapped(path, fd) is not None
    finally:
        os.close(fd)


def test_faults_counts_a_read_that_waits_for_the_disk(tmp_path: Path) -> None:
    """What turns mapping off: a page of a mapping that is not in the page cache is a
    major fault of the thread that touches it."""
    path = tmp_path / "cold.tar"
    with open(path, "wb") as f:
        f.write(os.urandom(4 << 20))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache (clean pages)
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
            before = shardmaps.faults()
            total = sum(m[i] for i in range(0, len(m), 1 << 20))
            assert shardmaps.faults() > before, total
            warm = shardmaps.faults()
            sum(m[i] for i in range(0, len(m), 1 << 20))
            assert shardmaps.faults() == warm  # in memory now: no wait
    finally:
        os.close(fd)


def test_map_local_is_a_bool_and_false_maps_nothing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="map_local"):
        ReadOptions(map_local="yes")  # type: ignore[arg-type]
    path, fd = _file(tmp_path / "a.tar", b"w" * 4096)
    os.close(fd)
    for on in (True, False):
        shardmaps._forget()
        shardmaps._SEEN.add(path)  # streamed once already
        reader = RangeReader(ReadOptions(map_local=on))
        assert reader.local_map(path) is None  # not open yet
        reader.local_fd(path)
        assert (reader.local_map(path) is not None) is on
        reader.close()
