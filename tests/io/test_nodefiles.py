"""The node cache's file protocol (io/nodefiles.py) and the cache over it (io/nodecache.py),
with real processes: racing for a shard, reading while it is written, a writer killed with
SIGKILL mid-download and the restart that finishes its file, stale files reclaimed,
eviction by next planned use, reuse across a restart, and the modes files get.

GETs are a counting fetch over bytes in memory; each process counts its own, appended to a
shared file, so the counts are the node's.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from wds_pad.io import nodefiles, noderoom
from wds_pad.io.nodecache import NodeCache
from wds_pad.io.shardplan import NodeEpoch, NodeShard

pytestmark = pytest.mark.timeout(120)

BLOCK = 100
FORK = multiprocessing.get_context("fork")


DATA = {f"s{i}": bytes((i * 31 + k * 7) % 251 for k in range(1000)) for i in range(6)}


class Gets:
    """A fetch over DATA that logs each GET to a file shared by the processes, optionally
    slowed down or stopped before a given offset until ``gate`` exists."""

    def __init__(self, log: Path, delay: float = 0.0, stop_at: int | None = None, gate: Path | None = None) -> None:
        self.log, self.delay, self.stop_at, self.gate = log, delay, stop_at, gate
        self.pool = concurrent.futures.ThreadPoolExecutor(4)

    def __call__(self, url: str, start: int, length: int) -> concurrent.futures.Future[bytes]:
        def get() -> bytes:
            if self.stop_at is not None and start >= self.stop_at:
                while self.gate is None or not self.gate.exists():
                    time.sleep(0.01)
            time.sleep(self.delay)
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()} {url} {start} {length}\n")
            return DATA[url][start:start + length]
        return self.pool.submit(get)


def gets(log: Path) -> list[tuple[int, str, int, int]]:
    if not log.exists():
        return []
    return [(int(p), u, int(s), int(n)) for p, u, s, n in (line.split() for line in log.read_text().splitlines())]


def shard(url: str, steps: list[int], mine: list[int] | None = None, users: frozenset[int] = frozenset({0}),
          held: bool = True, stamp: str = "ETag=1") -> NodeShard:
    size = len(DATA[url])
    return NodeShard(url=url, size=size, name=nodefiles.shard_name(url, size, stamp), held=held,
                     steps=np.asarray(sorted(set(steps)), np.int64), users=users,
                     mine=np.asarray(steps if mine is None else mine, np.int64))


def epoch(shards: list[NodeShard], me: int = 0, length: int = 100, later: dict[str, int] | None = None,
          e: int = 0, span: int = 100) -> NodeEpoch:
    by = {s.url: s for s in shards}
    order = tuple(s.url for s in sorted((s for s in shards if s.held and s.mine.size), key=lambda s: int(s.mine[0])))
    return NodeEpoch(epoch=e, length=length, me=me, shards=by, order=order,
                     later=later if later is not None else {s.name: 0 for s in shards}, span=span)


def cache(folder: Path, ep: NodeEpoch | list[NodeEpoch], fetch: Any, **kw: Any) -> NodeCache:
    eps = ep if isinstance(ep, list) else [ep]
    kw.setdefault("cache_bytes", 10**6)
    kw.setdefault("ahead", 0)
    return NodeCache(fetch, iter(eps), folder=str(folder), block_bytes=BLOCK, **kw)


def read(c: NodeCache, url: str, start: int, length: int) -> bytes:
    """One planned read through ``c``, once this process's fetch of the shard (if any) is over."""
    assert c.planned(url)
    data = c.read(url, start, length).result(timeout=60)
    settle(c)
    return data


def settle(*caches: NodeCache) -> None:
    """Waits for every fetch the caches have started (ahead of their reads, too)."""
    for c in caches:
        for entry in list(c._entries.values()):
            if entry.fetch is not None:
                entry.fetch.result(timeout=60)


# -- the protocol ---------------------------------------------------------------------------------

def _race(folder: str, log: str, out: str, who: int) -> None:
    c = cache(Path(folder), epoch([shard("s0", [0, 1])], me=who), Gets(Path(log), delay=0.02))
    got = read(c, "s0", 0, 1000) + read(c, "s0", 250, 300)
    Path(out).write_bytes(got)


