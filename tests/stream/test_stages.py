"""Tests of wds_pad.stream.stages and stream.fetch: planned source, fetch, plan batching,
substitutes.

The raw stages are driven directly (worker split given explicitly) and composed in a
plain ``wds.DataPipeline``; the sample bytes are checked against webdataset's own
reading of the same shards.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import pickle
import re
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import webdataset as wds

from wds_pad.cli.synth import make_image_shards
from wds_pad.errors import ConfigError, StaleShardError
from wds_pad.index.codec import load_index
from wds_pad.index.record import Index
from wds_pad.index.build import build_index
from wds_pad.core.policy import Mode
from wds_pad.io.ranges import RangeReader, ReadOptions
from wds_pad.stream.fetch import BIG_SAMPLE, META_KEYS, Counters, expand, fetch, substitute
from wds_pad.state.spec import PlanSpec
from wds_pad.state.cursor import Position
from wds_pad.stream.stages import PlannedSource, batch_refs, plan_batched, sized_batches
from wds_pad.core.topology import Topology

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


@pytest.mark.parametrize("nw", [1, 2, 3])
@pytest.mark.parametrize("run", [2, 3])
@pytest.mark.parametrize("mode", ["epochs", "steps"])
def test_source_runs_dealt_to_workers_interleave_to_plan_order(index: Index, nw: int, run: int, mode: str) -> None:
    """Workers that send ``run`` batches at a time take runs of consecutive batches in turn,
    across an epoch's end too (steps mode): DataLoader's round-robin over their runs gives
    back the plan order, and each worker computes only its own batches' member work."""
    spec = _spec(index, mode=Mode(mode))
    start = Position(0, 3)
    walk = [(e, j) for e in (0, 1) for j in range(3 if e == 0 else 0, len(spec.plan(e)))]
    if mode == "epochs":
        walk = [p for p in walk if p[0] == 0]
    runs = []
    for w in range(nw):
        got = itertools.islice(PlannedSource(spec, start, worker=(w, nw), run=run).batches(), len(walk))
        mine = [(p.epoch, j) for p, j in got]
        runs.append([mine[k:k + run] for k in range(0, len(mine), run)])
    merged = [b for group in itertools.zip_longest(*runs) for r in group if r is not None for b in r]
    assert merged[:len(walk)] == walk


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


def test_plan_batched_with_webdataset_collation_refuses_mixed_members(index: Index) -> None:
    spec = _spec(index)

    def pipe(collation_fn: Any) -> Any:
        return wds.DataPipeline(PlannedSource(spec, worker=(0, 1)), fetch(), wds.decode("pil"),
                                plan_batched(collation_fn))

    assert all(isinstance(b, list) for b in pipe(None))  # a list of sample dicts, decoded or not
    with pytest.raises(ConfigError, match=r"sample '\d+' of '.*' has members .*rename\(image='jpg;png'\)"):
        list(pipe(wds.filters.default_collation_fn))
    folded = list(wds.DataPipeline(PlannedSource(spec, worker=(0, 1)), fetch(), wds.decode("pil"),
                                   wds.rename(image="jpg;png"), plan_batched(wds.filters.default_collation_fn)))
    assert [list(b["__key__"]) for b in folded] == _planned_keys(index, spec)


def test_raw_datapipeline_pickles(index: Index) -> None:
    spec = _spec(index)
    pipe = wds.DataPipeline(PlannedSource(spec, worker=(0, 1)), fetch(), wds.decode("pil"),
                            plan_batched())
    clone = pickle.loads(pickle.dumps(pipe))
    assert [[s["__key__"] for s in b] for b in clone] == _planned_keys(index, spec)


# ---------------------------------------------------------------- substitutes


def _corrupt_copy(index: Index, tmp_path: Path, victim: int) -> Index:
    """Copy the shards, rebuild the index, then break ``victim``'s first member header in
    place: its name, which the member-table path compares with the key (after any PAX
    header), and so its checksum, which the exact path checks."""
    src = Path(index.urls[0]).parent
    dst = tmp_path / "copy"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.wdsidx"))
    copy = build_index(sorted(glob.glob(str(dst / "*.tar"))), "aspect:width,height",
                       output=str(dst / "index.wdsidx"))
    _break_member_header(copy, victim)
    return copy


def _break_member_header(copy: Index, victim: int) -> None:
    """Bit rot in ``victim``'s first member header (size and mtime kept): its name, which
    the member-table path compares with the key, and so its checksum."""
    stat = os.stat(copy.url(victim))
    first = int(copy.arrays["member_start"][victim])
    head = int(copy.member_offsets(np.array([first]), np.array([1]))[0]) - 512
    with open(copy.url(victim), "r+b") as f:  # same size, broken header: "changed shard"
        f.seek(int(copy.offset[victim]) + head)
        f.write(b"\xff\xfe")
    os.utime(copy.url(victim), ns=(stat.st_atime_ns, stat.st_mtime_ns))  # bit rot: mtime kept


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


