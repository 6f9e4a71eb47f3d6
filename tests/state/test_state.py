"""Tests of wds_pad.state (schema, verify, files, elastic): schema, refusals, state files, elastic views.

Refusals: each field of the topology and of the plan fingerprint, changed alone, is
refused with the right class and a message naming it as saved and as now; the refused
loader then streams its own plan from its own position.
"""

from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from wds_pad.cli.synth import make_image_shards
from wds_pad.stream.dataset import BucketedWebDataset
from wds_pad.stream.loader import Loader
from wds_pad.errors import StateError, StateMismatchError, TopologyMismatchError, WdsPadError
from wds_pad.index.codec import load_index
from wds_pad.index.record import Index
from wds_pad.index.build import build_index
from wds_pad.core.planning.plan import plan_epoch
from wds_pad.core.elastic.remainder import Segment
from wds_pad.state import elastic_view, load_state_file, save_state_file, state_path
from wds_pad.core.topology import Topology

from data_helpers import aspect_index, make_dataset

pytestmark = pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning")


@pytest.fixture(scope="module")
def indexes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Index, Index]:
    d = tmp_path_factory.mktemp("shards")
    paths = make_image_shards(d, samples=96, shards=3, seed=2)
    return aspect_index(paths, d / "a.wdsidx"), aspect_index(paths[:2], d / "b.wdsidx")


BASE: dict[str, Any] = dict(batch_size=4, seed=3, topology=Topology(4, 1), pad="cyclic", mode="epochs",
                            pad_to="batch", oversubscribe=False, repeats=0, weights=1.0)


def make(index: Index, **kw: Any) -> BucketedWebDataset:
    return make_dataset(index, quiet=True, check_agreement=False, **{**BASE, **kw})


def keys(batches: Any) -> list[list[tuple[str, bool]]]:
    return [[(s["__key__"], bool(s["__pad__"])) for s in b] for b in batches]


# (what changes, the message fragment naming it, the error class)
CHANGES = [
    ("world_size", dict(topology=Topology(8, 1)), "topology.world_size: saved 4, now 8", TopologyMismatchError),
    ("rank", dict(topology=Topology(4, 2)), "topology.rank: saved 1, now 2", TopologyMismatchError),
    ("cp_size", dict(topology=Topology(4, 1, cp_size=2)), "topology.cp_size: saved 1, now 2", TopologyMismatchError),
    ("dp layout", dict(base=dict(topology=Topology(4, 1, cp_size=2)),  # dp_rank 0, cp_rank 1
                       topology=Topology(4, 1, cp_size=2, dp_rank=1, cp_rank=0)),  # cp outermost
     "topology.dp_rank: saved 0, now 1; topology.cp_rank: saved 1, now 0", TopologyMismatchError),
    ("seed", dict(seed=4), "plan.seed_hash: saved", StateMismatchError),
    ("index digest", dict(index="b"), "plan.datasets[0].index_digest: saved", StateMismatchError),
    ("repeats", dict(repeats=1), "plan.datasets[0].repeats: saved 0, now 1", StateMismatchError),
    ("weights", dict(weights=2.0), "plan.datasets[0].weight: saved 1.0, now 2.0", StateMismatchError),
    ("batch_size", dict(batch_size=3), "plan.batch_size: saved 4, now 3", StateMismatchError),
    ("policy", dict(pad="drop"), "plan.policy: saved 'cyclic', now 'drop'", StateMismatchError),
    ("pad_to", dict(pad_to="rank"), "plan.pad_to: saved 'batch', now 'rank'", StateMismatchError),
    ("oversubscribe", dict(oversubscribe=True), "plan.oversubscribe: saved False, now True", StateMismatchError),
    ("mode", dict(mode="steps"), "mode: saved 'epochs', now 'steps'", StateMismatchError),
]


