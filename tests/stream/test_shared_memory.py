"""Shared memory runs out (a container's /dev/shm is 64 MiB by default): the loader slows
down, it never stops.

- a batch no shared memory can hold is written into the worker's own memory and crosses
  through the pipe: the same batches, with ``bytes`` and with views, and one
  ``SharedMemoryWarning`` an iteration naming /dev/shm and the fix;
- a worker that ran out tries shared memory again only ``AVOID_BATCHES`` batches later;
- a ring takes at most its share of the free shared memory;
- no shared memory left at all, not even for the loader's flags: one ``WorkerStartError``
  saying what to do;
- the same against a real, small /dev/shm (a tmpfs in a mount namespace of its own),
  where this system lets a test make one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from wds_pad import SharedMemoryWarning, Topology, WorkerStartError
from wds_pad.index.record import Index
from wds_pad.stream import ring as rings
from wds_pad.stream.loader import Loader

from data_helpers import image_index, make_dataset

pytestmark = pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning")

NO_SPACE = "unable to allocate shared memory(shm) for file </torch_1_2_3>: No space left on device (28)"
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Index:
    return image_index(tmp_path_factory.mktemp("shm"), samples=96, shards=4, seed=5)


@pytest.fixture(autouse=True)
def fresh() -> None:
    rings._fresh()  # no earlier test's shortage carries over


def _ds(index: Index, **kw):  # type: ignore[no-untyped-def]
    return make_dataset(index, quiet=True, seed=7, topology=Topology(1, 0), check_agreement=False, **kw)


def _plain(batches: list) -> list:  # type: ignore[type-arg]
    return [[{k: bytes(v) if isinstance(v, memoryview) else v for k, v in s.items()} for s in b] for b in batches]


def _no_shared_memory(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every new shared buffer fails as torch fails on a full /dev/shm (forked workers too)."""
    asked: list[int] = []

    def full(size: int) -> None:
        asked.append(size)
        raise RuntimeError(NO_SPACE)

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", full)
    return asked


def test_a_batch_no_shared_memory_holds_goes_in_the_reader_s_own_memory_and_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _no_shared_memory(monkeypatch)
    space = rings.reserve(None, True, 5000)
    assert space.short is not None and "could not get 5 KiB of shared memory" in space.short
    assert "No space left on device" in space.short and "/dev/shm" in space.short
    assert isinstance(space.buf, np.ndarray) and space.buf is space.arr and space.arr.size == 5000
    assert space.ring is None
    space.sent()  # a batch of its own: nothing of a ring to mark
    tried = len(asked)
    assert tried >= 1
    for _ in range(rings.AVOID_BATCHES):  # not tried again for a while: each try costs a full allocation
        assert rings.reserve(None, True, 5000).short == space.short
    assert len(asked) == tried
    assert rings.reserve(None, True, 5000).short is not None  # then tried again, and short again
    assert len(asked) > tried
    monkeypatch.undo()  # room again
    for _ in range(rings.AVOID_BATCHES):
        rings.reserve(None, True, 5000)
    back = rings.reserve(None, True, 5000)
    assert back.short is None and isinstance(back.buf, torch.Tensor) and back.buf.is_shared()


def test_other_errors_of_a_shared_buffer_are_not_taken_for_a_shortage(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(size: int) -> None:  # torch's words when the process has no descriptor left
        raise RuntimeError("unable to open shared memory object </torch_1_2_3> in read-write mode: "
                           "Too many open files (24)")

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", broken)
    with pytest.raises(RuntimeError, match="Too many open files"):
        rings.reserve(None, True, 5000)


def test_a_ring_takes_at_most_its_share_of_the_free_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rings, "shm_room", lambda path=rings.SHM: (64 << 20, 20 << 20))
    assert rings.ring_cap(True) == 10 << 20  # half the free 20 MiB, one process
    assert rings.ring_cap(False) == rings.ARENA_BYTES  # a process's own memory: not bounded so
    ring, spot = rings.place(None, True, 1 << 20)
    assert ring is not None and spot is not None and ring.size == rings.RING_BATCHES << 20  # under the cap
    ring, spot = rings.place(None, True, 4 << 20)  # wants 16 MiB
    assert ring is not None and spot is not None and ring.size == 10 << 20
    monkeypatch.setattr(rings, "get_worker_info", lambda: SimpleNamespace(num_workers=4))
    assert rings.ring_cap(True) == (20 << 20) // 8  # shared among the loader's workers
    monkeypatch.setattr(rings, "shm_room", lambda path=rings.SHM: (64 << 20, 1 << 20))
    assert rings.place(None, True, 1 << 20) == (None, None)  # no ring holds two such batches: each its own
    space = rings.reserve(None, True, 1 << 20)
    assert space.ring is None and space.short is None and isinstance(space.buf, torch.Tensor)
    monkeypatch.setattr(rings, "shm_room", lambda path=rings.SHM: None)  # no /dev/shm to measure
    assert rings.ring_cap(True) == rings.ARENA_BYTES


@pytest.mark.parametrize("zero_copy", [False, True])
def test_workers_without_shared_memory_give_the_same_batches_and_warn_once(
        index: Index, monkeypatch: pytest.MonkeyPatch, zero_copy: bool) -> None:
    want = _plain(list(Loader(_ds(index, zero_copy=zero_copy), num_workers=0)))
    asked = _no_shared_memory(monkeypatch)
    with pytest.warns(SharedMemoryWarning) as seen:
        got = list(Loader(_ds(index, zero_copy=zero_copy), num_workers=2, multiprocessing_context="fork"))
    assert _plain(got) == want
    if zero_copy:
        assert all(type(v) is memoryview for b in got for s in b for k, v in s.items() if not k.startswith("__"))
    warned = [w for w in seen if issubclass(w.category, SharedMemoryWarning)]
    assert len(warned) == 1  # once an iteration, not once a batch
    text = str(warned[0].message)
    assert text.startswith("Loader: a DataLoader worker could not get")
    assert "No space left on device" in text and "--shm-size" in text and "fewer workers" in text
    assert warned[0].filename == __file__  # points at the loop
    assert not asked  # the workers asked, in their own processes; this one made no ring


