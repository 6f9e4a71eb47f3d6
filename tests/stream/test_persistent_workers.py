"""``Loader(..., persistent_workers=True)``: the workers of an iteration that ran to its end
serve the next one, started at the loader's position through their shared ``[epoch, index]``.

Every epoch is checked against the batches of one process; the workers' pids show when
they were kept and when they were replaced; their kept mappings show in /proc.
"""

from __future__ import annotations

import gc
import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from wds_pad import ConfigError, ShardLoader, ShardStream, Topology, WorkerError
from wds_pad.index.record import Index
from wds_pad.io import shardmaps
from wds_pad.state import Cursor
from wds_pad.stream.loader import Loader, _Workers

from data_helpers import image_index, make_dataset, serve_dir

pytest_plugins = ["conftest_servers"]
pytestmark = pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning")


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Index:
    return image_index(tmp_path_factory.mktemp("persistent"), samples=96, shards=4, seed=11)


@pytest.fixture(autouse=True)
def _no_disk_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A page cache dropped by the machine meanwhile would turn mapping off (forked workers
    inherit this)."""
    monkeypatch.setattr(shardmaps, "faults", lambda: 0)


def _ds(index: Index, **kw):  # type: ignore[no-untyped-def]
    return make_dataset(index, quiet=True, seed=7, topology=Topology(1, 0), check_agreement=False, **kw)


def _plain(batch: list) -> list:  # type: ignore[type-arg]
    return [{k: bytes(v) if isinstance(v, memoryview) else v for k, v in s.items()} for s in batch]


def _epochs(loader: Loader, epochs: range) -> list[list]:  # type: ignore[type-arg]
    out = []
    for e in epochs:
        loader.set_epoch(e)
        out.append([_plain(b) for b in loader])
    return out


def _pids(loader: Loader) -> list[int]:
    assert len(loader._kept) == 1, "no workers kept"
    return [w.pid for w in loader._kept[0].batches._workers]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("context,zero_copy", [("fork", False), ("fork", True), ("spawn", False)])
def test_kept_workers_give_every_epoch_the_batches_of_one_process(index: Index, context: str,
                                                                   zero_copy: bool) -> None:
    want = _epochs(Loader(_ds(index), num_workers=0), range(3))
    loader = Loader(_ds(index, zero_copy=zero_copy), num_workers=2, persistent_workers=True,
                    multiprocessing_context=context)
    got = [_epochs(loader, range(1))[0]]
    pids = _pids(loader)
    got += _epochs(loader, range(1, 3))
    assert got == want and len({len(e) for e in got}) == 1
    assert _pids(loader) == pids  # the same processes served all three epochs
    loader.close()
    assert loader._kept == [] and all(_gone(p) for p in pids)


def test_kept_workers_read_later_epochs_out_of_mappings(index: Index) -> None:
    """A kept worker maps a shard from its second stream on (io/shardmaps.py), as one
    process does; workers that live one epoch never map."""
    shards = {os.path.realpath(u) for u in index.urls}

    def mapped(pid: int) -> set[str]:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6} & shards

    loader = Loader(_ds(index), num_workers=2, persistent_workers=True)
    _epochs(loader, range(1))
    pids = _pids(loader)
    assert [mapped(p) for p in pids] == [set(), set()]
    _epochs(loader, range(1, 3))
    assert set().union(*(mapped(p) for p in _pids(loader))) == shards
    loader.close()


def test_zero_copy_views_of_an_earlier_epoch_survive_the_kept_rings(index: Index) -> None:
    loader = Loader(_ds(index, zero_copy=True), num_workers=2, persistent_workers=True)
    held = list(loader)  # every view of epoch 0 held while the same rings serve two more epochs
    _epochs(loader, range(1, 3))
    assert [_plain(b) for b in held] == _epochs(Loader(_ds(index), num_workers=0), range(1))[0]
    loader.close()


def test_kept_workers_of_remote_shards_reuse_their_rings(index: Index, nginx_server: Any) -> None:
    """Fetched samples are packed into a kept worker's ring, made once: the main process
    keeps the rings it has seen for as long as the workers live, so a ring a worker made
    every epoch would pile up there."""
    local = os.path.dirname(index.urls[0])
    url = serve_dir(nginx_server, Path(local), "persistent")
    want = _epochs(Loader(_ds(index), num_workers=0), range(3))
    remote = make_dataset(str(index.path), quiet=True, seed=7, topology=Topology(1, 0), check_agreement=False,
                          relocate={local: url})
    assert remote.spec.indexes[0].urls[0].startswith("http://")
    loader = Loader(remote, num_workers=2, persistent_workers=True)
    got = _epochs(loader, range(1))
    rings = set(loader._kept[0].rings)
    got += _epochs(loader, range(1, 3))
    assert [[{k: v for k, v in s.items() if k != "__url__"} for s in b] for e in got for b in e] == \
        [[{k: v for k, v in s.items() if k != "__url__"} for s in b] for e in want for b in e]
    assert rings and set(loader._kept[0].rings) == rings
    loader.close()


def test_a_restored_position_is_served_by_the_kept_workers(index: Index) -> None:
    want = _epochs(Loader(_ds(index), num_workers=0), range(2))
    other = Loader(_ds(index), num_workers=0)
    other.set_epoch(1)
    for i, _ in enumerate(other):
        if i == 4:
            break
    state = other.state_dict()
    loader = Loader(_ds(index), num_workers=2, persistent_workers=True)
    assert _epochs(loader, range(1)) == want[:1]
    pids = _pids(loader)
    loader.load_state_dict(state)
    loader.set_epoch(1)  # the documented loop calls it: the restored position stays
    assert [_plain(b) for b in loader] == want[1][5:]
    assert _pids(loader) == pids
    loader.close()


def test_an_early_stop_ends_the_workers_and_the_next_iteration_goes_on_exactly(index: Index) -> None:
    want = _epochs(Loader(_ds(index), num_workers=0), range(2))
    loader = Loader(_ds(index), num_workers=2, persistent_workers=True)
    _epochs(loader, range(1))
    first = _pids(loader)
    loader.set_epoch(1)
    got = []
    for i, b in enumerate(loader):
        got.append(_plain(b))
        if i == 2:
            break
    assert loader._kept == [] and all(_gone(p) for p in first)  # stopped early: not kept
    got += [_plain(b) for b in loader]  # new workers, from the loader's position
    assert got == want[1]
    assert not set(_pids(loader)) & set(first)
    loader.close()


def test_a_collected_loader_ends_its_kept_workers(index: Index) -> None:
    loader = Loader(_ds(index), num_workers=2, persistent_workers=True)
    list(loader)
    pids = _pids(loader)
    del loader
    gc.collect()
    assert all(_gone(p) for p in pids)


def test_a_kept_worker_killed_between_epochs_is_one_worker_error_and_the_next_start_is_fresh(
        index: Index) -> None:
    want = _epochs(Loader(_ds(index), num_workers=0), range(2))
    loader = Loader(_ds(index), num_workers=2, persistent_workers=True)
    _epochs(loader, range(1))
    victim, other = _pids(loader)
    os.kill(victim, signal.SIGKILL)
    loader.set_epoch(1)
    with pytest.raises(WorkerError, match=rf"kept between iterations.*worker 0 \(pid {victim}\) was killed by SIGKILL"):
        next(iter(loader))
    assert loader._kept == [] and _gone(other)  # the other kept worker ended with it
    assert _epochs(loader, range(1, 2)) == want[1:]  # new workers, nothing handed out before
    loader.close()


def test_kept_workers_serve_a_start_that_differs_only_in_its_epoch_and_index() -> None:
    start = Cursor(2, 3, pinned=True)
    kept = _Workers(None, None, start, torch.zeros(2, dtype=torch.int64))
    assert kept.serves(Cursor(5, 0, pinned=True)) and kept.serves(start)
    assert not kept.serves(Cursor(5, 0))  # not pinned: another cursor than the workers hold
    assert not kept.serves(replace(start, view=object()))  # an elastic epoch's view: new workers
    assert not _Workers(None, None, start).serves(start)  # workers not kept have no shared start


def test_the_stats_of_kept_workers_are_folded_in_at_every_epoch_end(index: Index) -> None:
    """A kept worker counts each iteration on a clock of its own; the main process folds
    its last note in when the iteration ends, as with workers of one epoch."""
    loader = Loader(_ds(index), num_workers=2, persistent_workers=True)
    made = []
    for e in range(3):
        _epochs(loader, range(e, e + 1))
        assert loader.dataset._clock.workers == {}  # folded in
        st = loader.stats()
        assert st.batches == (e + 1) * len(loader)
        made.append(st.tar_s)
    assert 0 < made[0] < made[1] < made[2]  # every epoch's making counted once more
    loader.close()


@pytest.mark.parametrize("bad,message", [
    ({"num_workers": 0, "persistent_workers": True}, "persistent_workers=True needs num_workers > 0"),
    ({"num_workers": 2, "persistent_workers": "yes"}, "persistent_workers must be True or False"),
])
def test_wrong_persistent_workers_are_refused(index: Index, bad: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=message):
        Loader(_ds(index), **bad)
    assert Loader(_ds(index), num_workers=0, persistent_workers=False).persistent_workers is False


def test_shardloader_still_refuses_persistent_workers(index: Index) -> None:
    with pytest.raises(ConfigError, match="ShardLoader does not take persistent_workers="):
        ShardLoader(ShardStream(index, topology=Topology(1, 0), seed=1), num_workers=2, persistent_workers=True)