@pytest.mark.parametrize("field,change,fragment,cls", CHANGES, ids=[c[0] for c in CHANGES])
def test_each_changed_field_is_refused_and_the_loader_is_untouched(
        indexes: tuple[Index, Index], field: str, change: dict[str, Any], fragment: str, cls: type) -> None:
    a, b = indexes
    kw = dict(change)
    saved_ds = make(a, **kw.pop("base", {}))
    it = iter(saved_ds)
    next(it), next(it)
    state = json.loads(json.dumps(saved_ds.state_dict()))
    index = b if kw.pop("index", None) == "b" else a
    other = make(index, **kw)
    n = len(other.plan(0))  # steps mode is endless: compare one epoch's worth
    expected = keys(itertools.islice(make(index, **kw), n))
    it = iter(other)
    head = keys([next(it)])
    before = other.state_dict()
    with pytest.raises(cls) as info:
        other.load_state_dict(state)
    assert isinstance(info.value, WdsPadError)
    message = str(info.value)
    assert fragment in message, message
    if cls is TopologyMismatchError:
        assert "restart with the saved topology" in message or "state file saved by this rank" in message
    else:
        assert "start afresh" in message
    assert other.state_dict() == before
    assert head + keys(itertools.islice(it, n - 1)) == expected  # it streams its own plan on


def test_loader_refusal_leaves_its_position(indexes: tuple[Index, Index]) -> None:
    a, _ = indexes
    loader = Loader(make(a))
    it = iter(loader)
    next(it)
    before = loader.state_dict()
    with pytest.raises(StateMismatchError):
        loader.load_state_dict(make(a, seed=99).state_dict())
    assert loader.state_dict() == before


def test_state_without_topology_is_refused_in_a_distributed_run(indexes: tuple[Index, Index]) -> None:
    a, _ = indexes
    state = make(a).state_dict()
    del state["topology"]
    with pytest.raises(TopologyMismatchError, match=r"no topology and this is a distributed run.*world_size 4"):
        make(a).load_state_dict(state)
    solo = make(a, topology=Topology(1, 0))
    legacy = solo.state_dict()
    del legacy["topology"]
    solo.load_state_dict(legacy)  # a single process has nothing to mismatch


@pytest.mark.parametrize("damage,match", [
    (lambda s: {**s, "version": 99}, "version 99 is not supported"),
    (lambda s: {**s, "format": "other"}, "not a wds_pad loader state"),
    (lambda s: {**s, "index": -1}, r"'index' must be an int in \[0, "),
    (lambda s: {**s, "epoch": True}, r"'epoch' must be an int in \[0, "),
    (lambda s: {**s, "topology": {"rank": 1}}, "'topology' must map"),
    (lambda s: {**s, "elastic": {"segments": [[0, 1]]}}, "'elastic' must be"),
    (lambda s: {k: v for k, v in s.items() if k != "fingerprint"}, "'fingerprint' must be 32 hex digits, got None"),
    (lambda s: [1, 2], "must be a dict"),
])
def test_malformed_states_are_state_errors(indexes: tuple[Index, Index], damage: Any, match: str) -> None:
    ds = make(indexes[0])
    with pytest.raises(StateError, match=match):
        ds.load_state_dict(damage(ds.state_dict()))


def test_position_past_the_epoch_is_refused(indexes: tuple[Index, Index]) -> None:
    ds = make(indexes[0])
    state = ds.state_dict()
    with pytest.raises(StateMismatchError, match="past the end of epoch 0"):
        ds.load_state_dict({**state, "index": state["batches_in_epoch"] + 1})


# ------------------------------------------------------------------ state files


