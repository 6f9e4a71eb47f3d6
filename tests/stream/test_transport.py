"""Batches cross from DataLoader workers in shared memory; ``zero_copy`` members are views.

Everything is checked against the batches of one process: the same sample dicts, in
plan order, for bytes and for views, with fork and spawn workers; the ring of batch
buffers is checked on its own (placement, wrap, a held batch never overwritten); a
killed worker fails the loop with one error, and no shared-memory name is left behind
by a killed worker or a killed main process.
"""

from __future__ import annotations

import gc
import io
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import wds_pad
from wds_pad import ConfigError, Topology, WorkerError
from wds_pad.index.record import Index
from wds_pad.stream.loader import Loader
from wds_pad.stream import ring as rings, transport
from wds_pad.stream.ring import SLOTS, Arena
from wds_pad.stream.transport import PackedBatch

from data_helpers import image_index, make_dataset

pytestmark = pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning")


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Index:
    return image_index(tmp_path_factory.mktemp("transport"), samples=96, shards=4, seed=11)


def _ds(index: Index, **kw):  # type: ignore[no-untyped-def]
    return make_dataset(index, quiet=True, seed=7, topology=Topology(1, 0), check_agreement=False, **kw)


def _plain(batches: list) -> list:  # type: ignore[type-arg]
    """Batches with every member as bytes, to compare views with bytes."""
    return [[{k: bytes(v) if isinstance(v, memoryview) else v for k, v in s.items()} for s in b] for b in batches]


def _shm() -> set[str]:
    """The names in /dev/shm, but for multiprocessing's named semaphores (spawn's queues
    use them, its resource tracker removes them, and any process on the machine may be
    making some now): not ours."""
    names = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    return {n for n in names if not n.startswith("sem.mp-")}


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_batches_through_workers_equal_the_batches_of_one_process(index: Index, context: str, workers: int) -> None:
    one = list(Loader(_ds(index), num_workers=0))
    got = list(Loader(_ds(index), num_workers=workers, multiprocessing_context=context))
    assert got == one
    assert all(type(v) is bytes for b in got for s in b for k, v in s.items() if not k.startswith("__"))


@pytest.mark.filterwarnings("ignore:This DataLoader will create 8 worker processes")
@pytest.mark.parametrize("zero_copy", [False, True])
def test_eight_workers_on_two_cores_give_the_batches_of_one_process(index: Index, zero_copy: bool) -> None:
    """The most workers the loader is made for (more than the machine's cores): every batch in
    plan order, exactly once, and the state after the epoch the one process's."""
    one = Loader(_ds(index), num_workers=0)
    want = list(one)
    loader = Loader(_ds(index, zero_copy=zero_copy), num_workers=8)
    got = list(loader)
    assert _plain(got) == want
    assert loader.state_dict() == one.state_dict()


@pytest.mark.parametrize("workers", [0, 2])
def test_zero_copy_members_are_read_only_views_of_the_same_bytes(index: Index, workers: int) -> None:
    want = list(Loader(_ds(index), num_workers=0))
    got = list(Loader(_ds(index, zero_copy=True), num_workers=workers))  # every batch held at once
    members = [v for b in got for s in b for k, v in s.items() if not k.startswith("__")]
    assert members and all(isinstance(m, memoryview) and m.readonly for m in members)
    assert _plain(got) == want
    with pytest.raises(TypeError):
        members[0][0] = 0


def test_zero_copy_views_outlive_their_loop_and_later_epochs(index: Index) -> None:
    ds = _ds(index, zero_copy=True)
    first = list(Loader(ds, num_workers=2))
    ds.set_epoch(1)
    list(Loader(ds, num_workers=2))  # more batches read while the first epoch's views are held
    ds.set_epoch(0)
    assert _plain(first) == list(Loader(_ds(index), num_workers=0))


def test_what_accepts_zero_copy_members(index: Index) -> None:
    from PIL import Image

    sample = next(iter(_ds(index, zero_copy=True)))[0]
    jpg, meta = sample["png" if "png" in sample else "jpg"], sample["json"]
    assert np.frombuffer(jpg, np.uint8).tobytes() == bytes(jpg)
    assert Image.open(io.BytesIO(jpg)).size[0] > 0
    assert json.loads(bytes(meta)) == json.loads(bytes(meta).decode())
    with pytest.raises(TypeError):
        json.loads(meta)  # a view is not a str or bytes: bytes(m) first