def test_processes_racing_for_a_shard_fetch_it_once_and_all_read_its_bytes(tmp_path: Path) -> None:
    log = tmp_path / "gets"
    procs = [FORK.Process(target=_race, args=(str(tmp_path), str(log), str(tmp_path / f"out{i}"), i))
             for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    seen = gets(log)
    assert sorted(s for _, _, s, _ in seen) == list(range(0, 1000, BLOCK))  # each block once, over the node
    assert len({pid for pid, *_ in seen}) >= 1
    for i in range(4):
        assert (tmp_path / f"out{i}").read_bytes() == DATA["s0"] + DATA["s0"][250:550]
    name = nodefiles.shard_name("s0", 1000, "ETag=1")
    assert sorted(p.name for p in tmp_path.iterdir() if name in p.name) == [name + ".ok", name + ".shard", name + ".sum"]


def _write_until_gate(folder: str, log: str, gate: str) -> None:
    c = cache(Path(folder), epoch([shard("s1", [0])]), Gets(Path(log), stop_at=300, gate=Path(gate)))
    read(c, "s1", 0, 1000)


def test_a_reader_reads_what_is_written_while_the_writer_goes_on(tmp_path: Path) -> None:
    log, gate = tmp_path / "gets", tmp_path / "gate"
    writer = FORK.Process(target=_write_until_gate, args=(str(tmp_path), str(log), str(gate)))
    writer.start()
    name = nodefiles.shard_name("s1", 1000, "ETag=1")
    while len(gets(log)) < 3:  # blocks 0..2 fetched, the writer waits before block 3
        time.sleep(0.01)
    reader = cache(tmp_path, epoch([shard("s1", [0, 1])], me=1), Gets(log))
    assert read(reader, "s1", 120, 150) == DATA["s1"][120:270]  # from the .part, while it is written
    part = tmp_path / (name + ".part")
    assert part.exists() and not (tmp_path / (name + ".shard")).exists()
    fd = os.open(part, os.O_RDONLY)
    assert not nodefiles.writer_gone(fd)  # its writer holds the lock
    os.close(fd)
    later = reader.read("s1", 900, 100) if reader.planned("s1") else None
    time.sleep(0.1)
    assert later is not None and not later.done()  # waits for bytes not yet written
    gate.write_text("")
    assert later.result(timeout=30) == DATA["s1"][900:]
    writer.join(30)
    assert writer.exitcode == 0
    assert len(gets(log)) == 10 and {pid for pid, *_ in gets(log)} == {writer.pid}  # the reader made no GET


def test_a_writer_killed_mid_download_leaves_a_part_that_the_restart_finishes(tmp_path: Path) -> None:
    """SIGKILL while three of ten blocks are written: the lock dies with the writer, the
    restart takes the .part over and fetches only the seven blocks it lacks."""
    log, gate = tmp_path / "gets", tmp_path / "never"
    writer = FORK.Process(target=_write_until_gate, args=(str(tmp_path), str(log), str(gate)))
    writer.start()
    name = nodefiles.shard_name("s1", 1000, "ETag=1")
    part = tmp_path / (name + ".part")
    while not (part.exists() and part.stat().st_size == 300):
        time.sleep(0.01)
    os.kill(writer.pid, signal.SIGKILL)
    writer.join(10)
    fd = os.open(part, os.O_RDONLY)
    assert nodefiles.writer_gone(fd)  # stale: nobody holds its lock
    os.close(fd)
    restart = cache(tmp_path, epoch([shard("s1", [0])]), Gets(tmp_path / "gets2"))
    assert read(restart, "s1", 0, 1000) == DATA["s1"]
    assert sorted(s for _, _, s, _ in gets(tmp_path / "gets2")) == list(range(300, 1000, BLOCK))
    assert sorted(p.name for p in tmp_path.iterdir() if name in p.name) == [name + ".ok", name + ".shard", name + ".sum"]


def _hold_folder_lock(folder: str) -> None:
    with noderoom.folder_lock(folder):
        time.sleep(60)


def test_a_process_killed_holding_the_folder_lock_or_a_temp_file_blocks_nobody(tmp_path: Path) -> None:
    holder = FORK.Process(target=_hold_folder_lock, args=(str(tmp_path),))
    holder.start()
    time.sleep(0.3)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(10)
    done = threading.Event()

    def take() -> None:
        with noderoom.folder_lock(str(tmp_path)):
            done.set()
    threading.Thread(target=take, daemon=True).start()
    assert done.wait(10)
    # a writer's temp file (killed between creating and linking it) is removed by the next reclaim
    name = nodefiles.shard_name("s2", 1000, "ETag=1")
    (tmp_path / f"{name}.0123abcd.tmp").write_bytes(b"")
    assert noderoom.reclaim(str(tmp_path), {name}) == 1


def _hold_part(folder: str, name: str) -> None:
    status, fd = nodefiles.claim(folder, name)
    assert status == "mine"
    time.sleep(60)


def test_reclaim_removes_what_dead_processes_left_and_nothing_else(tmp_path: Path) -> None:
    names = {k: nodefiles.shard_name(k, 1000, "ETag=1") for k in ("known", "unknown", "live", "short", "gone")}
    for k in ("known", "unknown"):  # stale parts: their writers are dead (no lock)
        (tmp_path / f"{names[k]}.part").write_bytes(b"x" * 200)
    (tmp_path / f"{names['short']}.shard").write_bytes(b"x" * 999)  # not the size its name carries
    (tmp_path / f"{names['gone']}.done").write_text("0 1\n")  # its shard is gone
    (tmp_path / "notes.txt").write_text("mine")
    live = FORK.Process(target=_hold_part, args=(str(tmp_path), names["live"]))
    live.start()
    while not (tmp_path / f"{names['live']}.part").exists() or list(tmp_path.glob("*.tmp")):
        time.sleep(0.01)
    try:
        assert noderoom.reclaim(str(tmp_path), {names["known"]}) == 3
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted([f"{names['known']}.part", f"{names['live']}.part", "notes.txt"])
    finally:
        live.kill()
        live.join(10)
    assert noderoom.reclaim(str(tmp_path), set()) == 2  # its writer died: stale now too


def _umask_files(folder: str, umask: int) -> None:
    os.umask(umask)
    c = cache(Path(folder), epoch([shard("s3", [0])]), Gets(Path(folder) / "gets"))
    read(c, "s3", 0, 10)


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o027, 0o640)])
def test_the_files_are_made_with_mode_666_less_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    p = FORK.Process(target=_umask_files, args=(str(tmp_path), umask))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    name = nodefiles.shard_name("s3", 1000, "ETag=1")
    for f in (tmp_path / f"{name}.shard", tmp_path / ".lock"):
        assert f.stat().st_mode & 0o777 == mode


