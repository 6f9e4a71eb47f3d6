"""The plan-aware shard cache (io/shardcache.py) against loopback nginx and moto S3.

Requests are counted at the server (a FaultProxy in front of nginx) and bytes are
compared with webdataset reading the same shards from local disk.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from data_helpers import assert_same_bytes, batch_keys, plan_keys, serve_dir, upload_files, wds_reference
from servers import MotoServer
from wds_pad.cli.synth import make_image_shards
from wds_pad.core.topology import Topology
from wds_pad.errors import StateMismatchError
from wds_pad.index.build import build_index
from wds_pad.io.ranges import ReadOptions
from wds_pad.io.shardcache import PlannedShard, ShardCache
from wds_pad.stream.dataset import BucketedWebDataset
from wds_pad.state.cursor import Position
from wds_pad.stream.stages import PlannedSource
from wds_pad.stream.wholeshards import shard_schedule

pytest_plugins = ["conftest_servers"]

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning"),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

SHARDS = 8
SAMPLES = 160
BUCKET_BY = "aspect:width,height"
BLOCK = 16 * 1024  # small blocks, so a shard takes several GETs


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sc-shards")
    for i, path in enumerate(make_image_shards(out / "gen", samples=SAMPLES, shards=SHARDS, seed=9)):
        os.replace(path, out / f"train-{i:06d}.tar")
    return out


@pytest.fixture(scope="module")
def reference(shard_dir: Path) -> dict[str, dict[str, Any]]:
    return wds_reference(str(shard_dir / f"train-{i:06d}.tar") for i in range(SHARDS))


@pytest.fixture
def proxied(nginx_server: Any, shard_dir: Path, fault_proxy: Any, tmp_path: Path) -> tuple[Any, Any]:
    base = serve_dir(nginx_server, shard_dir, "sc-train", ignore=shutil.ignore_patterns("gen"))
    proxy = fault_proxy(nginx_server)
    url = base.replace(f"{nginx_server.host}:{nginx_server.port}", f"{proxy.host}:{proxy.port}")
    index = build_index(f"{url}/train-{{000000..{SHARDS - 1:06d}}}.tar", BUCKET_BY,
                        output=str(tmp_path / "ix.wdsidx"))
    proxy.reset_counters()
    return proxy, index


def blocks_of(index: Any, shards: Any) -> int:
    return sum(-(-index.shards[s].size // BLOCK) for s in shards)


def expected_gets(ds: BucketedWebDataset, workers: int = 1) -> tuple[int, int]:
    """(block GETs, single GETs) the plan says a stream makes: every shard a worker's
    schedule lists once in blocks (once per rank), every other range singly."""
    shards: set[str] = set()
    single = 0
    for w in range(workers):
        src = PlannedSource(ds.spec, worker=(w, workers))
        sched = next(shard_schedule(src))
        shards |= {p.url for p in sched}
        entries = sum(int(src.spec.plan(0)[j].samples.size) for _, j in src.batches())
        single += entries - sum(p.uses for p in sched)
    size = {s.url: s.size for s in ds.spec.indexes[0].shards}
    return sum(-(-size[u] // BLOCK) for u in shards), single


def dataset(index: Any, dp: int = 2, rank: int = 0, **kw: Any) -> BucketedWebDataset:
    opts = kw.pop("read_options", ReadOptions(block_bytes=BLOCK, max_in_flight=8))
    return BucketedWebDataset(index, batch_size=4, topology=Topology(dp, rank), seed=5, locality="shard",
                              window=kw.pop("window", 2), read_options=opts, check_agreement=False, **kw)


def test_each_own_shard_is_fetched_once_in_blocks_and_foreign_samples_singly(
        proxied: tuple[Any, Any], reference: dict[str, Any]) -> None:
    proxy, index = proxied
    ds = dataset(index)
    batches = list(ds)
    plan = ds.plan(0)
    assert batch_keys(batches) == plan_keys(plan, index)
    assert_same_bytes(batches, reference)
    import numpy as np
    own = plan.buckets.local.rank_shards(0)
    foreign = int((~np.isin(index.shard[plan.samples], own)).sum())
    blocks, single = expected_gets(ds)
    assert proxy.requests_seen == blocks + single == ds.read_stats.requests
    assert ds.read_stats.shard_blocks == blocks <= blocks_of(index, own)
    assert foreign <= single
    # against one GET per sample with locality="none"
    proxy.reset_counters()
    none = BucketedWebDataset(index, batch_size=4, topology=Topology(2, 0), seed=5, check_agreement=False,
                              read_options=ReadOptions(block_bytes=BLOCK))
    list(none)
    assert proxy.requests_seen == int(none.plan(0).samples.size) > 2 * ds.read_stats.requests


def test_shards_are_fetched_ahead_within_cache_bytes_and_dropped_after_their_last_use() -> None:
    """The cache alone, with a counting fetch: blocks, the bound, and optimal eviction."""
    import concurrent.futures

    data = {f"s{i}": bytes([i]) * 100 for i in range(4)}
    calls: list[tuple[str, int, int]] = []

    def fetch(url: str, start: int, length: int) -> concurrent.futures.Future[bytes]:
        calls.append((url, start, length))
        f: concurrent.futures.Future[bytes] = concurrent.futures.Future()
        f.set_result(data[url][start:start + length])
        return f

    order = [PlannedShard(u, 100, 2, frozenset({0}), "k") for u in data]
    cache = ShardCache(fetch, iter([order]), block_bytes=40, cache_bytes=250)
    assert cache.planned("s0")
    assert cache.read("s0", 30, 20).result() == data["s0"][30:50]  # across a block boundary
    # s0 and s1 fit the 250 bytes, s2 would not: fetched ahead only after s0 is dropped
    assert {c[0] for c in calls} == {"s0", "s1"} and [c[1:] for c in calls[:3]] == [(0, 40), (40, 40), (80, 20)]
    assert cache.read("s0", 0, 10).result() == data["s0"][:10]  # its last use: dropped
    assert not cache.planned("s0")
    assert cache.read("s1", 5, 5).result() == data["s1"][5:10]
    assert {c[0] for c in calls} == {"s0", "s1", "s2"}
    for u in ("s1", "s2", "s2", "s3", "s3"):
        if u != "s1" or cache.planned(u):
            cache.read(u, 0, 1).result()
    assert cache.peak_bytes <= 250 + 100 and cache.fetched_shards == 4
    assert len(calls) == 4 * 3  # every shard once, in blocks of 40


def test_resume_mid_window_in_a_fresh_reader_fetches_no_finished_shard(proxied: tuple[Any, Any]) -> None:
    """Resumed past some windows, a new stream fetches whole only the shards still ahead
    (its schedule from the restored position): none it had finished, nothing replayed."""
    proxy, index = proxied
    ds = dataset(index, window=1)
    plan = ds.plan(0)
    k = 2 * len(plan) // 3
    it = iter(ds)
    for _ in range(k):
        next(it)
    state = ds.state_dict()
    it.close()
    full = {p.url for p in next(shard_schedule(PlannedSource(ds.spec, worker=(0, 1))))}
    ahead = next(shard_schedule(PlannedSource(ds.spec, Position(0, k), worker=(0, 1))))
    assert {p.url for p in ahead} < full  # finished shards are not listed
    proxy.reset_counters()
    fresh = dataset(index, window=1)
    fresh.load_state_dict(state)
    rest = list(fresh)
    assert batch_keys(rest) == plan_keys([plan[j] for j in range(k, len(plan))], index)
    size = {s.url: s.size for s in index.shards}
    assert fresh.read_stats.shard_blocks == sum(-(-size[p.url] // BLOCK) for p in ahead)
    fetched_whole = {r.target.rsplit("/", 1)[-1] for r in proxy.requests
                     if dict(r.headers).get("Range", dict(r.headers).get("range", "")).startswith("bytes=0-")}
    assert not fetched_whole & {u.rsplit("/", 1)[-1] for u in full - {p.url for p in ahead}}


@pytest.mark.parametrize("shared", ["cache_dir", "default"])
def test_two_workers_share_the_rank_s_shards_through_the_node_folder(proxied: tuple[Any, Any], tmp_path: Path,
                                                                     reference: dict[str, Any], shared: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers share whole shards through the node's folder (cache_dir, or by default one in
    the temporary directory named after the job): each shard the rank holds is fetched once,
    every read of it comes from that copy, and what stays after the epoch is what the rank
    holds again in the next one."""
    from wds_pad.io.nodefolder import default_folder
    from wds_pad.stream.wholeshards import node_schedule

    proxy, index = proxied
    folder = tmp_path / "cache" if shared == "cache_dir" else None
    if folder is None:  # a job of its own: this process's default folder may hold other tests' shards
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"shardcache-{tmp_path.name}")
    ds = dataset(index, read_options=ReadOptions(block_bytes=BLOCK, cache_dir=folder and str(folder)))
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    batches = list(loader)
    plan = ds.plan(0)
    assert batch_keys(batches) == plan_keys(plan, index)
    assert_same_bytes(batches, reference)
    node = next(node_schedule(PlannedSource(ds.spec, worker=(0, 2))))
    held = [s for s in node.shards.values() if s.held]
    urls = list(index.urls)
    single = sum(int((index.shard[plan.samples] == urls.index(s.url)).sum()) for s in node.shards.values()
                 if not s.held)  # reads of shards the node does not hold: one GET each
    assert proxy.requests_seen == sum(-(-s.size // BLOCK) for s in held) + single  # each held shard once
    left = Path(folder if folder is not None else default_folder())
    names = {p.name for p in left.iterdir() if p.suffix in (".shard", ".part", ".done", ".tmp")}
    assert names == {s.name + ".shard" for s in held if s.name in node.later}
    if folder is None:
        shutil.rmtree(left)  # no process of this job is left to remove it


@pytest.mark.parametrize("workers", [0, 2])
def test_cached_shard_bytes_are_sliced_through_the_member_table_no_header_parsed(
        proxied: tuple[Any, Any], reference: dict[str, Any], shard_dir: Path, monkeypatch: pytest.MonkeyPatch,
        workers: int) -> None:
    """The shards are written as webdataset's TarWriter writes them (a PAX header per
    member): every sample is sliced out of the cached shard bytes where the member table
    says, in the main process and in forked DataLoader workers (which inherit the patch)."""
    from wds_pad.stream import fetch as fetch_mod

    proxy, index = proxied
    assert index.members_missing()[0] == 0
    with open(shard_dir / "train-000000.tar", "rb") as f:
        assert f.read(512)[156:157] == b"x"  # a PAX extended header first: a real producer's shard

    def no_parse(*args: Any, **kw: Any) -> Any:
        raise AssertionError("a tar header was parsed on the member-table path")

    monkeypatch.setattr(fetch_mod, "parse_sample", no_parse)
    monkeypatch.setattr(fetch_mod, "parse_sample_at", no_parse)
    ds = dataset(index)
    batches = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)) if workers else list(ds)
    assert batch_keys(batches) == plan_keys(ds.plan(0), index)
    assert_same_bytes(batches, reference)
    if not workers:
        assert ds.read_stats.exact_samples == ds.read_stats.exact_batches == 0