@pytest.mark.parametrize("zero_copy", [False, True])
def test_uint8_tensors_share_the_members_memory(index: Index, zero_copy: bool) -> None:
    ds = _ds(index, zero_copy=zero_copy).compose(wds_pad.uint8_tensors("png", "jpg"))
    plain = list(_ds(index))
    for batch, want in zip(Loader(ds, num_workers=2), plain):
        for s, w in zip(batch, want):
            img = "png" if "png" in w else "jpg"
            assert s[img].dtype == torch.uint8 and s[img].numpy().tobytes() == w[img]
            assert s["json"] == w["json"] if not zero_copy else bytes(s["json"]) == w["json"]
    one = next(iter(ds))[0]
    src = next(iter(_ds(index, zero_copy=zero_copy)))[0]
    img = "png" if "png" in src else "jpg"
    src = src[img]
    assert one[img].numpy().tobytes() == bytes(src)
    if zero_copy:  # the tensor is a view: its memory is the batch buffer's
        assert isinstance(src, memoryview)
    with pytest.raises(ConfigError):
        wds_pad.uint8_tensors()


def test_transforms_in_workers_see_bytes_and_batches_keep_their_type(index: Index) -> None:
    ds = _ds(index, zero_copy=True).map(lambda s: {**s, "kind": type(s["json"]).__name__})
    kinds = {s["kind"] for b in Loader(ds, num_workers=2) for s in b}
    assert kinds == {"bytes"}
    assert {s["kind"] for b in Loader(ds, num_workers=0) for s in b} == {"memoryview"}


def test_resume_through_workers_is_exact(index: Index) -> None:
    want = [[s["__key__"] for s in b] for b in Loader(_ds(index), num_workers=0)]
    loader = Loader(_ds(index, zero_copy=True), num_workers=2)
    seen = []
    for i, b in enumerate(loader):
        seen.append([s["__key__"] for s in b])
        if i == 4:
            break
    state = loader.state_dict()
    fresh = Loader(_ds(index, zero_copy=True), num_workers=3)
    fresh.load_state_dict(state)
    seen += [[s["__key__"] for s in b] for b in fresh]
    assert seen == want


def test_the_ring_places_wraps_and_never_overwrites_a_held_batch() -> None:
    arena = Arena(False, size=4096)
    a = arena.alloc(1500)
    b = arena.alloc(1500)
    assert a is not None and b is not None and a[1] + 1500 <= b[1]
    assert arena.alloc(1500) is None  # a and b are held: no room left
    arena.release(a[2])
    c = arena.alloc(1500)  # wraps to a's space
    assert c is not None and c[1] == a[1]
    assert arena.alloc(3000) is None  # larger than half the ring: a buffer of its own
    arena.release(b[2])
    arena.release(c[2])
    held = arena.alloc(10)  # one batch held while more come and go: the space after it waits for it
    assert held is not None
    placed = 0
    while (got := arena.alloc(10)) is not None:
        assert not (got[1] <= held[1] < got[1] + 10)
        arena.release(got[2])
        placed += 1
    assert 0 < placed < SLOTS
    arena.release(held[2])
    for _ in range(3 * SLOTS):  # released in order: the ring and its flags go round for ever
        got = arena.alloc(10)
        assert got is not None
        arena.release(got[2])


def test_a_ring_is_sized_to_its_batches_and_grows_when_full() -> None:
    assert rings.ring_bytes(1000) == rings.RING_BYTES  # small batches: the smallest ring
    assert rings.ring_bytes(1 << 20) == rings.RING_BATCHES << 20
    assert rings.ring_bytes(1 << 20, run=2) == 2 * rings.RING_BATCHES << 20  # batches sent two at a time
    assert rings.ring_bytes(1000, size=rings.RING_BYTES) == 2 * rings.RING_BYTES
    assert rings.ring_bytes(1 << 30) == rings.ARENA_BYTES  # never past the largest
    ring, first = rings.place(None, False, 3000)
    assert first is not None and ring.size == rings.RING_BYTES
    held = [first]
    while (got := rings.place(ring, False, 1 << 20))[0] is ring:
        held.append(got[1])  # every batch held: the ring fills
    bigger, spot = got
    assert bigger.size == 2 * ring.size and spot is not None  # a larger ring, not a buffer per batch
    assert rings.place(bigger, False, rings.ARENA_BYTES)[1] is None  # too large for any ring


