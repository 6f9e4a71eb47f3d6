"""Tests of wds_pad.stages: planned source, fetch, plan batching, substitutes.

The raw stages are driven directly (worker split given explicitly) and composed in a
plain ``wds.DataPipeline``; the sample bytes are checked against webdataset's own
reading of the same shards.
"""

from __future__ import annotations

import glob
import itertools
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import webdataset as wds

from wds_pad._synth import make_image_shards
from wds_pad.errors import ConfigError, StaleShardError
from wds_pad.index import Index, load_index
from wds_pad.indexer import build_index
from wds_pad.plan import Mode
from wds_pad.read import RangeReader
from wds_pad.stages import (
    META_KEYS,
    Counters,
    PlannedSource,
    PlanSpec,
    Position,
    batch_refs,
    expand,
    fetch,
    plan_batched,
    substitute,
)
from wds_pad.topology import Topology

SOLO = Topology(world_size=1, rank=0)
pytestmark = pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning")


def _index(shard_dir: Path, samples: int = 120, shards: int = 4, seed: int = 0) -> Index:
    paths = make_image_shards(shard_dir, samples=samples, shards=shards, seed=seed)
    return build_index(paths, "aspect:width,height", output=str(shard_dir / "index.wdsidx"))


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Index:
    built = _index(tmp_path_factory.mktemp("shards"))
    return load_index(built.path)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference(index: Index) -> dict[str, dict[str, Any]]:
    """webdataset's own reading of every sample, by key."""
    return {s["__key__"]: s for s in wds.WebDataset(list(index.urls), shardshuffle=False)}


def _spec(index: Index, **kw: Any) -> PlanSpec:
    args: dict[str, Any] = dict(indexes=(index,), names=("img",), topology=SOLO, seed=7, batch_size=4)
    args.update(kw)
    return PlanSpec(**args)


