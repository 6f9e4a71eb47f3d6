"""Tests of the pure planner: worked examples, argument checks, and the design
invariants 1-6 as hypothesis properties (each over at least 300 random scenarios),
plus the pure-Python list planner in tools/bench/_plan_lists.py as an oracle."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Hashable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wds_pad import (
    ConfigError,
    Dataset,
    DroppedBucketWarning,
    Mode,
    Plan,
    Policy,
    Topology,
    iter_steps,
    plan_epoch,
)
from wds_pad.core.dataset import bucket_order
from wds_pad.core.permute import permute_one
from wds_pad.core.policy import MAX_EPOCH, MAX_PLANNED_ENTRIES, resolve_policy
from wds_pad.core.seed import derive_seed

ROOT = Path(__file__).resolve().parents[2]


def _load_lists_module() -> Any:
    spec = importlib.util.spec_from_file_location("_plan_lists", ROOT / "tools" / "bench" / "_plan_lists.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["_plan_lists"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


lists = _load_lists_module()

PROPERTY = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- helpers ---------------------------------------------------------------------------

def batches_of(plan: Plan) -> list[tuple[int, str, Hashable, list[int], list[bool]]]:
    return [(b.step, b.dataset, b.bucket, b.samples.tolist(), b.pad.tolist()) for b in plan]


def quiet_plan(datasets: Any, topology: Topology, **kwargs: Any) -> Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedBucketWarning)
        return plan_epoch(datasets, topology, **kwargs)


def expected_length(m: int, unit: int, policy: str, oversubscribe: bool) -> int:
    """The padded global length of a bucket of m entries, straight from the spec."""
    if m == 0:
        return 0
    if policy == "none":
        return m
    if m < unit:
        return unit if policy == "cyclic" and oversubscribe else 0
    if policy == "cyclic":
        return math.ceil(m / unit) * unit
    return (m // unit) * unit


def expected_global_order(seed: int, epoch: int, ds: Dataset, key: Hashable) -> list[int]:
    """1 + repeats passes, each the sorted ids under the keyed permutation of
    (seed, epoch, dataset, bucket, "shuffle", pass)."""
    ids = sorted(int(i) for i in ds.buckets[key])
    out: list[int] = []
    for j in range(1 + ds.repeats):
        pkey = derive_seed(seed, epoch, ds.name, key, "shuffle", j)
        out.extend(ids[permute_one(i, len(ids), pkey)] for i in range(len(ids)))
    return out


def to_list_datasets(dss: list[Dataset]) -> list[Any]:
    return [lists.ListDataset(d.name, {k: v.tolist() for k, v in d.buckets.items()}, d.repeats, d.weight)
            for d in dss]


# -- scenario strategy -----------------------------------------------------------------

KEYS: list[Hashable] = ["1:1", "4:3", "16:9", "a", 0, 7, 2.5, ("len", 3), ("len", 10)]
SIZES = st.one_of(st.just(0), st.integers(1, 8), st.integers(0, 200))


@dataclass
class Scenario:
    datasets: list[Dataset]
    dp: int
    cp: int
    batch_size: int
    seed: int
    epoch: int
    policy: str
    mode: str
    pad_to: str
    oversubscribe: bool

    @property
    def world(self) -> int:
        return self.dp * self.cp

    @property
    def unit(self) -> int:
        return self.dp * self.batch_size if self.pad_to == "batch" else self.dp

    @property
    def concrete(self) -> str:
        return resolve_policy(self.policy, self.mode, self.oversubscribe).value

    def topo(self, dp_rank: int, cp_rank: int = 0) -> Topology:
        return Topology(world_size=self.world, rank=dp_rank * self.cp + cp_rank, cp_size=self.cp)

    def plan(self, dp_rank: int, cp_rank: int = 0, **over: Any) -> Plan:
        kwargs: dict[str, Any] = dict(seed=self.seed, epoch=self.epoch, batch_size=self.batch_size,
                                      policy=self.policy, mode=self.mode, pad_to=self.pad_to,
                                      oversubscribe=self.oversubscribe)
        kwargs.update(over)
        return quiet_plan(self.datasets, self.topo(dp_rank, cp_rank), **kwargs)


@st.composite
def datasets_st(draw: Any, max_datasets: int = 3) -> list[Dataset]:
    out = []
    for i in range(draw(st.integers(1, max_datasets))):
        keys = draw(st.lists(st.sampled_from(KEYS), min_size=0, max_size=5, unique=True))
        shuffle_seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(shuffle_seed)
        buckets, start = {}, draw(st.integers(0, 10**6))
        for key in keys:
            n = draw(SIZES)
            stride = draw(st.integers(1, 3))
            ids = start + stride * np.arange(n, dtype=np.int64)
            buckets[key] = rng.permutation(ids)  # any input order: the planner sorts
            start += stride * n + 1
        out.append(Dataset(name=f"ds{i}", buckets=buckets, repeats=draw(st.integers(0, 3)),
                           weight=draw(st.floats(0.1, 10.0))))
    return out


@st.composite
def scenarios(draw: Any, max_world: int = 64) -> Scenario:
    cp = draw(st.integers(1, 4))
    dp = draw(st.integers(1, max_world // cp))
    return Scenario(
        datasets=draw(datasets_st()),
        dp=dp,
        cp=cp,
        batch_size=draw(st.integers(1, 8)),
        seed=draw(st.integers(0, 2**64 - 1)),
        epoch=draw(st.integers(0, 5)),
        policy=draw(st.sampled_from(["auto", "cyclic", "drop", "none"])),
        mode=draw(st.sampled_from(["epochs", "steps"])),
        pad_to=draw(st.sampled_from(["batch", "rank"])),
        oversubscribe=draw(st.booleans()),
    )


def all_dp_plans(sc: Scenario) -> list[Plan]:
    """One plan per DP rank, each on a randomly chosen CP peer (CP peers are equal, inv. 2)."""
    pick = np.random.default_rng(sc.seed % 2**32)
    return [sc.plan(d, int(pick.integers(sc.cp))) for d in range(sc.dp)]


def global_lists(sc: Scenario, plans: list[Plan]) -> dict[tuple[str, Hashable], tuple[list[Any], list[Any]]]:
    """Reassemble each bucket's global (sample, pad) lists from every DP rank's batches.

    Window k of a bucket (its k-th global step) holds global positions
    [k * dp * bs, (k + 1) * dp * bs); entry j of dp_rank d's batch is position
    (k * bs + j) * dp + d.
    """
    schedule = plans[0].schedule
    window = np.zeros_like(schedule)
    seen: Counter[int] = Counter()
    for s, t in enumerate(schedule.tolist()):
        window[s] = seen[t]
        seen[t] += 1
    out: dict[tuple[str, Hashable], tuple[list[Any], list[Any]]] = {}
    for d, plan in enumerate(plans):
        for b in plan:
            k = int(window[b.step])
            g_samples, g_pad = out.setdefault((b.dataset, b.bucket), ([], []))
            for j, (sample, pad) in enumerate(zip(b.samples.tolist(), b.pad.tolist())):
                pos = (k * sc.batch_size + j) * sc.dp + d
                while len(g_samples) <= pos:
                    g_samples.append(None)
                    g_pad.append(None)
                assert g_samples[pos] is None, f"global position {pos} filled twice"
                g_samples[pos], g_pad[pos] = sample, pad
    return out


# -- worked examples -------------------------------------------------------------------

def test_worked_example_four_samples_on_eight_ranks() -> None:
    """[A,B,C,D] on 8 DP ranks, batch 1, cyclic + oversubscribe: each sample exactly twice."""
    ds = Dataset("d", {"x": [0, 1, 2, 3]})
    plans = [plan_epoch(ds, Topology(8, r), seed=1, batch_size=1, policy="cyclic", oversubscribe=True)
             for r in range(8)]
    assert all(len(p) == 1 and p.steps == 1 for p in plans)
    entries = [p[0].samples.tolist()[0] for p in plans]
    pads = [p[0].pad.tolist()[0] for p in plans]
    assert Counter(entries) == {0: 2, 1: 2, 2: 2, 3: 2}
    # the shuffled order followed by its own prefix: [C,A,D,B,C,A,D,B], never [.., D,D,D,D]
    assert entries[:4] == entries[4:]
    assert sorted(entries[:4]) == [0, 1, 2, 3]
    assert pads == [False] * 4 + [True] * 4
    order = [0, 1, 2, 3]
    assert entries[:4] == [order[permute_one(i, 4, derive_seed(1, 0, "d", "x", "shuffle", 0))] for i in range(4)]
    st0 = plans[0].stats[0]
    assert (st0.padded_length, st0.padded_copies, st0.oversubscribed, st0.effective_repeats) == (8, 4, True, 1.0)


def test_cyclic_pads_to_next_multiple_from_the_front() -> None:
    ds = Dataset("d", {"b": np.arange(10)})
    plans = [plan_epoch(ds, Topology(4, r), seed=3, batch_size=2, policy="cyclic") for r in range(4)]
    # 10 samples, unit 8 -> 16 entries: 2 steps, 6 padded copies (the first 6 of the order)
    assert [len(p) for p in plans] == [2, 2, 2, 2]
    order = expected_global_order(3, 0, ds, "b")
    g = [None] * 16
    for d, p in enumerate(plans):
        for k, b in enumerate(p):
            for j, s in enumerate(b.samples.tolist()):
                g[(k * 2 + j) * 4 + d] = s
    assert g == order + order[:6]
    assert plans[0].stats[0].padded_copies == 6


def test_drop_truncates_and_none_is_exactly_once() -> None:
    ds = Dataset("d", {"b": np.arange(11)})
    drop = [plan_epoch(ds, Topology(2, r), seed=0, batch_size=2, policy="drop") for r in range(2)]
    assert [len(p) for p in drop] == [2, 2]  # 11 -> 8 entries
    assert drop[0].stats[0].truncated == 3
    taken = np.concatenate([p.samples for p in drop])
    assert len(set(taken.tolist())) == 8 and not any(p.pad.any() for p in drop)

    none = [plan_epoch(ds, Topology(2, r), seed=0, batch_size=2, policy="none") for r in range(2)]
    assert [len(p) for p in none] == [3, 3]  # rank 0: 6 entries, rank 1: 5
    assert [b.samples.size for b in none[0]] == [2, 2, 2]
    assert [b.samples.size for b in none[1]] == [2, 2, 1]
    assert sorted(np.concatenate([p.samples for p in none]).tolist()) == list(range(11))


def test_none_policy_lets_a_rank_skip_a_step() -> None:
    ds = Dataset("d", {"b": np.arange(3)})
    plans = [plan_epoch(ds, Topology(4, r), seed=0, batch_size=1, policy="none") for r in range(4)]
    assert [len(p) for p in plans] == [1, 1, 1, 0]
    assert plans[3].steps == 1  # the step exists; rank 3 has nothing for it


def test_pad_to_rank_gives_an_equal_short_final_batch() -> None:
    ds = Dataset("d", {"b": np.arange(10)})
    plans = [plan_epoch(ds, Topology(4, r), seed=0, batch_size=2, policy="cyclic", pad_to="rank")
             for r in range(4)]
    # unit 4: 10 -> 12 entries, 3 per rank: batches of 2 then 1 on every rank
    assert [[b.samples.size for b in p] for p in plans] == [[2, 1]] * 4
    assert plans[0].stats[0].padded_copies == 2


def test_small_bucket_dropped_with_a_warning_naming_it() -> None:
    ds = Dataset("imgs", {"21:9": np.arange(3), "1:1": np.arange(10, 30)})
    with pytest.warns(DroppedBucketWarning, match=r"imgs/'21:9' \(3 < pad unit 8\).*oversubscribe"):
        plan = plan_epoch(ds, Topology(4, 0), seed=0, batch_size=2, policy="cyclic")
    stats = {s.bucket: s for s in plan.stats}
    assert stats["21:9"].dropped and stats["21:9"].steps == 0 and stats["21:9"].padded_length == 0
    assert {b.bucket for b in plan} == {"1:1"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_epoch(ds, Topology(4, 0), seed=0, batch_size=2, policy="cyclic", warn=False)
        kept = plan_epoch(ds, Topology(4, 0), seed=0, batch_size=2, policy="cyclic", oversubscribe=True)
    assert {s.bucket: s.oversubscribed for s in kept.stats} == {"1:1": False, "21:9": True}


def test_repeats_materialised_before_the_split() -> None:
    ds = Dataset("d", {"b": np.arange(3)}, repeats=1)
    plans = [plan_epoch(ds, Topology(6, r), seed=9, batch_size=1, policy="cyclic") for r in range(6)]
    entries = [p[0].samples.tolist()[0] for p in plans]
    assert Counter(entries) == {0: 2, 1: 2, 2: 2}
    assert entries == expected_global_order(9, 0, ds, "b")
    assert not any(p.pad.any() for p in plans)


def test_plan_input_forms_and_indexing() -> None:
    class FakeIndex:
        def to_dataset(self) -> Dataset:
            return Dataset("idx", {"k": np.arange(8)})

    p1 = plan_epoch({"k": np.arange(8)}, Topology(2, 1), seed=4, batch_size=2)
    assert p1.datasets == ("dataset0",)
    p2 = plan_epoch(FakeIndex(), Topology(2, 1), seed=4, batch_size=2)
    assert p2.datasets == ("idx",)
    assert len(p2) == 2 and p2[-1].index == 1 and p2[-1].step == 1
    with pytest.raises(IndexError, match="out of range"):
        p2[2]
    rec = p2[0].to_json(p2.topology)
    assert set(rec) == {"rank", "dp_rank", "step", "epoch", "dataset", "bucket", "samples", "pad", "seeds"}
    assert json.loads(json.dumps(rec)) == rec


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(batch_size=0), "batch_size must be an int >= 1"),
        (dict(batch_size=True), "batch_size"),
        (dict(seed=-1), r"seed must be in \[0, 2\*\*64\), got -1"),
        (dict(seed=1.5), "seed"),
        (dict(epoch=-1), r"epoch must be in \[0, MAX_EPOCH=2147483647\], got -1"),
        (dict(policy="cyclical"), "unknown padding policy 'cyclical'; expected one of: auto, cyclic, drop, none"),
        (dict(mode="epoch"), "unknown mode 'epoch'"),
        (dict(pad_to="sample"), "unknown pad_to 'sample'"),
        (dict(oversubscribe="false"), "oversubscribe must be True or False, got str 'false'"),
        (dict(oversubscribe=1), "oversubscribe must be True or False, got int 1"),
    ],
)
def test_plan_epoch_rejects_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = dict(seed=0, batch_size=2)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        plan_epoch({"a": [1, 2]}, Topology(1, 0), **args)


def test_dataset_validation() -> None:
    with pytest.raises(ConfigError, match="sample id 3 occurs twice"):
        Dataset("d", {"a": [3, 1, 3]})
    with pytest.raises(ConfigError, match="1-D integer array"):
        Dataset("d", {"a": [1.5, 2.0]})
    with pytest.raises(ConfigError, match="1-D integer array"):
        Dataset("d", {"a": [[1, 2]]})
    with pytest.raises(ConfigError, match="repeats must be an int >= 0"):
        Dataset("d", {}, repeats=-1)
    with pytest.raises(ConfigError, match="weight must be a finite number > 0"):
        Dataset("d", {}, weight=0)
    with pytest.raises(ConfigError, match="weight"):
        Dataset("d", {}, weight=float("nan"))
    with pytest.raises(ConfigError, match="non-empty str"):
        Dataset("", {})
    with pytest.raises(ConfigError, match="cannot derive a stable key"):
        Dataset("d", {frozenset([1]): [1]})
    with pytest.raises(ConfigError, match="dataset names must be unique"):
        plan_epoch([Dataset("d", {}), Dataset("d", {})], Topology(1, 0), seed=0, batch_size=1)
    with pytest.raises(ConfigError, match="topology must be a wds_pad.Topology"):
        plan_epoch({"a": [1]}, "rank0", seed=0, batch_size=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="nothing to plan"):
        plan_epoch([], Topology(1, 0), seed=0, batch_size=1)
    assert Dataset("d", {"a": []}).buckets["a"].dtype == np.int64


def test_bucket_order_is_canonical() -> None:
    keys = ["b", 3, ("len", 2), 1.5, "a", None, ("len", 1)]
    assert sorted(keys, key=bucket_order) == [None, 1.5, 3, "a", "b", ("len", 1), ("len", 2)]
    ds1 = Dataset("d", {"b": [1], "a": [2], 3: [4]})
    ds2 = Dataset("d", {3: [4], "a": [2], "b": [1]})
    assert list(ds1.buckets) == list(ds2.buckets) == [3, "a", "b"]


def test_iter_steps_is_endless_and_refuses_an_empty_stream() -> None:
    ds = Dataset("d", {"b": np.arange(20)})
    it = iter_steps(ds, Topology(2, 0), seed=1, batch_size=4)
    plans = [next(it) for _ in range(3)]
    assert [p.epoch for p in plans] == [0, 1, 2]
    assert all(p.policy is Policy.DROP and p.mode is Mode.STEPS for p in plans)
    assert [len(p) for p in plans] == [2, 2, 2]
    with pytest.raises(ConfigError, match="steps mode has nothing to stream"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DroppedBucketWarning)
            next(iter_steps(Dataset("d", {"b": np.arange(3)}), Topology(2, 0), seed=1, batch_size=4))


# -- invariants as properties ------------------------------------------------------------

@PROPERTY
@given(scenarios())
def test_inv1_equal_batch_counts_and_same_bucket_per_step(sc: Scenario) -> None:
    plans = all_dp_plans(sc)
    ref = plans[0]
    for plan in plans:
        assert np.array_equal(plan.schedule, ref.schedule)
        assert plan.bucket_table == ref.bucket_table
        assert plan.steps == ref.steps
        if sc.concrete != "none":
            assert np.array_equal(plan.batch_step, ref.batch_step)
            assert len(plan) == len(ref) == ref.steps
    # whatever the policy, every step is taken by some rank and a batch's bucket is the step's
    taken: set[int] = set()
    for plan in plans:
        taken.update(plan.batch_step.tolist())
        for b in plan:
            di, key = plan.bucket_table[int(plan.schedule[b.step])]
            assert (b.dataset, b.bucket) == (plan.datasets[di], key)
        assert np.all(np.diff(plan.batch_step) > 0)
    assert taken == set(range(ref.steps))


@PROPERTY
@given(scenarios(), st.data())
def test_inv2_cp_peers_get_identical_batches(sc: Scenario, data: Any) -> None:
    d = data.draw(st.integers(0, sc.dp - 1))
    plans = [sc.plan(d, c) for c in range(sc.cp)]
    for plan in plans[1:]:
        assert plan.topology.dp_rank == d
        assert batches_of(plan) == batches_of(plans[0])
        assert np.array_equal(plan.samples, plans[0].samples)
        assert np.array_equal(plan.pad, plans[0].pad)


@PROPERTY
@given(scenarios())
def test_inv3_union_over_ranks_is_the_padded_bucket_lists(sc: Scenario) -> None:
    """Reassembled from every DP rank (step k of a bucket = the contiguous window
    [k*dp*bs, (k+1)*dp*bs) of its order), each bucket is exactly its padded global list."""
    plans = all_dp_plans(sc)
    glob = global_lists(sc, plans)
    policy = sc.concrete
    stats = {(s.dataset, s.bucket): s for s in plans[0].stats}
    seen_keys = set()
    for ds in sc.datasets:
        passes = 1 + ds.repeats
        for key, ids in ds.buckets.items():
            n, m = int(ids.size), int(ids.size) * passes
            length = expected_length(m, sc.unit, policy, sc.oversubscribe)
            s = stats[(ds.name, key)]
            assert (s.samples, s.length, s.padded_length) == (n, m, length)
            assert s.steps == math.ceil(length / (sc.dp * sc.batch_size))
            if length == 0:
                assert (ds.name, key) not in glob
                assert s.dropped == (n > 0)
                continue
            seen_keys.add((ds.name, key))
            g, pad = glob[(ds.name, key)]
            assert len(g) == length and None not in g, "a global position is missing"
            # this is exactly the spec's list: shuffled passes, extended by its own prefix
            order = expected_global_order(sc.seed, sc.epoch, ds, key)
            assert g == [order[i % m] for i in range(length)]
            assert pad == [i >= m for i in range(length)]
            # and, spelled out as the invariant:
            full = min(length, m) // n
            for p in range(full):
                assert sorted(g[p * n:(p + 1) * n]) == ids.tolist()
            counts = Counter(g)
            assert set(counts) <= set(ids.tolist())
            if policy == "cyclic":
                assert all(g[i] == g[i % m] for i in range(m, length))
                if m >= sc.unit:
                    assert 0 <= length - m < sc.unit
                    assert all(counts[i] >= passes for i in ids.tolist())
                else:  # oversubscribed: exactly one whole unit
                    assert length == sc.unit and s.oversubscribed
            elif policy == "drop":
                assert max(counts.values()) <= passes and not any(pad)
            else:  # none
                assert counts == {i: passes for i in ids.tolist()} and not any(pad)
            assert sum(pad) == s.padded_copies == length - m if length > m else not any(pad)
    assert set(glob) == seen_keys


@PROPERTY
@given(scenarios())
def test_batches_have_batch_size_and_never_mix_buckets(sc: Scenario) -> None:
    d = sc.seed % sc.dp
    plan = sc.plan(d)
    owner = {(ds.name, int(i)): key for ds in sc.datasets for key, ids in ds.buckets.items() for i in ids}
    stats = {(s.dataset, s.bucket): s for s in plan.stats}
    per_rank = {k: len(range(d, s.padded_length, sc.dp)) for k, s in stats.items()}
    taken: Counter[tuple[str, Hashable]] = Counter()
    for b in plan:
        assert {owner[(b.dataset, int(i))] for i in b.samples.tolist()} == {b.bucket}
        k = (b.dataset, b.bucket)
        left = per_rank[k] - taken[k] * sc.batch_size
        taken[k] += 1
        if sc.concrete == "none" or sc.pad_to == "rank":
            assert b.samples.size == min(sc.batch_size, left)
        else:
            assert b.samples.size == sc.batch_size
        if sc.pad_to == "rank" and sc.concrete != "none":
            # the short final batch has the same size on every rank
            assert b.samples.size == min(sc.batch_size, stats[k].padded_length // sc.dp - (taken[k] - 1) * sc.batch_size)
    for k, s in stats.items():
        assert taken[k] == (math.ceil(per_rank[k] / sc.batch_size) if per_rank[k] else 0)


@PROPERTY
@given(scenarios(), st.data())
def test_inv4_same_inputs_same_plan(sc: Scenario, data: Any) -> None:
    d = data.draw(st.integers(0, sc.dp - 1))
    a = sc.plan(d)
    # rebuild the datasets from scratch with ids and buckets in another input order
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    rebuilt = []
    for ds in sc.datasets:
        keys = list(ds.buckets)
        rng.shuffle(keys)
        rebuilt.append(Dataset(ds.name, {k: rng.permutation(ds.buckets[k]) for k in keys},
                               repeats=ds.repeats, weight=ds.weight))
    b = quiet_plan(rebuilt, sc.topo(d), seed=sc.seed, epoch=sc.epoch, batch_size=sc.batch_size,
                   policy=sc.policy, mode=sc.mode, pad_to=sc.pad_to, oversubscribe=sc.oversubscribe)
    for name in ("schedule", "batch_step", "offsets", "samples", "pad"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name
    assert a.stats == b.stats and a.bucket_table == b.bucket_table


@PROPERTY
@given(scenarios(), st.data())
def test_inv5_empty_buckets_contribute_nothing(sc: Scenario, data: Any) -> None:
    d = data.draw(st.integers(0, sc.dp - 1))
    with_empty = []
    empty_keys = set()
    for ds in sc.datasets:
        extra = data.draw(st.lists(st.sampled_from(["e1", "e2", 99, ("len", 0)]), unique=True, max_size=3))
        buckets = dict(ds.buckets)
        for key in extra:
            if key not in buckets:
                buckets[key] = np.zeros(0, np.int64)
        empty_keys |= {(ds.name, k) for k, v in buckets.items() if v.size == 0}
        with_empty.append(Dataset(ds.name, buckets, repeats=ds.repeats, weight=ds.weight))
    without = [Dataset(ds.name, {k: v for k, v in ds.buckets.items() if v.size}, repeats=ds.repeats,
                       weight=ds.weight) for ds in sc.datasets]
    a = quiet_plan(with_empty, sc.topo(d), seed=sc.seed, epoch=sc.epoch, batch_size=sc.batch_size,
                   policy=sc.policy, mode=sc.mode, pad_to=sc.pad_to, oversubscribe=sc.oversubscribe)
    b = quiet_plan(without, sc.topo(d), seed=sc.seed, epoch=sc.epoch, batch_size=sc.batch_size,
                   policy=sc.policy, mode=sc.mode, pad_to=sc.pad_to, oversubscribe=sc.oversubscribe)
    assert batches_of(a) == batches_of(b) and a.steps == b.steps
    for s in a.stats:
        if (s.dataset, s.bucket) in empty_keys:
            assert (s.samples, s.length, s.padded_length, s.padded_copies, s.truncated, s.steps) == (0,) * 6
            assert not s.dropped and not s.oversubscribed
    assert not any((b.dataset, b.bucket) in empty_keys for b in a)
    # empty buckets are never reported as dropped
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan_epoch([Dataset(ds.name, {k: [] for k in ds.buckets}) for ds in with_empty], sc.topo(d),
                   seed=sc.seed, batch_size=sc.batch_size, policy=sc.policy, pad_to=sc.pad_to)
    assert not caught


@PROPERTY
@given(scenarios(max_world=16))
def test_inv6_next_epoch_uses_the_same_policy(sc: Scenario) -> None:
    d = sc.seed % sc.dp
    first = sc.plan(d)
    nxt = sc.plan(d, epoch=sc.epoch + 1)
    assert first.policy is nxt.policy is Policy(sc.concrete)
    strip = [(s.dataset, s.bucket, s.padded_length, s.padded_copies, s.truncated, s.dropped, s.steps)
             for s in first.stats]
    assert strip == [(s.dataset, s.bucket, s.padded_length, s.padded_copies, s.truncated, s.dropped, s.steps)
                     for s in nxt.stats]
    assert first.steps == nxt.steps and len(first) == len(nxt)
    if sc.mode == "steps" and first.steps:
        stream = iter_steps(sc.datasets, sc.topo(d), seed=sc.seed, batch_size=sc.batch_size,
                            start_epoch=sc.epoch, policy=sc.policy, oversubscribe=sc.oversubscribe,
                            pad_to=sc.pad_to)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DroppedBucketWarning)
            got = [next(stream) for _ in range(2)]
        assert [p.epoch for p in got] == [sc.epoch, sc.epoch + 1]
        assert batches_of(got[0]) == batches_of(first) and batches_of(got[1]) == batches_of(nxt)


@PROPERTY
@given(scenarios(), st.data())
def test_matches_the_list_reference(sc: Scenario, data: Any) -> None:
    d = data.draw(st.integers(0, sc.dp - 1))
    c = data.draw(st.integers(0, sc.cp - 1))
    plan = sc.plan(d, c)
    ref = lists.plan_epoch_lists(
        to_list_datasets(sc.datasets), world_size=sc.world, rank=d * sc.cp + c, cp_size=sc.cp,
        seed=sc.seed, epoch=sc.epoch, batch_size=sc.batch_size, policy=sc.policy, mode=sc.mode,
        oversubscribe=sc.oversubscribe, pad_to=sc.pad_to)
    assert plan.steps == ref.steps
    assert batches_of(plan) == ref.batches
    for s, r in zip(plan.stats, ref.stats, strict=True):
        assert {k: getattr(s, k) for k in r} == r


# -- bitwise identical across processes -------------------------------------------------

_DIGEST_SCRIPT = r"""
import hashlib, sys, warnings
import numpy as np
from wds_pad import Dataset, Topology, plan_epoch
warnings.simplefilter("ignore")
h = hashlib.sha256()
dss = [Dataset("imgs", {"1:1": np.arange(0, 157), "16:9": np.arange(500, 531), ("len", 3): [9000, 9001],
                        2.5: np.arange(700, 790), "empty": []}, repeats=1, weight=2.0),
       Dataset("text", {k: np.arange(1000 * i, 1000 * i + 40 + 13 * i) for i, k in enumerate("abcdef")},
               weight=0.5)]