def test_s3_streams_whole_shards(moto_server: MotoServer, shard_dir: Path, reference: dict[str, Any]) -> None:
    bucket = upload_files(moto_server, "wds-pad-shardcache", [shard_dir / f"train-{i:06d}.tar" for i in range(SHARDS)])
    index = build_index(f"s3://{bucket}/train-{{000000..{SHARDS - 1:06d}}}.tar", BUCKET_BY,
                        storage_options=moto_server.storage_options)
    ds = dataset(index, read_options=ReadOptions(block_bytes=BLOCK, storage_options=moto_server.storage_options))
    batches = list(ds)
    assert batch_keys(batches) == plan_keys(ds.plan(0), index)
    assert_same_bytes(batches, reference)
    assert ds.read_stats.shard_blocks == expected_gets(ds)[0] > 0


def test_a_state_of_one_locality_is_refused_by_the_other(proxied: tuple[Any, Any]) -> None:
    _, index = proxied
    shard = dataset(index)
    none = BucketedWebDataset(index, batch_size=4, topology=Topology(2, 0), seed=5, check_agreement=False)
    with pytest.raises(StateMismatchError, match="plan.locality"):
        none.load_state_dict(shard.state_dict())
    with pytest.raises(StateMismatchError, match="plan.window"):
        dataset(index).load_state_dict(BucketedWebDataset(
            index, batch_size=4, topology=Topology(2, 0), seed=5, locality="shard", window=3,
            check_agreement=False).state_dict())