def test_no_shared_memory_left_for_the_loader_s_flags_is_one_clear_error(
        index: Index, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(self: torch.Tensor) -> None:
        raise RuntimeError(NO_SPACE)

    monkeypatch.setattr(torch.Tensor, "share_memory_", full)
    with pytest.raises(WorkerStartError, match=r"^Loader: its DataLoader workers cannot start: no shared memory is "
                                               r"left .*No space left on device.*--shm-size.*num_workers=0"):
        list(Loader(_ds(index), num_workers=2))
    assert list(Loader(_ds(index), num_workers=0))  # without workers it needs none


_SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    sys.path[:0] = [{tests!r}]
    from data_helpers import image_index, make_dataset
    from pathlib import Path
    from wds_pad import Topology
    from wds_pad.stream.loader import Loader
    from wds_pad.errors import WdsPadError
    warnings.simplefilter("ignore")
    warnings.simplefilter("always", category=__import__("wds_pad").SharedMemoryWarning)
    index = image_index(Path({data!r}), samples=96, shards=4, seed=5)
    def ds(zc):
        return make_dataset(index, quiet=True, seed=7, topology=Topology(1, 0), check_agreement=False, zero_copy=zc)
    out = {{}}
    for zc in (False, True):
        want = [[s["__key__"] for s in b] for b in Loader(ds(zc), num_workers=0)]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", category=__import__("wds_pad").SharedMemoryWarning)
            try:
                got = [[s["__key__"] for s in b] for b in Loader(ds(zc), num_workers=2)]
                out[str(zc)] = {{"same": got == want, "n": sum(map(len, got)),
                                "warned": [str(w.message) for w in seen]}}
            except WdsPadError as exc:
                out[str(zc)] = {{"error": type(exc).__name__, "message": str(exc)}}
    print(json.dumps(out))
""")


def _in_small_shm(tmp_path: Path, fill_kib: int) -> dict:  # type: ignore[type-arg]
    """The script in a mount namespace whose /dev/shm is a 2 MiB tmpfs, ``fill_kib`` of it taken."""
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT.format(tests=str(TESTS), data=str(tmp_path / "data")))
    fill = f"dd if=/dev/zero of=/dev/shm/taken bs=1k count={fill_kib} 2>/dev/null; " if fill_kib else ""
    shell = f"mount -t tmpfs -o size=2m tmpfs /dev/shm && {fill}exec {sys.executable} {script}"
    run = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", shell],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _can_mount_a_tmpfs() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None or not os.path.isdir("/dev/shm"):
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True)
    return probe.returncode == 0


small_shm = pytest.mark.skipif(not _can_mount_a_tmpfs(), reason="mounting a tmpfs needs root and unshare(1); "
                               "the tests above cover the same paths with torch's allocation made to fail")


@small_shm
def test_a_real_small_dev_shm_slows_the_loader_down_and_never_stops_it(tmp_path: Path) -> None:
    out = _in_small_shm(tmp_path, fill_kib=1900)  # about 100 KiB left: no ring, few batches fit
    for zc in ("False", "True"):
        assert out[zc]["same"] and out[zc]["n"] > 0, out
        assert len(out[zc]["warned"]) == 1, out
        assert "/dev/shm holds 2 MiB" in out[zc]["warned"][0] and "--shm-size" in out[zc]["warned"][0]


@small_shm
def test_a_full_real_dev_shm_is_one_clear_error(tmp_path: Path) -> None:
    out = _in_small_shm(tmp_path, fill_kib=2048)
    for zc in ("False", "True"):
        assert out[zc]["error"] == "WorkerStartError", out
        assert "no shared memory is left" in out[zc]["message"] and "/dev/shm holds 2 MiB, 0 MiB of it free" in \
            out[zc]["message"]


def test_runs_shrink_to_fit_a_ring_capped_by_a_small_dev_shm(index: Index, monkeypatch: pytest.MonkeyPatch) -> None:
    from wds_pad.stream import loader as loader_module, transport

    assert transport.run_length(64, 10_000) == 4  # 256 samples, 2.5 MB
    assert transport.run_length(64, 10_000, most=64 << 20) == 4  # never past RUN_BYTES
    assert transport.run_length(64, 10_000, most=1 << 20) == 1  # a 4 MiB ring holds four 1 MiB runs
    want = list(Loader(_ds(index, batch_size=2), num_workers=0))
    assert transport.run_length(2, index.length.mean()) > 1  # these batches travel in runs of several
    runs: list[int] = []
    real = loader_module.unpacked

    def spy(item, *args):  # type: ignore[no-untyped-def]
        runs.append(len(item) if isinstance(item, transport.PackedRun) else 1)
        return real(item, *args)

    monkeypatch.setattr(loader_module, "unpacked", spy)
    monkeypatch.setattr(rings, "shm_room", lambda path=rings.SHM: (64 << 20, 64 << 10))  # 64 KiB free: tiny rings
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", SharedMemoryWarning)  # the workers never ran out: their rings fit
        got = list(Loader(_ds(index, batch_size=2), num_workers=2, multiprocessing_context="fork"))
    assert got == want and len(got) > 8
    assert runs and set(runs) == {1}  # one batch a message, to fit the capped rings