# ---------------------------------------------------------------- large samples, read ahead


def _mixed_shards(out: Path, samples: int = 60, shards: int = 3, seed: int = 0) -> list[str]:
    """Shards mixing large samples (read ahead by threads) and small ones (read_many)."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    ratios = [(1, 1), (4, 3), (3, 4)]
    urls = []
    i = 0
    for s in range(shards):
        url = str(out / f"mixed-{s:03d}.tar")
        with wds.TarWriter(url, encoder=False) as writer:
            for _ in range(samples // shards):
                big = bool(rng.random() < 0.6)
                size = int(rng.integers(BIG_SAMPLE, BIG_SAMPLE + 200_000)) if big else int(rng.integers(100, 20_000))
                w, h = ratios[int(rng.integers(len(ratios)))]
                meta = {"width": 64 * w, "height": 64 * h, "index": i}
                writer.write({"__key__": f"{i:06d}", "bin": i.to_bytes(8, "little") + rng.bytes(size - 8),
                              "json": json.dumps(meta).encode()})
                i += 1
        urls.append(url)
    return urls


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Index:
    root = tmp_path_factory.mktemp("mixed")
    built = build_index(_mixed_shards(root), "aspect:width,height", output=str(root / "index.wdsidx"))
    return load_index(built.path)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def mixed_reference(mixed: Index) -> dict[str, dict[str, Any]]:
    return {s["__key__"]: s for s in wds.WebDataset(list(mixed.urls), shardshuffle=False)}


def _read_ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("wds_pad-local-read")]


def _no_read_ahead_threads_within(seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while _read_ahead_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not _read_ahead_threads()


@pytest.mark.parametrize("threads", [0, 1, 3])
@pytest.mark.parametrize("in_flight", [1, 4, 32])
def test_large_samples_keep_plan_order_and_webdataset_bytes(mixed: Index, mixed_reference: dict[str, dict[str, Any]],
                                                             threads: int, in_flight: int) -> None:
    spec = _spec(mixed, batch_size=2)
    lengths = mixed.length[np.concatenate([b.samples for b in spec.plan(0)])]
    assert (lengths >= BIG_SAMPLE).any() and (lengths < BIG_SAMPLE).any()  # a real mix
    stage = fetch(ReadOptions(local_threads=threads, max_in_flight=in_flight))
    samples = list(stage(iter(PlannedSource(spec, worker=(0, 1)))))
    assert [s["__key__"] for s in samples] == [k for b in _planned_keys(mixed, spec) for k in b]
    for s in samples:
        ref = mixed_reference[s["__key__"]]
        assert s["bin"] == ref["bin"] and s["json"] == ref["json"]
        assert type(s["bin"]) is bytes
        assert "__offset__" not in s and "__length__" not in s
        assert all(meta in s for meta in META_KEYS)
    stats = stage.reader.stats
    assert stats.ranges == len(samples) and stats.bytes == int(lengths.sum())
    assert stats.peak_requests_in_flight <= in_flight
    assert _no_read_ahead_threads_within()  # the stream ended: its threads stopped


def test_large_sample_read_ahead_stays_within_the_byte_bound(mixed: Index) -> None:
    """Large local samples are read inline (the read-ahead threads did not pay): nothing is
    ever buffered ahead of the consumer, whatever local_threads and the bound say."""
    spec = _spec(mixed, batch_size=2)
    largest = int(mixed.length.max())
    for bound in (largest + 1, 64 * largest):
        stage = fetch(ReadOptions(local_threads=2, max_bytes_in_flight=bound))
        list(stage(iter(PlannedSource(spec, worker=(0, 1)))))
        assert stage.reader.stats.peak_bytes_in_flight == 0


def _big_victim(index: Index, spec: PlanSpec, skip: int = 5) -> int:
    """A large sample some way into the plan (so read-ahead has started before it)."""
    ids = np.concatenate([b.samples for b in spec.plan(0)])
    return int(next(i for i in ids[skip:] if index.length[i] >= BIG_SAMPLE))


def _broken_mixed(mixed: Index, tmp_path: Path, victim: int) -> Index:
    dst = tmp_path / "broken"
    shutil.copytree(Path(mixed.urls[0]).parent, dst, ignore=shutil.ignore_patterns("*.wdsidx"))
    copy = build_index(sorted(glob.glob(str(dst / "*.tar"))), "aspect:width,height",
                       output=str(dst / "index.wdsidx"))
    _break_member_header(copy, victim)
    return copy


@pytest.mark.parametrize("threads", [0, 2])
def test_large_sample_error_names_its_own_sample(mixed: Index, tmp_path: Path, threads: int) -> None:
    victim = _big_victim(mixed, _spec(mixed, batch_size=2))
    broken = _broken_mixed(mixed, tmp_path, victim)
    spec = _spec(broken, batch_size=2)
    planned = [k for b in _planned_keys(broken, spec) for k in b]
    got: list[str] = []
    with pytest.raises(StaleShardError) as err:
        for s in fetch(ReadOptions(local_threads=threads), spec=spec)(iter(PlannedSource(spec, worker=(0, 1)))):
            got.append(s["__key__"])
    msg = str(err.value)
    assert broken.url(victim) in msg and str(int(broken.offset[victim])) in msg and broken.key(victim) in msg
    assert got == planned[:planned.index(broken.key(victim))]  # everything before it, nothing after
    assert _no_read_ahead_threads_within()


def test_large_sample_substitute_takes_exactly_its_place(mixed: Index, tmp_path: Path) -> None:
    victim = _big_victim(mixed, _spec(mixed, batch_size=2))
    broken = _broken_mixed(mixed, tmp_path, victim)
    spec = _spec(broken, batch_size=2)
    planned = [k for b in _planned_keys(broken, spec) for k in b]
    runs = {}
    for threads in (0, 2):
        counters = Counters()
        stage = fetch(ReadOptions(local_threads=threads), spec=spec, handler=lambda e: True, counters=counters)
        runs[threads] = [s["__key__"] for s in stage(iter(PlannedSource(spec, worker=(0, 1))))]
        hits = planned.count(broken.key(victim))
        assert counters.substituted == hits >= 1 and broken.key(victim) in counters.failures[0]
        assert stage.reader.stats.ranges == len(planned)  # failed reads are not counted
    assert runs[0] == runs[2]  # the same stand-ins with or without threads
    diffs = [(p, g) for p, g in zip(planned, runs[2]) if p != g]
    assert len(diffs) == planned.count(broken.key(victim))
    assert all(p == broken.key(victim) for p, _ in diffs)


def test_dropping_a_large_sample_stream_stops_its_threads(mixed: Index) -> None:
    """Large samples are read inline now: a stream starts no thread to leave behind."""
    spec = _spec(mixed, batch_size=2)
    before = set(_read_ahead_threads())
    stream = fetch(ReadOptions(local_threads=3))(iter(PlannedSource(spec, worker=(0, 1))))
    taken = list(itertools.islice(stream, 10))
    assert len(taken) == 10 and set(_read_ahead_threads()) == before


def test_the_node_plans_its_next_epoch_on_a_thread_of_its_own_not_in_a_read(index: Index,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """What the node holds next epoch is planned ahead, off the thread that asks (a
    process's last read of a shard, inline in the loop's ``next()``), and is what the next
    epoch's own schedule says the node holds."""
    from wds_pad.stream import wholeshards
    from wds_pad.stream.dataset import BucketedWebDataset

    planned_on: list[str] = []
    real = wholeshards.node_uses

    def recorded(*args: Any, **kw: Any) -> Any:
        planned_on.append(threading.current_thread().name)
        return real(*args, **kw)

    monkeypatch.setattr(wholeshards, "node_uses", recorded)
    topo = Topology(4, 0, local_world_size=2)
    spec = BucketedWebDataset(index, batch_size=2, seed=3, locality="shard", topology=topo,
                              check_agreement=False).spec
    first = next(wholeshards.node_schedule(PlannedSource(spec, worker=(0, 1))))
    later = dict(first.later)  # asked here: planned already, or waited for
    assert planned_on == [threading.current_thread().name, "wds_pad-next-epoch"]
    nxt = next(wholeshards.node_schedule(PlannedSource(spec, Position(1, 0), worker=(0, 1))))
    assert set(later) == {s.name for s in nxt.shards.values() if s.held} and later


def test_sized_batches_end_each_batch_at_its_size_and_one_cut_short_at_the_next_one() -> None:
    samples = [{"__epoch__": 0, "__batch__": b, "i": i} for b, n in ((0, 3), (1, 2), (2, 2)) for i in range(n)]
    del samples[4]  # batch 1 lost a sample (a stage dropped it)
    sizes = {(0, 0): 3, (0, 1): 2, (0, 2): 2}
    pulled: list[Any] = []

    def src() -> Any:
        for s in samples:
            pulled.append(s)
            yield s

    it = sized_batches(src(), lambda e, j: sizes[(e, j)])
    assert [s["i"] for s in next(it)] == [0, 1, 2] and len(pulled) == 3  # not the next batch's first
    assert [[s["__batch__"] for s in b] for b in it] == [[1], [2, 2]]