def test_a_state_of_the_earlier_shard_order_is_refused_naming_the_field(proxied: tuple[Any, Any]) -> None:
    """States saved before a rank's windows became first in, first out (no ``shard_order``
    in the plan fields) would resume into another order: refused, naming the field."""
    import copy

    from wds_pad.state.schema import fingerprint_of

    _, index = proxied
    old = copy.deepcopy(dataset(index).state_dict())
    for st in [old, *old["per_rank"].values()]:
        del st["plan"]["shard_order"]
        st["fingerprint"] = fingerprint_of(st["plan"])
    with pytest.raises(StateMismatchError, match="plan.shard_order"):
        dataset(index).load_state_dict(old)

def _counting_fetch(data: dict[str, bytes], calls: list[tuple[str, int, int]]) -> Any:
    import concurrent.futures

    def fetch(url: str, start: int, length: int) -> concurrent.futures.Future[bytes]:
        calls.append((url, start, length))
        f: concurrent.futures.Future[bytes] = concurrent.futures.Future()
        f.set_result(data[url][start:start + length])
        return f
    return fetch


def test_a_shard_is_kept_as_its_planned_ranges_each_freed_after_its_last_read() -> None:
    """Memory mode: from its first read a shard counts (and is held) as the bytes of its
    planned ranges only, its blocks dropped; each range is freed after its last planned
    read, and the room goes at once to the shards fetched next. Reads cost no GET beyond
    the blocks; a read the schedule did not foresee costs one ranged GET, never wrong bytes."""
    data = {"s0": bytes(range(100)), "s1": bytes(range(100, 200))}
    calls: list[tuple[str, int, int]] = []
    ranges = ((0, 40), (30, 20), (10, 5), (60, 10), (10, 5))  # (10, 5) twice: kept once
    order = [PlannedShard("s0", 100, 5, frozenset({0}), "k", ranges=ranges),
             PlannedShard("s1", 100, 1, frozenset({0}), "k", ranges=((0, 100),))]
    cache = ShardCache(_counting_fetch(data, calls), iter([order]), block_bytes=40, cache_bytes=150)
    assert cache.planned("s0")
    assert cache.read("s0", 0, 40).result() == data["s0"][:40]
    # s0 now counts as its remaining ranges (35 bytes): s1 (100) fits the 150 and is fetched ahead
    assert [c[0] for c in calls] == ["s0"] * 3 + ["s1"] * 3 and cache.compacted == 1
    for st, n in ranges[1:]:
        assert cache.planned("s0")
        assert cache.read("s0", st, n).result() == data["s0"][st:st + n]
    assert not cache.planned("s0")  # all five served, nothing of it held
    assert len(calls) == 6  # no GET beyond the blocks
    assert cache.read("s1", 0, 100).result() == data["s1"]
    assert cache.peak_bytes <= 150 + 100