for world, cp, bs, policy, pad_to, over in [(8, 2, 3, "cyclic", "batch", True), (12, 1, 2, "drop", "batch", False),
                                            (6, 3, 4, "none", "rank", False), (16, 4, 1, "auto", "rank", True)]:
    for rank in range(world):
        for epoch in (0, 1):
            p = plan_epoch(dss, Topology(world, rank, cp_size=cp), seed=2**63 + 11, epoch=epoch, batch_size=bs,
                           policy=policy, pad_to=pad_to, oversubscribe=over)
            for a in (p.schedule, p.batch_step, p.offsets, p.samples, p.pad):
                h.update(a.tobytes())
            h.update(repr(p.stats).encode())
print(h.hexdigest())
"""


def test_inv4_identical_plans_in_other_processes_under_any_hashseed(tmp_path: Path) -> None:
    script = tmp_path / "digest.py"
    script.write_text(_DIGEST_SCRIPT)
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONHASHSEED=hashseed, PYTHONPATH=str(ROOT)))
             for hashseed in ("0", "1", "4242", "random")]  # side by side: each is a fresh interpreter
    digests = set()
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        digests.add(stdout.strip())
    assert len(digests) == 1
    (digest,) = digests
    assert len(digest) == 64
    # and the same as in this process
    namespace: dict[str, Any] = {}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(_DIGEST_SCRIPT, "digest", "exec"), namespace)
    assert buf.getvalue().strip() == digest


# -- what plan_epoch refuses: seeds, epochs, absurd padded sizes ---------------------------

@pytest.mark.parametrize("seed", [0, 1, 2**63, 2**64 - 1, np.uint64(2**64 - 1)])
def test_plan_epoch_accepts_every_seed_in_0_to_2_pow_64(seed: Any) -> None:
    plan = plan_epoch({"a": [1, 2]}, Topology(1, 0), seed=seed, batch_size=2)
    assert len(plan) == 1


@pytest.mark.parametrize("seed", [-1, 2**64, 2**70, 1.0, "3", True])
def test_plan_epoch_refuses_the_seeds_shared_seed_refuses(seed: Any) -> None:
    from wds_pad import shared_seed

    with pytest.raises(ConfigError, match="seed must be"):
        shared_seed(seed)
    with pytest.raises(ConfigError, match="seed must be"):
        plan_epoch({"a": [1, 2]}, Topology(1, 0), seed=seed, batch_size=2)


@pytest.mark.parametrize("epoch", [0, 1, np.int64(7), MAX_EPOCH])
def test_plan_epoch_accepts_epochs_up_to_max_epoch(epoch: Any) -> None:
    plan = plan_epoch({"a": [1, 2]}, Topology(1, 0), seed=1, epoch=epoch, batch_size=2)
    assert plan.epoch == int(epoch) and type(plan.epoch) is int


@pytest.mark.parametrize(
    ("epoch", "match"),
    [
        (1.5, "epoch must be an int in .* got float 1.5"),
        (2.0, "got float 2.0"),
        ("2", "got str '2'"),
        (True, "got bool True"),
        (np.float64(1), "got float"),
        (None, "got NoneType"),
        (-1, "epoch must be in"),
        (MAX_EPOCH + 1, rf"MAX_EPOCH={MAX_EPOCH}\], got {MAX_EPOCH + 1}"),
        (2**64, "not a step count or a timestamp"),
    ],
)
def test_plan_epoch_refuses_what_is_not_an_epoch(epoch: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan_epoch({"a": [1, 2]}, Topology(1, 0), seed=1, epoch=epoch, batch_size=2)
    with pytest.raises(ConfigError, match=match.replace("epoch must", "start_epoch must")):
        next(iter_steps({"a": [1, 2]}, Topology(1, 0), seed=1, start_epoch=epoch, batch_size=2))


def test_an_absurd_oversubscribed_step_is_refused_before_allocating() -> None:
    # one global step of 8 x 10^13 entries: numpy would try to allocate 72 TiB per rank
    with pytest.raises(ConfigError) as err:
        plan_epoch({"a": [1, 2, 3, 4]}, Topology(8, 0), seed=1, batch_size=10**13, policy="cyclic",
                   oversubscribe=True)
    msg = str(err.value)
    assert "bucket 'a' (4 entries) would be filled cyclically (oversubscribe)" in msg
    assert f"{8 * 10**13} entries per epoch" in msg and f"2**40 = {MAX_PLANNED_ENTRIES}" in msg
    assert "batch size" in msg and "world size" in msg and "oversubscribe off" in msg
    # without oversubscribe the small bucket is simply dropped: nothing to refuse
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedBucketWarning)
        assert len(plan_epoch({"a": [1, 2]}, Topology(8, 0), seed=1, batch_size=10**13, policy="cyclic")) == 0


def test_absurd_repeats_and_a_total_over_the_limit_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"dataset 'd' bucket 'a' would hold 2000000000000002 entries .*"
                                          r"2 samples x 1000000000000001 passes.*lower the dataset's repeats"):
        plan_epoch(Dataset("d", {"a": [1, 2]}, repeats=10**15), Topology(1, 0), seed=1, batch_size=1)
    # every bucket is under the limit, their sum is not
    half = MAX_PLANNED_ENTRIES // 2 + 1
    with pytest.raises(ConfigError, match=rf"would plan {2 * half} entries over all buckets"):
        plan_epoch({"a": [1], "b": [2]}, Topology(1, 0), seed=1, batch_size=half, policy="cyclic",
                   oversubscribe=True)


def test_a_batch_that_memory_cannot_hold_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import wds_pad.core.planning.planrecord as records

    def no_memory(*args: Any) -> Any:  # what numpy raises for 3.6 TiB on a 24 GiB machine
        raise MemoryError("Unable to allocate 3.64 TiB for an array")

    bs = 10**11
    # a lazy plan allocates nothing per entry: setting up the epoch succeeds
    plan = plan_epoch({k: [i] for i, k in enumerate("abcde")}, Topology(1, 0), seed=1, batch_size=bs,
                      policy="cyclic", oversubscribe=True)
    assert len(plan) == 5 and int(plan.offsets[-1]) == 5 * bs
    monkeypatch.setattr(records.Buckets, "entries", no_memory)
    with pytest.raises(ConfigError, match=rf"batch 0 holds {bs} planned entries, more than this machine "
                                          r"can allocate.*lower the batch size") as err:
        plan[0]
    with pytest.raises(ConfigError, match=rf"this rank's share holds {5 * bs} planned entries"):
        plan.samples
    assert isinstance(err.value.__cause__, MemoryError)


def test_dropped_bucket_warning_points_at_the_callers_line_and_counts_what_it_drops() -> None:
    ds = Dataset("imgs", {"21:9": np.arange(3), "1:1": np.arange(10, 30)})
    with pytest.warns(DroppedBucketWarning) as record:
        plan_epoch(ds, Topology(4, 0), seed=0, batch_size=2, policy="cyclic")
    (w,) = record
    assert w.filename == __file__  # this line, not the planner's
    assert "they hold 3 of the epoch's 23 samples (13.0%)" in str(w.message)
    assert "oversubscribe=True" in str(w.message) and "appear more often" in str(w.message)


# -- lazy plans equal the eager definition --------------------------------------------------

@PROPERTY
@given(scenarios(max_world=16), st.data())
def test_lazy_batches_equal_the_materialised_share(sc: Scenario, data: Any) -> None:
    """plan[i], computed alone, is slice i of plan.samples / plan.pad (the whole share)."""
    d = data.draw(st.integers(0, sc.dp - 1))
    lazy = sc.plan(d, data.draw(st.integers(0, sc.cp - 1)))
    batches = [lazy[i] for i in data.draw(st.permutations(range(len(lazy))))]  # any order, before the share
    eager = sc.plan(d)
    samples, pad, offsets = eager.samples, eager.pad, eager.offsets
    assert offsets[0] == 0 and offsets[-1] == samples.size == pad.size
    for b in batches:
        i = b.index
        assert np.array_equal(b.samples, samples[offsets[i] : offsets[i + 1]])
        assert np.array_equal(b.pad, pad[offsets[i] : offsets[i + 1]])
        assert b.samples.dtype == np.int64 and b.pad.dtype == bool
        assert b.step == int(eager.batch_step[i])
    assert sorted(b.index for b in batches) == list(range(len(eager)))


@st.composite
def range_datasets_st(draw: Any) -> tuple[list[Dataset], list[Dataset]]:
    """Datasets whose buckets are contiguous runs of ids (as an index's rows are), twice:
    as IdRange buckets and as the same ids in explicit arrays."""
    from wds_pad import IdRange

    ranges, arrays = [], []
    for i in range(draw(st.integers(1, 2))):
        keys = draw(st.lists(st.sampled_from(KEYS), min_size=0, max_size=5, unique=True))
        start = draw(st.integers(0, 10**9))
        spans: dict[Hashable, tuple[int, int]] = {}
        for key in keys:  # disjoint runs, laid out in the order drawn (not the bucket order)
            n = draw(SIZES)
            spans[key] = (start, start + n)
            start += n + draw(st.integers(0, 5))
        repeats, weight = draw(st.integers(0, 3)), draw(st.floats(0.1, 10.0))
        ranges.append(Dataset(f"ds{i}", {k: IdRange(a, b) for k, (a, b) in spans.items()}, repeats, weight))
        arrays.append(Dataset(f"ds{i}", {k: np.arange(a, b, dtype=np.int64) for k, (a, b) in spans.items()},
                              repeats, weight))
    return ranges, arrays


@PROPERTY
@given(range_datasets_st(), st.data())
def test_idrange_buckets_plan_like_explicit_ids_and_the_reference(dss: Any, data: Any) -> None:
    ranges, arrays = dss
    cp = data.draw(st.integers(1, 2))
    world = cp * data.draw(st.integers(1, 16 // cp))
    rank = data.draw(st.integers(0, world - 1))
    kwargs: dict[str, Any] = dict(
        seed=data.draw(st.integers(0, 2**64 - 1)), epoch=data.draw(st.integers(0, 3)),
        batch_size=data.draw(st.integers(1, 6)), policy=data.draw(st.sampled_from(["auto", "cyclic", "drop", "none"])),
        mode=data.draw(st.sampled_from(["epochs", "steps"])), pad_to=data.draw(st.sampled_from(["batch", "rank"])),
        oversubscribe=data.draw(st.booleans()))
    topo = Topology(world, rank, cp_size=cp)
    lazy, eager = quiet_plan(ranges, topo, **kwargs), quiet_plan(arrays, topo, **kwargs)
    for name in ("schedule", "window", "batch_step", "offsets", "samples", "pad"):
        a, b = getattr(lazy, name), getattr(eager, name)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name  # bitwise
    assert lazy.stats == eager.stats and lazy.bucket_table == eager.bucket_table
    assert batches_of(lazy) == batches_of(eager)
    ref = lists.plan_epoch_lists(to_list_datasets(ranges), world_size=world, rank=rank, cp_size=cp, **kwargs)
    assert lazy.steps == ref.steps and batches_of(lazy) == ref.batches


# -- the invariants for locality="shard" (core/local/locality.py) -------------------------------
# The same properties over both localities: ``none`` is the scenarios above; ``shard``
# wraps each drawn dataset in a ShardMap (each sample id's shard drawn at random or in
# runs) and plans with a drawn window. Properties that only call ``sc.plan`` are the
# tests above run on these scenarios; the others are restated with the shard maps.

from wds_pad.core.local.locality import ShardMap  # noqa: E402


@dataclass
class ShardedScenario(Scenario):
    locality: str = "shard"
    window: int = 8
    shards: int = 1
    chunk: int = 1
    shard_seed: int = 0

    def shard_maps(self) -> list[ShardMap]:
        cached = self.__dict__.get("_maps")
        if cached is None:
            cached = []
            for ds in self.datasets:
                top = max((int(np.max(v)) for v in ds.buckets.values() if v.size), default=-1) + 1
                if self.chunk:
                    sh = (np.arange(top, dtype=np.int64) // self.chunk) % self.shards
                else:
                    sh = np.random.default_rng(self.shard_seed).integers(0, self.shards, size=top)
                cached.append(ShardMap(ds, sh))
            self.__dict__["_maps"] = cached
        return cached

    def plan(self, dp_rank: int, cp_rank: int = 0, **over: Any) -> Plan:
        kwargs: dict[str, Any] = dict(seed=self.seed, epoch=self.epoch, batch_size=self.batch_size,
                                      policy=self.policy, mode=self.mode, pad_to=self.pad_to,
                                      oversubscribe=self.oversubscribe, locality=self.locality,
                                      window=self.window)
        kwargs.update(over)
        return quiet_plan(self.shard_maps(), self.topo(dp_rank, cp_rank), **kwargs)


@st.composite
def sharded_scenarios(draw: Any, max_world: int = 16) -> ShardedScenario:
    sc = draw(scenarios(max_world=max_world))
    return ShardedScenario(**{k: getattr(sc, k) for k in sc.__dataclass_fields__},
                           window=draw(st.integers(1, 6)), shards=draw(st.integers(1, 40)),
                           chunk=draw(st.sampled_from([0, 1, 3, 20])), shard_seed=draw(st.integers(0, 2**32 - 1)))


LOCAL = settings(PROPERTY, max_examples=150)


@LOCAL
@given(sharded_scenarios())
def test_shard_locality_inv1_equal_batch_counts_and_same_bucket_per_step(sc: ShardedScenario) -> None:
    test_inv1_equal_batch_counts_and_same_bucket_per_step.hypothesis.inner_test(sc)  # type: ignore[attr-defined]
    # and the schedule is exactly the one of locality="none"
    assert np.array_equal(sc.plan(0).schedule, sc.plan(0, locality="none").schedule)


@LOCAL
@given(sharded_scenarios(), st.data())
def test_shard_locality_inv2_cp_peers_get_identical_batches(sc: ShardedScenario, data: Any) -> None:
    test_inv2_cp_peers_get_identical_batches.hypothesis.inner_test(sc, data)  # type: ignore[attr-defined]


@LOCAL
@given(sharded_scenarios())
def test_shard_locality_batches_have_batch_size_and_never_mix_buckets(sc: ShardedScenario) -> None:
    test_batches_have_batch_size_and_never_mix_buckets.hypothesis.inner_test(sc)  # type: ignore[attr-defined]


@LOCAL
@given(sharded_scenarios(), st.data())
def test_shard_locality_lazy_batches_equal_the_materialised_share(sc: ShardedScenario, data: Any) -> None:
    test_lazy_batches_equal_the_materialised_share.hypothesis.inner_test(sc, data)  # type: ignore[attr-defined]


@LOCAL
@given(sharded_scenarios())
def test_shard_locality_inv3_union_over_ranks_is_the_padded_bucket_lists(sc: ShardedScenario) -> None:
    """Each bucket's reassembled global list: a permutation of its 1 + repeats passes
    (cut to the unpadded length), extended by its own prefix, exactly as for ``none``."""
    plans = all_dp_plans(sc)
    glob = global_lists(sc, plans)
    policy = sc.concrete
    ref = {(s.dataset, s.bucket): s for s in sc.plan(0, locality="none").stats}
    assert {(s.dataset, s.bucket): s for s in plans[0].stats} == ref
    seen = set()
    for ds in sc.datasets:
        passes = 1 + ds.repeats
        for key, ids in ds.buckets.items():
            n, m = int(ids.size), int(ids.size) * passes
            length = expected_length(m, sc.unit, policy, sc.oversubscribe)
            if length == 0:
                assert (ds.name, key) not in glob
                continue
            seen.add((ds.name, key))
            g, pad = glob[(ds.name, key)]
            assert len(g) == length and None not in g, "a global position is missing"
            assert pad == [i >= m for i in range(length)]
            assert all(g[i] == g[i % m] for i in range(m, length))  # padded copies: the front
            counts = Counter(g[:min(m, length)])
            assert set(counts) <= set(ids.tolist())
            assert max(counts.values()) <= passes
            if length >= m:  # nothing truncated: every sample exactly 1 + repeats times
                assert counts == {i: passes for i in ids.tolist()}
    assert set(glob) == seen


@LOCAL
@given(sharded_scenarios(), st.data())
def test_shard_locality_inv4_same_inputs_same_plan(sc: ShardedScenario, data: Any) -> None:
    d = data.draw(st.integers(0, sc.dp - 1))
    a = sc.plan(d)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    rebuilt = []
    for ds, sm in zip(sc.datasets, sc.shard_maps()):
        keys = list(ds.buckets)
        rng.shuffle(keys)
        rebuilt.append(ShardMap(Dataset(ds.name, {k: rng.permutation(ds.buckets[k]) for k in keys},
                                        repeats=ds.repeats, weight=ds.weight), sm.shard.copy()))
    b = quiet_plan(rebuilt, sc.topo(d), seed=sc.seed, epoch=sc.epoch, batch_size=sc.batch_size,
                   policy=sc.policy, mode=sc.mode, pad_to=sc.pad_to, oversubscribe=sc.oversubscribe,
                   locality="shard", window=sc.window)
    for name in ("schedule", "batch_step", "offsets", "samples", "pad"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name
    assert a.stats == b.stats and a.bucket_table == b.bucket_table


@LOCAL
@given(sharded_scenarios(), st.data())
def test_shard_locality_inv5_empty_buckets_contribute_nothing(sc: ShardedScenario, data: Any) -> None:
    d = data.draw(st.integers(0, sc.dp - 1))
    with_empty = []
    for ds, sm in zip(sc.datasets, sc.shard_maps()):
        buckets = {**ds.buckets, "e1": np.zeros(0, np.int64), ("len", 0): np.zeros(0, np.int64)}
        with_empty.append(ShardMap(Dataset(ds.name, buckets, repeats=ds.repeats, weight=ds.weight), sm.shard))
    a = quiet_plan(with_empty, sc.topo(d), seed=sc.seed, epoch=sc.epoch, batch_size=sc.batch_size,
                   policy=sc.policy, mode=sc.mode, pad_to=sc.pad_to, oversubscribe=sc.oversubscribe,
                   locality="shard", window=sc.window)
    assert batches_of(a) == batches_of(sc.plan(d)) and a.steps == sc.plan(d).steps


@LOCAL
@given(sharded_scenarios())
def test_shard_locality_inv6_next_epoch_uses_the_same_policy(sc: ShardedScenario) -> None:
    d = sc.seed % sc.dp
    first, nxt = sc.plan(d), sc.plan(d, epoch=sc.epoch + 1)
    assert first.policy is nxt.policy is Policy(sc.concrete)
    assert first.stats == nxt.stats
    assert first.steps == nxt.steps and len(first) == len(nxt)
    if sc.mode == "steps" and first.steps:
        stream = iter_steps(sc.shard_maps(), sc.topo(d), seed=sc.seed, batch_size=sc.batch_size,
                            start_epoch=sc.epoch, policy=sc.policy, oversubscribe=sc.oversubscribe,
                            pad_to=sc.pad_to, locality="shard", window=sc.window)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DroppedBucketWarning)
            got = [next(stream) for _ in range(2)]
        assert batches_of(got[0]) == batches_of(first) and batches_of(got[1]) == batches_of(nxt)


@pytest.mark.parametrize("locality", ["none", "shard"])
def test_both_localities_plan_the_same_schedule_and_stats(locality: str) -> None:
    rng = np.random.default_rng(5)
    ids = {k: np.flatnonzero(rng.integers(0, 4, 600) == k) for k in range(4)}
    sm = ShardMap(Dataset("d", ids, repeats=1), np.arange(600) // 30)
    ref = plan_epoch(sm, Topology(4, 1), seed=9, batch_size=5)
    plan = plan_epoch(sm, Topology(4, 1), seed=9, batch_size=5, locality=locality)
    assert plan.locality.value == locality
    for name in ("schedule", "window", "batch_step", "offsets"):
        assert getattr(plan, name).tobytes() == getattr(ref, name).tobytes()
    assert plan.stats == ref.stats
    if locality == "none":  # bitwise today's plan
        assert plan.samples.tobytes() == ref.samples.tobytes()
