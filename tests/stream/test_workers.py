"""A DataLoader worker stuck in the fork is replaced; the plan continues exactly.

The stuck worker is made the way CPython 3.11.9 makes it under DDP (gh-112275): the child
never gets past the fork. Here an at-fork hook (registered once, armed per test) blocks the
first N forked children before they run any of torch's worker code, so they never reach a
``worker_init_fn``; the parent cannot tell the difference.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Iterator

import pytest

import wds_pad.stream.workers as workers
from wds_pad import Topology, WorkerError, WorkerStartError, WorkerStartWarning
from wds_pad.errors import ConfigError
from wds_pad.index.record import Index
from wds_pad.stream.loader import Loader
from wds_pad.stream.shardstream import ShardLoader, ShardStream
from wds_pad.stream.workers import start_method

from data_helpers import batch_keys, image_index, make_dataset, plan_keys

pytestmark = pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning")

_ARMED: dict[str, object] = {"dir": None, "hangs": 0}


def _hang_in_child() -> None:
    """In a forked child: if armed and a hang is left, record this pid and never go on."""
    folder = _ARMED["dir"]
    if folder is None:
        return
    for n in range(int(_ARMED["hangs"])):  # type: ignore[arg-type]
        try:
            fd = os.open(os.path.join(str(folder), f"hung-{n}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        while True:
            time.sleep(3600)


os.register_at_fork(after_in_child=_hang_in_child)


@pytest.fixture()
def hang(tmp_path: Path) -> Iterator[object]:
    """``hang(n)``: the next n forked children of this process get stuck; their pids are returned after."""
    folder = tmp_path / "hung"
    folder.mkdir()

    def arm(n: int) -> Path:
        _ARMED.update(dir=str(folder), hangs=n)
        return folder

    yield arm
    _ARMED.update(dir=None, hangs=0)


def _hung_pids(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(folder.glob("hung-*")) if p.read_text()]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie has ended (its parent reaps it)
        return f.read().split(") ")[1].startswith("Z")


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Index:
    return image_index(tmp_path_factory.mktemp("workers"), samples=64, shards=4, seed=5)


needs_fork = pytest.mark.skipif(start_method(None) != "fork", reason="the watch is for forked workers")


@needs_fork
def test_a_worker_stuck_in_the_fork_is_replaced_and_the_plan_continues_exactly(index: Index, hang) -> None:
    ds = make_dataset(index, quiet=True, seed=3, topology=Topology(2, 1), check_agreement=False)
    expected = plan_keys(ds.plan(0), index)
    loader = Loader(ds, num_workers=2, worker_start_timeout=1.0)
    folder = hang(1)
    with pytest.warns(WorkerStartWarning, match=r"Loader: DataLoader worker\(s\) \[0\].*did not start within 1 s"):
        got = batch_keys(loader)
    assert got == expected
    assert loader.state_dict() == Loader(ds).state_dict()  # at the epoch's end, counted once
    stuck = _hung_pids(folder)
    assert len(stuck) == 1 and _gone(stuck[0])  # killed, not left holding the job's pipes


@needs_fork
def test_a_restored_position_survives_the_replacement(index: Index, hang) -> None:
    ds = make_dataset(index, quiet=True, seed=3, topology=Topology(2, 0), check_agreement=False)
    expected = plan_keys(ds.plan(0), index)
    first = Loader(ds, num_workers=1)
    it = iter(first)
    for _ in range(3):
        next(it)
    it.close()
    state = first.state_dict()
    resumed = Loader(make_dataset(index, quiet=True, seed=3, topology=Topology(2, 0), check_agreement=False),
                     num_workers=1, worker_start_timeout=0.5)
    resumed.load_state_dict(state)
    hang(1)
    with pytest.warns(WorkerStartWarning):
        assert batch_keys(resumed) == expected[3:]


@needs_fork
def test_a_worker_stuck_in_every_attempt_is_one_clear_error(index: Index, hang, monkeypatch) -> None:
    monkeypatch.setattr(workers, "ATTEMPTS", 2)
    loader = Loader(make_dataset(index, quiet=True, seed=3, topology=Topology(1, 0), check_agreement=False),
                    num_workers=1, worker_start_timeout=0.5)
    folder = hang(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", WorkerStartWarning)
        with pytest.raises(WorkerStartError, match=r"in 2 attempts.*worker_start_timeout=.*forkserver.*3\.11\.10"):
            next(iter(loader))
    stuck = _hung_pids(folder)
    assert len(stuck) == 2 and all(_gone(p) for p in stuck)
    assert loader.state_dict()["per_rank"] == Loader(loader.dataset).state_dict()["per_rank"]  # nothing counted


@needs_fork
def test_shardloader_replaces_a_stuck_worker_too(index: Index, hang) -> None:
    def stream() -> ShardStream:
        return ShardStream(index, topology=Topology(1, 0), seed=1)

    expected = [s["__key__"] for s in ShardLoader(stream(), num_workers=2)]
    hang(1)
    with pytest.warns(WorkerStartWarning, match="ShardLoader"):
        got = [s["__key__"] for s in ShardLoader(stream(), num_workers=2, worker_start_timeout=1.0)]
    assert got == expected


def test_a_worker_that_dies_ends_a_shardloader_with_one_error(index: Index) -> None:
    import multiprocessing
    import signal

    loader = ShardLoader(ShardStream(index, topology=Topology(1, 0), seed=1), num_workers=2, prefetch_factor=1)
    with pytest.raises(WorkerError, match=r"ShardLoader: .*worker \d \(pid \d+\) (was killed by SIGTERM|exited with code 0).*"
                                          r"shardloader\.state_dict\(\)"):
        for i, _ in enumerate(loader):
            if i == 1:
                os.kill(multiprocessing.active_children()[0].pid, signal.SIGTERM)


def test_a_worker_error_is_its_own_not_a_worker_death(index: Index) -> None:
    def boom(sample: dict) -> dict:
        raise RuntimeError("a stage of the user's failed")

    stream = ShardStream(index, topology=Topology(1, 0), seed=1).map(boom)
    with pytest.raises(RuntimeError, match="a stage of the user's failed") as err:
        list(ShardLoader(stream, num_workers=2))
    assert not isinstance(err.value, WorkerError)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 8 worker processes")
def test_an_error_of_the_last_of_eight_workers_is_its_own_though_torch_stopped_that_worker(
        index: Index, monkeypatch: pytest.MonkeyPatch) -> None:
    """The failing worker's iteration ends with its error; torch tells it to exit (code 0)
    as soon as that end reaches the main process, which may be before the main process
    comes, in plan order, to the error itself: that worker is not a death."""
    from torch.utils.data import get_worker_info
    from wds_pad.stream import batchread, transport

    real = batchread.BatchReader.read_packed

    def fails_in_the_last(self, batch, shared):  # type: ignore[no-untyped-def]
        if get_worker_info().id == 7:
            raise RuntimeError("the last worker's read failed")
        return real(self, batch, shared)

    monkeypatch.setattr(batchread.BatchReader, "read_packed", fails_in_the_last)
    monkeypatch.setattr(transport, "RUN_SAMPLES", 1)  # a batch a message: every worker has batches
    loader = Loader(make_dataset(index, quiet=True, seed=7, topology=Topology(1, 0), check_agreement=False,
                                 batch_size=2), num_workers=8, multiprocessing_context="fork")
    got = 0
    with pytest.raises(RuntimeError, match="the last worker's read failed") as err:
        for _ in loader:
            got += 1
            time.sleep(0.05)  # the failing worker's end reaches the main process before its turn
    assert not isinstance(err.value, WorkerError)
    assert got == 7  # the batches of workers 0-6, then worker 7's first: its error


def test_the_users_worker_init_fn_still_runs_in_every_worker(index: Index, tmp_path: Path) -> None:
    def init(worker_id: int) -> None:
        (tmp_path / f"init-{worker_id}").write_text(str(os.getpid()))

    ds = make_dataset(index, quiet=True, seed=3, topology=Topology(1, 0), check_agreement=False)
    assert batch_keys(Loader(ds, num_workers=2, worker_init_fn=init)) == plan_keys(ds.plan(0), index)
    assert sorted(p.name for p in tmp_path.glob("init-*")) == ["init-0", "init-1"]


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "10", True])
def test_a_wrong_worker_start_timeout_is_refused(index: Index, bad: object) -> None:
    ds = make_dataset(index, quiet=True, seed=3, topology=Topology(1, 0), check_agreement=False)
    with pytest.raises(ConfigError, match="worker_start_timeout must be a finite number of seconds > 0"):
        Loader(ds, num_workers=1, worker_start_timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ShardLoader: worker_start_timeout"):
        ShardLoader(ShardStream(index, topology=Topology(1, 0), seed=1), worker_start_timeout=bad)  # type: ignore[arg-type]


def test_the_start_method_is_read_without_fixing_the_default() -> None:
    import multiprocessing

    before = multiprocessing.get_start_method(allow_none=True)
    assert start_method(None) in multiprocessing.get_all_start_methods()
    assert multiprocessing.get_start_method(allow_none=True) == before
    assert start_method("spawn") == "spawn"
    assert start_method(multiprocessing.get_context("forkserver")) == "forkserver"


class _Fetching:
    """A DataLoader iterator whose next batch's shared memory cannot be fetched: torch's
    resource sharer lost the connection to the worker that holds it."""

    def __init__(self, workers: list) -> None:
        self._workers = workers

    def __iter__(self) -> "_Fetching":
        return self

    def __next__(self) -> None:
        raise ConnectionResetError(104, "Connection reset by peer")


def test_a_worker_killed_while_its_batch_is_fetched_is_one_worker_error() -> None:
    import multiprocessing
    import signal

    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    child.start()
    os.kill(child.pid, signal.SIGKILL)  # not yet reaped: watched() waits for it to be
    try:
        with pytest.raises(WorkerError, match=rf"worker 0 \(pid {child.pid}\) was killed by SIGKILL"):
            next(workers.watched(_Fetching([child]), "Loader"))
    finally:
        child.join()


def test_a_lost_connection_with_every_worker_alive_is_not_called_a_death() -> None:
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    child.start()
    try:
        with pytest.raises(ConnectionResetError):
            next(workers.watched(_Fetching([child]), "Loader"))
    finally:
        child.kill()
        child.join()


def test_the_named_segments_a_killed_worker_left_half_made_are_removed_and_no_others(tmp_path: Path) -> None:
    """torch unlinks a segment right after making it: a name ``torch_<pid>_...`` is left
    only by a worker killed in between, and the loop removes it when it shuts its workers down."""
    for name in ("torch_4321_99_0", "torch_4321_7_3", "torch_43210_1_0", "torch_1234_5_0", "sem.mp-x"):
        (tmp_path / name).write_bytes(b"")
    assert workers._remove_segments(4321, root=str(tmp_path)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sem.mp-x", "torch_1234_5_0", "torch_43210_1_0"]
    assert workers._remove_segments(None, root=str(tmp_path)) == 0


@pytest.mark.parametrize("owner", ["Loader", "ShardLoader"])
def test_the_loading_span_is_in_a_profilers_trace_and_costs_nothing_without_one(
        index: Index, owner: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Items are taken from DataLoader without its per-item profiler span unless a profiler
    runs: then each one is in the trace (an item: a worker's message), as DataLoader's own
    loop records it."""
    import torch

    def loader() -> Loader | ShardLoader:
        if owner == "Loader":
            return Loader(make_dataset(index, quiet=True, seed=3, topology=Topology(1, 0), check_agreement=False),
                          num_workers=2)
        return ShardLoader(ShardStream(index, topology=Topology(1, 0), seed=3), num_workers=2)

    want = [repr(b) for b in loader()]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = [repr(b) for b in loader()]
    assert got == want
    spans = [e for e in prof.events() if e.name.startswith("enumerate(DataLoader)#")]
    assert len(spans) >= 2  # one per message from a worker (a run of batches each), and the end
    entered: list[int] = []
    real = torch.autograd.profiler.record_function.__enter__
    monkeypatch.setattr(torch.autograd.profiler.record_function, "__enter__",
                        lambda self: entered.append(1) or real(self))
    assert [repr(b) for b in loader()] == want and not entered  # no span without a profiler