def test_a_range_the_schedule_did_not_plan_is_one_ranged_get() -> None:
    data = {"s0": bytes(range(100))}
    calls: list[tuple[str, int, int]] = []
    order = [PlannedShard("s0", 100, 2, frozenset({0}), "k", ranges=((0, 1), (10, 5)))]
    cache = ShardCache(_counting_fetch(data, calls), iter([order]), block_bytes=100, cache_bytes=1000)
    cache.read("s0", 0, 1).result()
    assert cache.read("s0", 20, 3).result() == data["s0"][20:23]
    assert calls[-1] == ("s0", 20, 3)


def test_early_ranges_are_read_singly_while_the_cache_is_full() -> None:
    """A range before its shard's window (``early``) fetches the shard early only while it
    fits ``max_shards`` x the largest shard plus the one in use; otherwise it is one GET
    and the shard is fetched when its window comes."""
    data = {u: bytes([i]) * 100 for i, u in enumerate(("a", "b", "c"))}
    calls: list[tuple[str, int, int]] = []
    order = [PlannedShard("a", 100, 2, frozenset({0}), "k"),
             PlannedShard("b", 100, 2, frozenset({0}), "k"),
             PlannedShard("c", 100, 3, frozenset({0}), "k", early=1)]
    cache = ShardCache(_counting_fetch(data, calls), iter([order]), block_bytes=100,
                       cache_bytes=10**6, max_shards=1)
    for u in ("a", "b"):
        assert cache.planned(u)
        cache.read(u, 0, 1).result()
    assert not cache.planned("c")  # a and b held: c would pass 1 x 100 + the one in use
    assert cache.early_singles == 1
    for u in ("a", "b", "c", "c"):
        assert cache.planned(u)
        cache.read(u, 0, 1).result()
    assert [c[0] for c in calls] == ["a", "b", "c"]  # c whole once, after its early range
    assert not cache.planned("c")