# -- the cache over it ----------------------------------------------------------------------------

def test_eviction_removes_the_shard_whose_next_planned_use_is_furthest(tmp_path: Path) -> None:
    """Room for two shards (2,000 bytes): fetching a third at step 5 removes the one the
    node reads last (b, at step 40), never one read sooner (a, at 6), and a shard no plan
    reads again (z) goes before anything; a shard fetched ahead is not fetched when only
    shards needed sooner than itself could make room."""
    log = tmp_path.parent / f"{tmp_path.name}-gets"
    a, b, c, z = shard("s0", [0, 6]), shard("s1", [1, 40]), shard("s2", [5]), shard("s5", [2], mine=[2, 2])
    d = shard("s4", [30])
    ep = epoch([a, b, c, d, z], later={a.name: 3, c.name: 4})
    first = cache(tmp_path, ep, Gets(log), cache_bytes=3000)
    for s, at in ((a, 0), (b, 1), (z, 2)):
        assert read(first, s.url, 0, 10) == DATA[s.url][:10]
    assert {p.name for p in tmp_path.glob("*.shard")} == {a.name + ".shard", b.name + ".shard", z.name + ".shard"}
    c2 = cache(tmp_path, ep, Gets(log), cache_bytes=2000)
    c2._now = 5
    assert read(c2, c.url, 0, 10) == DATA[c.url][:10]  # needs room: z (no use) then b (step 40) go
    assert {p.name for p in tmp_path.glob("*.shard")} == {a.name + ".shard", c.name + ".shard"}
    assert c2.evicted == 2
    # fetched ahead (d, next use 30): a (6) and c (5) are needed sooner: d is not fetched
    c2._now = 5
    assert c2._fetch_file(c2._entries[d.url], urgent=False) == "skipped"
    assert not (tmp_path / (d.name + ".part")).exists() and c2.evicted == 2
    # a shard a process is reading (it holds the complete file's shared lock) is never removed
    ep = epoch([a, b, c, d, z], later={a.name: 3, c.name: 4, d.name: 5})
    reader = cache(tmp_path, ep, Gets(log))
    assert read(reader, a.url, 5, 5) == DATA[a.url][5:10]  # opens a's complete file: in use
    tight = cache(tmp_path, ep, Gets(log), cache_bytes=1000)
    tight._now = 50
    assert read(tight, d.url, 0, 10) == DATA[d.url][:10]  # needs room: c goes, a (in use) stays
    # and d, read and next needed after a, goes once read: the folder was past the bound only while d was read
    assert {p.name for p in tmp_path.glob("*.shard")} == {a.name + ".shard"}
    # until its next read, a window's steps (span) away: then it is no longer held
    far = cache(tmp_path, epoch([a, b, c, d, z], later={a.name: 3, d.name: 5}, span=2), Gets(log))
    assert read(far, a.url, 0, 5) == DATA[a.url][:5]  # next read of a at step 6: far off
    reader.close()
    tighter = cache(tmp_path, ep, Gets(log), cache_bytes=1000)
    tighter._now = 50
    assert read(tighter, b.url, 0, 10) == DATA[b.url][:10]  # b (step 40) needed now: a (next at 6 < 50: none) goes
    assert {p.name for p in tmp_path.glob("*.shard")} == {b.name + ".shard"}