def test_a_worker_sends_a_few_hundred_samples_or_a_few_mib_at_a_time() -> None:
    assert transport.run_length(64, 10_000) == 4  # 256 samples
    assert transport.run_length(8, 2_000) == transport.MAX_RUN
    assert transport.run_length(8, 500_000) == 1  # 4 MB batches: one at a time
    assert transport.run_length(wds_pad.Budget(1000.0), 100) == 1  # a budget's batches vary
    assert transport.run_length(1, 1e9) == 1


@pytest.mark.parametrize("workers", [2, 3])
def test_runs_of_batches_through_workers_keep_plan_order_across_epochs(index: Index, workers: int) -> None:
    small = 2
    assert transport.run_length(small, index.length.mean()) > 1  # the batches travel in runs here
    one = Loader(_ds(index, batch_size=small, mode="steps"), num_workers=0)
    want = [[s["__key__"] for s in b] for b in itertools.islice(one, 3 * len(one.dataset))]
    loader = Loader(_ds(index, batch_size=small, mode="steps"), num_workers=workers)
    it = iter(loader)
    got = [[s["__key__"] for s in b] for b in itertools.islice(it, len(want))]
    it.close()
    assert got == want  # three epochs, runs crossing their ends


def test_held_zero_copy_batches_stay_intact_while_the_ring_grows(index: Index, monkeypatch: pytest.MonkeyPatch) -> None:
    want = list(Loader(_ds(index), num_workers=0))
    sizes: list[int] = []
    init = rings.Arena.__init__

    def spy(self, shared, size=rings.ARENA_BYTES):  # type: ignore[no-untyped-def]
        sizes.append(size)
        init(self, shared, size)

    monkeypatch.setattr(rings, "RING_BYTES", 8192)
    monkeypatch.setattr(rings, "RING_BATCHES", 1)
    monkeypatch.setattr(rings.Arena, "__init__", spy)
    got = list(Loader(_ds(index, zero_copy=True), num_workers=0))  # every batch held at once
    assert _plain(got) == want
    assert len(sizes) > 1 and sizes == sorted(sizes) and sizes[-1] > sizes[0]


def test_a_batch_without_its_ring_is_refused_clearly() -> None:
    batch = PackedBatch(None, (1, 2), 0, 0, 0, np.zeros((2, 0), np.int64), [], [], [], [], [], [],
                        ("b", "d", 0, 0, 0))
    with pytest.raises(RuntimeError, match="before the ring itself"):
        batch.samples(False, {})


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_killed_worker_fails_the_loop_with_one_error_and_leaves_no_shared_memory(
        index: Index, context: str) -> None:
    before = _shm()
    loader = Loader(_ds(index, batch_size=2, zero_copy=True), num_workers=2, multiprocessing_context=context)
    received, message = 0, ""
    try:
        for i, _ in enumerate(loader):
            received += 1
            if i == 1:
                victim = _current_workers()[0]
                os.kill(victim, signal.SIGKILL)
                time.sleep(0.5)  # the worker's end reaches this process while the loop body runs
    except WorkerError as exc:  # raised by the loop, not from inside its body
        message = str(exc)
    assert re.search(rf"Loader: .*worker \d \(pid {victim}\) was killed by SIGKILL", message), message
    gc.collect()
    assert _shm() <= before
    fresh = Loader(_ds(index, batch_size=2, zero_copy=True), num_workers=2)  # the state names the last batch
    fresh.load_state_dict(loader.state_dict())
    want = list(Loader(_ds(index, batch_size=2), num_workers=0))
    assert _plain(list(fresh)) == want[received:]


def _current_workers() -> list[int]:
    import multiprocessing

    return [p.pid for p in multiprocessing.active_children()]


_MAIN = textwrap.dedent("""
    import os, sys, time, warnings
    warnings.simplefilter("ignore")
    from wds_pad import BucketedWebDataset, Loader, Topology
    ds = BucketedWebDataset(sys.argv[1], batch_size=2, topology=Topology(1, 0), seed=1,
                            check_agreement=False, zero_copy=True)
    held = []
    if sys.argv[3] == "starting":
        print("ready", flush=True)
    kept = sys.argv[3] == "between"  # killed while its kept workers wait for the next epoch
    for i, b in enumerate(Loader(ds, num_workers=2, multiprocessing_context=sys.argv[2], persistent_workers=kept)):
        held.append(b)
        if i == 2 and not kept:
            print("ready", flush=True)
            time.sleep(600)
    print("ready", flush=True)
    time.sleep(600)
""")