@pytest.mark.parametrize("old,new", [(4, 2), (2, 3)])
def test_an_elastic_resume_reads_about_one_fetch_per_shard_still_needed(
        proxied: tuple[Any, Any], reference: dict[str, Any], old: int, new: int) -> None:
    """GETs before (the rest of the epoch on the saved layout) and after (resumed on
    another layout): the remainder is dealt by old ranks' shards, so the new ranks fetch
    the shards still needed whole, each about once, and few samples singly."""
    import numpy as np

    proxy, index = proxied
    whole = 1 << 20  # a shard is one GET (the test counts shard fetches and single reads, not blocks)

    def whole_shards(index: Any, dp: int, rank: int) -> BucketedWebDataset:
        return dataset(index, dp=dp, rank=rank, read_options=ReadOptions(block_bytes=whole, max_in_flight=8))

    olds = [whole_shards(index, dp=old, rank=r) for r in range(old)]
    k = len(olds[0].plan(0)) // 2
    states, rest_keys = [], []
    for ds in olds:
        plan = ds.plan(0)
        states.append(ds.state_dict() | {"index": k})  # the position after k batches (lockstep)
        rest_keys += [index.key(int(i)) for j in range(k, len(plan)) for i, p in
                      zip(plan[j].samples, plan[j].pad) if not p]
    before = 0
    for r, st in enumerate(states):  # the rest of the epoch on the saved layout
        proxy.reset_counters()
        again = whole_shards(index, dp=old, rank=r)
        again.load_state_dict(st)
        list(again)
        before += proxy.requests_seen
    needed = {int(index.shard[i]) for r in range(old) for j in range(k, len(olds[r].plan(0)))
              for i in olds[r].plan(0)[j].samples}
    after = blocks = single = 0
    got: list[str] = []
    for r in range(new):
        proxy.reset_counters()
        ds = whole_shards(index, dp=new, rank=r)
        ds.load_state_dict(states[r * old // new], allow_elastic=True)
        batches = list(ds)
        assert_same_bytes(batches, reference)
        got += [s["__key__"] for b in batches for s in b if not s["__pad__"]]
        after += proxy.requests_seen
        src = PlannedSource(ds.spec, ds.cursor.at(0, 0), (0, 1))  # the epoch's elastic view
        sched = next(shard_schedule(src))
        entries = int(ds.cursor.view.plan.samples.size)
        blocks += sum(-(-p.size // whole) for p in sched)
        single += entries - sum(p.uses for p in sched)
        assert proxy.requests_seen == ds.read_stats.requests
    assert sorted(got) == sorted(rest_keys)  # every sample not yet trained, once
    assert after == blocks + single
    # each shard still needed is fetched whole about once: twice where a new rank's share
    # of a bucket starts inside an old rank's window
    assert blocks <= 2 * len(needed)
    samples = len(rest_keys)
    assert single <= max(2, samples // 20)  # padded copies and the odd sample: single GETs
    assert after <= 1.5 * before
    assert after < samples  # locality="none": one GET per sample
    print(f"elastic {old}->{new}: GETs before {before}, after {after} (blocks {blocks}, single {single}); "
          f"shards still needed {len(needed)}; samples left {samples}")


def test_an_elastic_resume_through_a_cache_dir_reads_the_rest_once_with_no_more_gets_than_in_memory(
        proxied: tuple[Any, Any], reference: dict[str, Any], tmp_path: Path) -> None:
    """The node cache follows an epoch resumed on another layout (its elastic view): every
    sample not yet trained on, once, byte for byte, and no more GETs than the memory cache
    makes for the same view (its skipped reads come from the copy)."""
    proxy, index = proxied
    whole = 1 << 20
    olds = [dataset(index, dp=4, rank=r, read_options=ReadOptions(block_bytes=whole)) for r in range(4)]
    k = len(olds[0].plan(0)) // 2
    states = [ds.state_dict() | {"index": k} for ds in olds]
    rest = sorted(index.key(int(i)) for ds in olds for j in range(k, len(ds.plan(0)))
                  for i, p in zip(ds.plan(0)[j].samples, ds.plan(0)[j].pad) if not p)
    got: list[str] = []
    gets = {}
    for mode in ("memory", "cache_dir"):
        proxy.reset_counters()
        for r in range(2):
            folder = str(tmp_path / "cache") if mode == "cache_dir" else None
            ds = dataset(index, dp=2, rank=r, read_options=ReadOptions(block_bytes=whole, cache_dir=folder))
            ds.load_state_dict(states[r * 2], allow_elastic=True)
            batches = list(ds)
            assert_same_bytes(batches, reference)
            if mode == "cache_dir":
                got += [s["__key__"] for b in batches for s in b if not s["__pad__"]]
        gets[mode] = proxy.requests_seen
    assert sorted(got) == rest
    assert gets["cache_dir"] <= gets["memory"]


@pytest.mark.parametrize("zero_copy", [False, True])
def test_remote_batches_cross_from_workers_packed_in_shared_memory(proxied: tuple[Any, Any], tmp_path: Path,
                                                                   reference: dict[str, Any], zero_copy: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Through Loader's workers, batches of remote shards read whole (here through the
    node folder) arrive as packed batches, their members copied once into the worker's
    ring (stream/transport.py), never pickled; they equal the batches of one process, as
    bytes or as read-only views."""
    from wds_pad.stream import transport
    from wds_pad.stream.loader import Loader

    _, index = proxied
    kinds: list[str] = []
    real = transport.unpack

    def spy(batch: Any, *args: Any) -> Any:
        kinds.append(type(batch).__name__)
        return real(batch, *args)

    monkeypatch.setattr(transport, "unpack", spy)
    opts = ReadOptions(block_bytes=BLOCK, max_in_flight=8, cache_dir=str(tmp_path / "cache"))
    want = list(Loader(dataset(index, read_options=opts), num_workers=0))
    got = list(Loader(dataset(index, read_options=opts, zero_copy=zero_copy), num_workers=2))
    assert kinds and set(kinds) == {"PackedBatch"}
    members = [v for b in got for s in b for k, v in s.items() if not k.startswith("__")]
    assert members and all(type(m) is (memoryview if zero_copy else bytes) for m in members)
    assert [[{k: bytes(v) if isinstance(v, memoryview) else v for k, v in s.items()} for s in b] for b in got] == want
    assert [list(s) for b in got for s in b] == [list(s) for b in want for s in b]  # the same keys in the same order
    assert_same_bytes(want, reference)