def test_a_shard_the_node_reads_next_epoch_stays_and_one_it_does_not_goes_with_its_last_user(tmp_path: Path) -> None:
    log = tmp_path.parent / f"{tmp_path.name}-gets"
    kept, dropped = shard("s0", [0, 1], users=frozenset({0, 1})), shard("s1", [2, 3], users=frozenset({0, 1}))
    users = [cache(tmp_path, epoch([kept, dropped], me=me, later={kept.name: 4}), Gets(log)) for me in (0, 1)]
    for c in users:
        assert read(c, kept.url, 0, 5) == DATA[kept.url][:5]
        assert read(c, kept.url, 5, 5) == DATA[kept.url][5:10]
    read(users[0], dropped.url, 0, 5)
    read(users[0], dropped.url, 0, 5)  # user 0's last read: user 1 still reads it
    settle(*users)
    assert (tmp_path / (dropped.name + ".shard")).exists()
    read(users[1], dropped.url, 0, 5)
    read(users[1], dropped.url, 10, 5)  # the last user's last read
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", kept.name + ".ok", kept.name + ".shard",
                                                          kept.name + ".sum"]
    assert len(gets(log)) == 20  # each shard once


def test_a_restart_on_the_folder_reuses_its_shards_and_refetches_only_what_is_not_the_indexed_shard(
        tmp_path: Path) -> None:
    log = tmp_path / "gets"
    shards = [shard(f"s{i}", [i]) for i in range(3)]
    first = cache(tmp_path, epoch(shards), Gets(log))
    for s in shards:
        read(first, s.url, 0, 1000)
    assert len(gets(log)) == 30
    # a later job: the same shards (same URL, size and stamp) are read from the folder
    log2 = tmp_path / "gets2"
    again = cache(tmp_path, epoch(shards), Gets(log2))
    for s in shards:
        assert read(again, s.url, 0, 1000) == DATA[s.url]
    assert gets(log2) == []
    # a file of the wrong size is removed, never read; a shard re-indexed with another stamp is another file
    (tmp_path / (shards[0].name + ".shard")).write_bytes(DATA["s0"][:500])
    changed = shard("s1", [1], stamp="ETag=2")
    third = cache(tmp_path, epoch([shards[0], changed, shards[2]]), Gets(log2))
    for s in (shards[0], changed, shards[2]):
        assert read(third, s.url, 0, 1000) == DATA[s.url]
    assert sorted({u for _, u, _, _ in gets(log2)}) == ["s0", "s1"]