def _planned_keys(index: Index, spec: PlanSpec, epoch: int = 0) -> list[list[str]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = spec.plan(epoch)
    return [[index.key(int(i)) for i in b.samples] for b in plan]


# ---------------------------------------------------------------- PlanSpec


def test_planspec_defaults_plan_every_index(index: Index) -> None:
    spec = _spec(index)
    assert spec.repeats == (0,) and spec.weights == (1.0,)
    assert len(spec.plan(0)) > 0


def test_planspec_refuses_mismatched_per_index_values(index: Index) -> None:
    with pytest.raises(ConfigError, match="repeats"):
        _spec(index, repeats=(0, 1))
    with pytest.raises(ConfigError, match="name"):
        _spec(index, names=("a", "b"))


def test_planspec_pickles_index_as_path_and_replans_identically(index: Index) -> None:
    spec = _spec(index)
    spec.plan(0)
    clone = pickle.loads(pickle.dumps(spec))
    assert clone.indexes[0].path == index.path and clone.indexes[0].digest == index.digest
    assert clone._cache == {}
    assert _planned_keys(index, clone) == _planned_keys(index, spec)
    assert clone.fingerprint() == spec.fingerprint()


# ---------------------------------------------------------------- PlannedSource


@pytest.mark.parametrize("nw", [1, 2, 3])
@pytest.mark.parametrize("start", [0, 5])
def test_source_worker_split_interleaves_to_plan_order(index: Index, nw: int, start: int) -> None:
    spec = _spec(index)
    plan = spec.plan(0)
    per_worker = [[j for _, j in PlannedSource(spec, Position(0, start), worker=(w, nw)).batches()]
                  for w in range(nw)]
    for w, js in enumerate(per_worker):
        assert js == [j for j in range(start, len(plan)) if (j - start) % nw == w]
    # DataLoader's round-robin over the workers gives back the plan order
    merged = [j for group in itertools.zip_longest(*per_worker) for j in group if j is not None]
    assert merged == list(range(start, len(plan)))


def test_source_refs_follow_plan(index: Index) -> None:
    spec = _spec(index)
    refs = list(PlannedSource(spec, worker=(0, 1)))
    plan = spec.plan(0)
    assert [r["__key__"] for r in refs] == [k for b in _planned_keys(index, spec) for k in b]
    flat_pad = np.concatenate([b.pad for b in plan]).tolist()
    assert [r["__pad__"] for r in refs] == flat_pad
    for r in refs[:20]:
        i = r["__index__"]
        assert r["__url__"] == index.url(i)
        assert (r["__offset__"], r["__length__"]) == (int(index.offset[i]), int(index.length[i]))
        assert r["__bucket__"] == plan[r["__batch__"]].bucket
        assert r["__step__"] == plan[r["__batch__"]].step and r["__epoch__"] == 0


def test_source_epochs_mode_stops_steps_mode_runs_on(index: Index) -> None:
    spec = _spec(index)
    n0 = len(spec.plan(0))
    assert len(list(PlannedSource(spec, worker=(0, 1)).batches())) == n0
    steps = _spec(index, mode=Mode.STEPS)
    taken = list(itertools.islice(PlannedSource(steps, worker=(0, 1)).batches(), len(steps.plan(0)) + 3))
    assert [(p.epoch, j) for p, j in taken[-4:]] == [(0, len(steps.plan(0)) - 1), (1, 0), (1, 1), (1, 2)]


def test_source_refuses_position_past_epoch(index: Index) -> None:
    spec = _spec(index)
    with pytest.raises(ConfigError, match="past the end"):
        list(PlannedSource(spec, Position(0, len(spec.plan(0)) + 1), worker=(0, 1)))


# ---------------------------------------------------------------- fetch


def test_fetch_bytes_equal_webdataset(index: Index, reference: dict[str, dict[str, Any]]) -> None:
    spec = _spec(index)
    samples = list(fetch()(iter(PlannedSource(spec, worker=(0, 1)))))
    assert len(samples) == sum(b.samples.size for b in spec.plan(0))
    for s in samples:
        ref = reference[s["__key__"]]
        payload = {k for k in ref if not k.startswith("__")}
        assert payload == {k for k in s if not k.startswith("__")}
        for k in payload:
            assert s[k] == ref[k], (s["__key__"], k)
        assert s["__url__"] == ref["__url__"]
        for meta in META_KEYS:
            assert meta in s
        assert "__offset__" not in s and "__length__" not in s


def test_fetch_pickles_and_reads_in_a_clone(index: Index) -> None:
    spec = _spec(index)
    stage = fetch(spec=spec, handler=lambda e: True)
    list(stage(iter(batch_refs(spec, spec.plan(0), 0))))  # opens descriptors
    clone = pickle.loads(pickle.dumps(fetch(spec=spec)))
    out = list(clone(iter(batch_refs(spec, spec.plan(0), 1))))
    assert [s["__key__"] for s in out] == _planned_keys(index, spec)[1]


def test_expand_refuses_bytes_of_another_sample(index: Index) -> None:
    spec = _spec(index)
    a, b = batch_refs(spec, spec.plan(0), 0)[:2]
    data_b = RangeReader().read(b["__url__"], b["__offset__"], b["__length__"])
    with pytest.raises(StaleShardError) as err:
        expand(a, data_b)
    assert a["__url__"] in str(err.value) and f"offset {a['__offset__']}" in str(err.value)


# ---------------------------------------------------------------- batching and pipelines


def test_plan_batched_groups_exactly_the_plan(index: Index) -> None:
    spec = _spec(index)
    batches = list(plan_batched()(fetch()(iter(PlannedSource(spec, worker=(0, 1))))))
    assert [[s["__key__"] for s in b] for b in batches] == _planned_keys(index, spec)
    lengths = list(plan_batched(len)(fetch()(iter(PlannedSource(spec, worker=(0, 1))))))
    assert lengths == [4] * len(spec.plan(0))


def test_raw_datapipeline_with_decode_and_map(index: Index) -> None:
    spec = _spec(index)
    pipe = wds.DataPipeline(
        PlannedSource(spec, worker=(0, 1)), fetch(), wds.decode("pil"),
        wds.map(lambda s: {**s, "size": (s.get("png") or s.get("jpg")).size}),
        plan_batched(),
    )
    batches = list(pipe)
    assert [[s["__key__"] for s in b] for b in batches] == _planned_keys(index, spec)
    for b in batches[:5]:
        for s in b:
            assert s["size"] == (s["json"]["width"], s["json"]["height"])
            assert s["__bucket__"] == b[0]["__bucket__"]


def test_raw_datapipeline_pickles(index: Index) -> None:
    spec = _spec(index)
    pipe = wds.DataPipeline(PlannedSource(spec, worker=(0, 1)), fetch(), wds.decode("pil"),
                            plan_batched())
    clone = pickle.loads(pickle.dumps(pipe))
    assert [[s["__key__"] for s in b] for b in clone] == _planned_keys(index, spec)


# ---------------------------------------------------------------- substitutes


def _corrupt_copy(index: Index, tmp_path: Path, victim: int) -> Index:
    """Copy the shards, rebuild the index, then break ``victim``'s header checksum in place."""
    src = Path(index.urls[0]).parent
    dst = tmp_path / "copy"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.wdsidx"))
    copy = build_index(sorted(glob.glob(str(dst / "*.tar"))), "aspect:width,height",
                       output=str(dst / "index.wdsidx"))
    with open(copy.url(victim), "r+b") as f:  # same size, broken header: "changed shard"
        f.seek(int(copy.offset[victim]) + 148)
        f.write(b"9999999\0")
    return copy


def test_substitute_is_deterministic_and_from_the_same_bucket(index: Index, tmp_path: Path) -> None:
    spec0 = _spec(index)
    victim = int(spec0.plan(0)[2].samples[1])
    broken = _corrupt_copy(index, tmp_path, victim)
    spec = _spec(broken)

    def run() -> tuple[list[list[str]], Counters]:
        counters = Counters()
        stage = fetch(spec=spec, handler=lambda e: True, counters=counters)
        out = list(plan_batched()(stage(iter(PlannedSource(spec, worker=(0, 1))))))
        return [[s["__key__"] for s in b] for b in out], counters

    keys1, c1 = run()
    keys2, c2 = run()
    assert keys1 == keys2
    planned = _planned_keys(broken, spec)
    assert [len(b) for b in keys1] == [len(b) for b in planned]
    hits = sum(k == broken.key(victim) for b in planned for k in b)
    assert hits >= 1 and c1.substituted == c2.substituted == hits
    assert broken.key(victim) in c1.failures[0] and "offset" in c1.failures[0]
    diffs = [(p, g) for bp, bg in zip(planned, keys1) for p, g in zip(bp, bg) if p != g]
    assert len(diffs) == hits and all(p == broken.key(victim) for p, _ in diffs)
    by_key = {broken.key(i): i for i in range(len(broken))}
    for _, got in diffs:
        assert broken.bucket[by_key[got]] == broken.bucket[victim]

    ref = next(r for r in batch_refs(spec, spec.plan(0), 2) if r["__index__"] == victim)
    alt = substitute(spec, RangeReader(), ref, Counters(), "failed")
    assert alt["__substitute_for__"] == broken.key(victim)
    assert alt["__key__"] == diffs[0][1]  # the same stand-in every time


def test_bad_sample_raises_with_url_offset_key_without_handler(index: Index, tmp_path: Path) -> None:
    spec0 = _spec(index)
    victim = int(spec0.plan(0)[1].samples[0])
    broken = _corrupt_copy(index, tmp_path, victim)
    spec = _spec(broken)
    with pytest.raises(StaleShardError) as err:
        list(fetch(spec=spec)(iter(PlannedSource(spec, worker=(0, 1)))))
    msg = str(err.value)
    assert broken.url(victim) in msg
    assert str(int(broken.offset[victim])) in msg
    assert broken.key(victim) in msg


def test_handler_returning_false_still_raises(index: Index, tmp_path: Path) -> None:
    victim = int(_spec(index).plan(0)[0].samples[0])
    broken = _corrupt_copy(index, tmp_path, victim)
    spec = _spec(broken)
    with pytest.raises(StaleShardError, match=re.escape(broken.key(victim))):
        list(fetch(spec=spec, handler=lambda e: False)(iter(PlannedSource(spec, worker=(0, 1)))))