def _children(pid: int) -> list[str]:
    return subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()


@pytest.mark.parametrize("context,when", [("fork", "serving"), ("spawn", "serving"), ("spawn", "starting"),
                                          ("fork", "between")])
def test_a_killed_main_process_leaves_no_shared_memory(index: Index, tmp_path: Path, context: str,
                                                        when: str) -> None:
    """Killed while its workers serve batches, while they still start (a spawn worker
    then runs its first line after its parent is gone), or while kept workers
    (``persistent_workers``) wait between epochs: every process of the job ends and no
    shared memory is left."""
    before = _shm()
    proc = subprocess.Popen([sys.executable, "-c", _MAIN, str(index.path), context, when], stdout=subprocess.PIPE,
                            cwd=str(tmp_path))
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    children = _children(proc.pid)
    if when == "starting":  # kill as soon as both workers (and spawn's resource tracker) exist
        for _ in range(1200):
            if len(children) >= 3:
                break
            import time

            time.sleep(0.01)
            children = _children(proc.pid)
        assert len(children) >= 3, f"the workers never started: {children}"
    proc.kill()
    proc.wait()
    left = []
    for pid in children:  # the workers see their parent gone and exit (a hang bound, not a timing)
        for _ in range(1200):
            if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z":
                break
            import time

            time.sleep(0.05)
        else:
            left.append(pid)
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the killed job still running after 60 s: {left}"
    assert _shm() <= before


def test_a_worker_whose_starting_process_is_gone_exits_in_its_init() -> None:
    """A worker still starting when the main process was killed sees init as its parent
    (torch's watchdog would take init's pid and serve nobody for ever): it exits there."""
    from wds_pad.stream.workers import _MarkStarted

    ran: list[int] = []
    for parent, code in ((os.getpid(), 3), (os.getpid() + 10**6, 0)):  # its real parent; one that is gone
        pid = os.fork()
        if pid == 0:
            _MarkStarted(None, ran.append, parent)(0)
            os._exit(3 if ran == [0] else 4)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == code


@pytest.mark.parametrize("zero_copy", [False, True])
def test_a_shard_cut_short_under_an_open_descriptor_is_one_clear_error(tmp_path: Path, zero_copy: bool) -> None:
    """A batch read into one buffer from shards already open (their reads issued together)
    notices a short read like the per-sample path does: the exact path reads the batch
    again and names the shard."""
    index = image_index(tmp_path, samples=64, shards=2, seed=3)
    it = iter(Loader(_ds(index, batch_size=2, zero_copy=zero_copy), num_workers=0))
    for _ in range(4):  # every shard opened
        next(it)
    for url in index.urls:
        os.truncate(url, os.path.getsize(url) // 2)
    with pytest.raises(wds_pad.WdsPadError, match=r"\.tar"):
        for _ in it:
            pass


def test_fetched_samples_are_packed_once_or_left_loose() -> None:
    def sample(i: int, **extra: Any) -> dict[str, Any]:
        s = {"__url__": f"http://h/s{i % 2}.tar", "__key__": f"k{i}", "__index__": i, "__bucket__": "b",
             "__dataset__": "d", "__pad__": i == 2, "__epoch__": 0, "__step__": 3, "__batch__": 5, "__seed__": 7 + i,
             "jpg": bytes([i]) * (100 + i), "json": b"{}"}
        s.update(extra)
        return s

    batch = [sample(i) for i in range(4)] + [{**sample(4), "txt": b""}]  # members differ between samples
    ring, packed = transport.pack_samples(batch, None, False)
    assert packed is not None and ring is not None and packed.ring == ring.id
    rings_seen: dict[Any, Any] = {}
    assert packed.samples(rings=rings_seen) == batch
    assert [list(s) for s in packed.samples(zero_copy=True, rings=rings_seen)] == [list(s) for s in batch]
    # what a packed batch does not carry travels loose: a substitute's fields, a pack, a member not bytes
    for odd in (sample(0, __substitute_for__="k9"), sample(0, __pack__=1), sample(0, jpg=memoryview(b"x"))):
        assert transport.pack_samples([sample(1), odd], ring, False) == (ring, None)