def test_copies_of_a_folder_that_goes_with_the_job_are_served_within_its_session_and_fetched_again_after(
        tmp_path: Path) -> None:
    """``kept=False`` (the job's own folder): no checksum computed or kept; the session's
    other processes read the copies without a GET, a later session (a restart under the
    job's name) finds no ``.sum`` and fetches each again, exactly."""
    shards = [shard(f"s{i}", [i]) for i in range(3)]
    log = tmp_path / "gets"
    first = cache(tmp_path, epoch(shards), Gets(log), kept=False, session="job a")
    for s in shards:
        assert read(first, s.url, 0, 1000) == DATA[s.url]
    assert len(gets(log)) == 30
    assert not list(tmp_path.glob("*.sum")) and len(list(tmp_path.glob("*.shard"))) == 3
    peer = cache(tmp_path, epoch(shards, me=1), Gets(log), kept=False, session="job a")
    for s in shards:
        assert read(peer, s.url, 0, 1000) == DATA[s.url]
    assert len(gets(log)) == 30  # the session takes its own word
    heads: list[str] = []
    later = cache(tmp_path, epoch(shards), Gets(log), kept=False, session="job a, again", check=heads.append)
    for s in shards:
        assert read(later, s.url, 250, 500) == DATA[s.url][250:750]
    assert len(gets(log)) == 60 and not list(tmp_path.glob("*.sum"))
    assert heads == []  # a copy without a checksum is fetched again: asking the store first would be a HEAD lost
    kept = cache(tmp_path, epoch(shards), Gets(log), session="a job with a cache_dir")
    for s in shards:
        assert read(kept, s.url, 0, 1000) == DATA[s.url]
    assert len(gets(log)) == 90 and len(list(tmp_path.glob("*.sum"))) == 3


def test_a_shard_the_node_does_not_hold_is_read_from_a_copy_present_else_singly(tmp_path: Path) -> None:
    log = tmp_path / "gets"
    held = shard("s0", [0])
    c = cache(tmp_path, epoch([held]), Gets(log))
    read(c, "s0", 0, 10)
    other = cache(tmp_path, epoch([shard("s0", [0], held=False), shard("s1", [1], held=False)]), Gets(log))
    assert other.planned("s0")  # a complete copy is here: read from it
    assert other.read("s0", 3, 4).result(timeout=10) == DATA["s0"][3:7]
    assert not other.planned("s1")  # not held, not here: one ranged GET by the reader
    assert len(gets(log)) == 10


def test_a_read_whose_fetch_fails_raises_that_error(tmp_path: Path) -> None:
    def failing(url: str, start: int, length: int) -> concurrent.futures.Future[bytes]:
        f: concurrent.futures.Future[bytes] = concurrent.futures.Future()
        f.set_exception(OSError(f"cannot read {url} at byte offset {start}"))
        return f
    c = cache(tmp_path, epoch([shard("s0", [0])]), failing)
    assert c.planned("s0")
    with pytest.raises(OSError, match="byte offset 0"):
        c.read("s0", 0, 10).result(timeout=10)
    name = nodefiles.shard_name("s0", 1000, "ETag=1")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]  # the empty .part went with its writer


def test_a_stream_over_two_epochs_takes_the_next_epochs_plan_and_reads_what_it_kept(tmp_path: Path) -> None:
    """Steps mode: one cache follows epoch 0, then epoch 1 once epoch 0's planned reads
    are served. What epoch 1 reads again (kept) costs no GET; a shard only epoch 0 read
    goes after its last read."""
    log = tmp_path.parent / f"{tmp_path.name}-gets"
    a0, b0 = shard("s0", [0, 1]), shard("s1", [2])
    a1, c1 = shard("s0", [0]), shard("s2", [1])
    c = cache(tmp_path, [epoch([a0, b0], later={a0.name: 0, c1.name: 1}), epoch([a1, c1], e=1, later={})], Gets(log))
    for url, start in (("s0", 0), ("s0", 10), ("s1", 0)):
        assert read(c, url, start, 10) == DATA[url][start:start + 10]
    assert c._epoch.epoch == 0 and not (tmp_path / (b0.name + ".shard")).exists()  # epoch 0 only: gone
    assert read(c, "s0", 20, 10) == DATA["s0"][20:30]  # epoch 1 begins: s0 was kept
    assert c._epoch.epoch == 1
    assert read(c, "s2", 0, 10) == DATA["s2"][:10]
    assert sorted({u for _, u, _, _ in gets(log)}) == ["s0", "s1", "s2"] and len(gets(log)) == 30