def test_state_files_are_per_rank_atomic_and_verified(indexes: tuple[Index, Index], tmp_path: Path) -> None:
    ds = make(indexes[0])
    path = save_state_file(ds.state_dict(), str(tmp_path), rank=1)
    assert path == state_path(str(tmp_path), 1) and path.endswith("loader-rank00001.json")
    assert [p.name for p in tmp_path.iterdir()] == ["loader-rank00001.json"]  # no temp file left
    assert load_state_file(path, rank=1) == ds.state_dict()
    with pytest.raises(TopologyMismatchError, match="saved by rank 1, this is rank 2; load loader-rank00002.json"):
        load_state_file(path, rank=2)
    raw = Path(path).read_bytes()
    Path(path).write_bytes(raw[: len(raw) // 2])
    with pytest.raises(StateError, match="corrupt or truncated"):
        load_state_file(path, rank=1)
    Path(path).write_bytes(raw.replace(b'"index": 0', b'"index": 1'))
    with pytest.raises(StateError, match="checksum does not match"):
        load_state_file(path, rank=1)
    Path(path).write_bytes(b"")
    with pytest.raises(StateError, match="corrupt or truncated"):
        load_state_file(path, rank=1)
    with pytest.raises(StateError, match="does not exist"):
        load_state_file(str(tmp_path / "missing.json"), rank=1)
    with pytest.raises(StateError, match="not JSON-safe"):
        save_state_file({"x": object()}, str(tmp_path), rank=1)


# ------------------------------------------------------------------ elastic views (pure)
# (the remainder's properties over random layouts: tests/core/test_remainder.py)


def test_elastic_view_round_trips_and_refuses_a_position_past_the_end(indexes: tuple[Index, Index]) -> None:
    import pickle

    a, _ = indexes
    spec = make(a, topology=Topology(2, 1)).spec
    view = elastic_view(spec, 0, [Segment(4, steps=3)])
    assert view.to_json() == {"segments": [[4, 3, view.fingerprint]]}
    assert view.keep.tolist() == list(range(len(view.plan)))
    back = pickle.loads(pickle.dumps(view))  # into DataLoader workers: without its plan
    assert "_cached" not in back.__dict__ and back.fingerprint == view.fingerprint
    assert [b.samples.tolist() for b in back.plan] == [b.samples.tolist() for b in view.plan]
    assert {elastic_view(make(a, topology=Topology(2, r)).spec, 0, [Segment(4, steps=3)]).fingerprint
            for r in range(2)} == {view.fingerprint}
    with pytest.raises(StateMismatchError, match="past the end of epoch 0"):
        elastic_view(spec, 0, [Segment(4, steps=10_000)])


# ---------------------------------------------------------------- the layout is in the fingerprint
def test_a_state_without_topology_from_another_layout_is_refused(indexes: tuple[Index, Index]) -> None:
    a, _ = indexes
    saved_ds = make(a, topology=Topology(4, 3, cp_size=2))  # dp 2, cp 2
    it = iter(saved_ds)
    next(it), next(it)
    state = json.loads(json.dumps(saved_ds.state_dict()))
    del state["topology"]
    solo = make(a, topology=Topology(1, 0))
    assert len(solo.plan(0)) != len(saved_ds.plan(0))  # another plan: resuming would be silent loss
    before = solo.state_dict()
    with pytest.raises(TopologyMismatchError, match=r"plan\.dp_size: saved 2, now 1.*plan\.pad_unit"):
        solo.load_state_dict(state)
    assert solo.state_dict() == before
    with pytest.raises(TopologyMismatchError, match="plan.dp_size: saved 2, now 1"):
        Loader(solo).load_state_dict(state)
    # the same state, kept whole, is refused for its topology as before
    full = json.loads(json.dumps(saved_ds.state_dict()))
    with pytest.raises(TopologyMismatchError, match="topology.world_size: saved 4, now 1"):
        solo.load_state_dict(full)


def test_fingerprint_covers_the_layout_and_equals_on_every_rank(indexes: tuple[Index, Index]) -> None:
    a, _ = indexes
    fps = {make(a, topology=Topology(4, r, cp_size=2)).spec.fingerprint() for r in range(4)}
    assert len(fps) == 1  # the agreement check compares it across ranks
    assert make(a, topology=Topology(2, 0)).spec.fingerprint() in fps  # dp 2 either way
    assert make(a, topology=Topology(4, 0)).spec.fingerprint() not in fps  # dp 4
    assert make(a, topology=Topology(1, 0)).spec.fingerprint() not in fps
    assert make(a, topology=Topology(2, 0), pad_to="rank").spec.fingerprint() not in fps


def test_elastic_without_topology_maps_from_the_plans_layout(indexes: tuple[Index, Index]) -> None:
    a, _ = indexes
    two = make(a, topology=Topology(2, 0))
    state = json.loads(json.dumps(two.state_dict()))  # the epoch's start maps onto any layout
    del state["topology"]
    solo = make(a, topology=Topology(1, 0))
    solo.load_state_dict(state, allow_elastic=True)
    assert keys(solo) == keys(make(a, topology=Topology(1, 0)))


def test_an_edited_plan_block_no_longer_matches_its_fingerprint(indexes: tuple[Index, Index]) -> None:
    a, _ = indexes
    state = json.loads(json.dumps(make(a).state_dict()))
    state["plan"]["batch_size"] = 8
    with pytest.raises(StateError, match="'plan' does not match the state's fingerprint"):
        make(a).load_state_dict(state)
    del state["plan"]
    with pytest.raises(StateError, match="'plan' is missing"):
        make(a).load_state_dict(state)


@pytest.mark.parametrize("damage,match", [
    (lambda s: {**s, "version": "2"}, "'version' must be an int, got str"),
    (lambda s: {**s, "version": 2.0}, "'version' must be an int, got float"),
    (lambda s: {**s, "version": True}, "'version' must be an int, got bool"),
    (lambda s: {**s, "epoch": 2**31}, r"'epoch' must be an int in \[0, 2147483647\]"),
    (lambda s: {**s, "epoch": 10**30}, r"'epoch' must be an int in \[0, 2147483647\]"),
    (lambda s: {**s, "epoch": 1.0}, r"'epoch' must be an int in"),
    (lambda s: {**s, "index": 2**60}, r"'index' must be an int in"),
    (lambda s: {**s, "batches_in_epoch": "7"}, "'batches_in_epoch' must be an int"),
    (lambda s: {**s, "kind": "other"}, "'kind' must be one of bucketed, shards"),
    (lambda s: {**s, "mode": 1}, "'mode' must be one of epochs, steps"),
    (lambda s: {**s, "fingerprint": "zz"}, "'fingerprint' must be 32 hex digits"),
    (lambda s: {**s, "plan": [1]}, "'plan' must be a dict"),
    (lambda s: {**s, "plan": {**s["plan"], "dp_size": "4"}}, r"'plan\.dp_size' must be an int >= 1"),
])
def test_every_field_verification_reads_is_type_checked(indexes: tuple[Index, Index], damage: Any,
                                                        match: str) -> None:
    ds = make(indexes[0])
    before = ds.state_dict()
    with pytest.raises(StateError, match=match):
        ds.load_state_dict(damage(json.loads(json.dumps(before))))
    assert ds.state_dict() == before


def test_a_state_of_version_1_is_refused_in_one_line_naming_its_version(indexes: tuple[Index, Index]) -> None:
    ds = make(indexes[0], topology=Topology(1, 0))
    it = iter(ds)
    next(it)
    old = json.loads(json.dumps(ds.state_dict()))
    old["version"] = 1
    before = ds.state_dict()
    with pytest.raises(StateError) as info:
        ds.load_state_dict(old)
    message = str(info.value)
    assert "\n" not in message
    assert "loader state version 1 is not supported: it was written by an earlier wds_pad 0.1; this wds_pad reads version 2" in message
    assert "start the epoch afresh (set_epoch)" in message
    assert ds.state_dict() == before


# ---------------------------------------------------------------- state files
def test_a_state_file_of_an_earlier_version_is_refused_naming_it(indexes: tuple[Index, Index],
                                                                 tmp_path: Path) -> None:
    path = save_state_file(make(indexes[0]).state_dict(), str(tmp_path), rank=0)
    doc = json.loads(Path(path).read_text())
    del doc["format"]  # what the files of state version 1 looked like
    Path(path).write_text(json.dumps(doc))
    with pytest.raises(StateError, match="written by an earlier wds_pad 0.1.*start the epoch afresh"):
        load_state_file(str(tmp_path), rank=0)


def test_saved_by_rank_is_covered_by_the_checksum(indexes: tuple[Index, Index], tmp_path: Path) -> None:
    ds = make(indexes[0])
    path = save_state_file(ds.state_dict(), str(tmp_path), rank=1)
    doc = json.loads(Path(path).read_text())
    assert doc["format"] == "wds_pad.state_file"
    for forged in (0, "1", None, True):
        Path(path).write_text(json.dumps({**doc, "saved_by_rank": forged}))
        with pytest.raises(StateError, match="checksum does not match"):
            load_state_file(path, rank=0 if forged == 0 else 1)
    Path(path).write_text(json.dumps(doc))
    assert load_state_file(path, rank=1) == ds.state_dict()


def test_a_state_file_whose_saved_by_rank_is_not_an_int_is_refused(indexes: tuple[Index, Index],
                                                                    tmp_path: Path) -> None:
    from wds_pad.state.files import _checksum

    state = make(indexes[0]).state_dict()
    path = save_state_file(state, str(tmp_path), rank=1)
    doc = json.loads(Path(path).read_text())
    doc["saved_by_rank"] = "1"
    doc["checksum"] = _checksum(state, "1")
    Path(path).write_text(json.dumps(doc))
    with pytest.raises(StateError, match="'saved_by_rank' must be an int"):
        load_state_file(path, rank=1)


def test_state_files_on_the_wrong_kind_of_path_are_state_errors(indexes: tuple[Index, Index],
                                                               tmp_path: Path) -> None:
    state = make(indexes[0]).state_dict()
    with pytest.raises(StateError, match=r"loader-rank00000\.json' does not exist"):
        load_state_file(str(tmp_path), rank=0)  # a directory: this rank's file in it, not there yet
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(StateError, match="is a file, not a directory"):
        save_state_file(state, str(a_file), rank=0)
    with pytest.raises(StateError, match="is a file, not a directory"):
        save_state_file(state, str(a_file / "sub"), rank=0)
    taken = tmp_path / "ckpt"
    os_path = state_path(str(taken), 3)
    Path(os_path).mkdir(parents=True)
    with pytest.raises(StateError, match="a directory has that name"):
        save_state_file(state, str(taken), rank=3)
    for bad in (-1, "0", 1.0, True):
        with pytest.raises(StateError, match="rank must be an int >= 0"):
            save_state_file(state, str(tmp_path / "ok"), rank=bad)  # type: ignore[arg-type]
        with pytest.raises(StateError, match="rank must be an int >= 0"):
            load_state_file(str(a_file), rank=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "ok").exists()


# ---------------------------------------------------------------- epochs are ints
@pytest.mark.parametrize("bad", [1.5, "2", True, -1, 2**31, None])
def test_epochs_that_are_not_ints_in_range_are_refused(indexes: tuple[Index, Index], bad: Any) -> None:
    from wds_pad.errors import ConfigError
    with pytest.raises(ConfigError, match="epoch must be"):
        make(indexes[0], epoch=bad)
    ds = make(indexes[0], epoch=1)
    with pytest.raises(ConfigError, match="epoch must be"):
        ds.set_epoch(bad)
    with pytest.raises(ConfigError, match="epoch must be"):
        Loader(ds).set_epoch(bad)
    assert ds.epoch == 1


def test_load_state_file_takes_the_directory_save_state_file_took(indexes: tuple[Index, Index],
                                                                  tmp_path: Path) -> None:
    state = make(indexes[0]).state_dict()
    for rank in (0, 3):
        written = save_state_file(state, str(tmp_path), rank)
        assert load_state_file(str(tmp_path), rank) == state == load_state_file(written, rank)
    save_state_file(state, str(tmp_path), 5, prefix="eval")
    assert load_state_file(tmp_path, 5, prefix="eval") == state  # type: ignore[arg-type]
    with pytest.raises(StateError, match="loader-rank00005.json' does not exist"):
        load_state_file(str(tmp_path), 5)
