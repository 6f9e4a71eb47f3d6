"""Tests of where data time goes: StreamStats of a dataset and a Loader, the cross-rank
StallReport, its adapters and picture.

Counts are checked against a real loopback HTTP server seen through the fault proxy
(its request log is the oracle for GETs and bytes); the slow rank is named in a real
two-process gloo job. No absolute time is asserted: only sums of one run's own timings
and which rank or shard a large injected slowdown makes the slowest.
"""

from __future__ import annotations

import logging
import pickle
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from faultproxy import FaultProxy, StallMode
from gloo_jobs import run_gloo_job
from data_helpers import BUCKET_BY, make_dataset
from wds_pad import Loader, StallReport, StreamStats, build_index, stall_report
from wds_pad.cli.synth import make_image_shards
from wds_pad.io.options import ReadOptions, ReadStats
from wds_pad.stream.stallreport import log_report, tensorboard_report
from wds_pad.stream.stats import Clock
from wds_pad.stream.transport import PackedRun

pytest_plugins = ["conftest_servers"]

SHARDS = 8


@pytest.fixture(scope="module")
def served(nginx_server: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """Eight small image shards under the HTTP server (``stats/train-00000K.tar``); the
    server and a local copy's folder."""
    out = tmp_path_factory.mktemp("stats-shards")
    paths = make_image_shards(out / "gen", samples=64, shards=SHARDS, seed=3)
    dest = nginx_server.root_dir / "stats"
    dest.mkdir(exist_ok=True)
    for i, p in enumerate(paths):
        shutil.copy(p, dest / f"train-{i:06d}.tar")
        shutil.copy(p, out / f"train-{i:06d}.tar")
    return nginx_server, out


def _proxied_index(served: tuple[Any, Path], proxy: FaultProxy, tmp_path: Path) -> str:
    path = str(tmp_path / "i.wdsidx")
    build_index(f"{proxy.url}/stats/train-{{000000..{SHARDS - 1:06d}}}.tar", BUCKET_BY, output=path)
    proxy.reset_counters()
    return path


def _server_gets(proxy: FaultProxy) -> tuple[int, int]:
    """GETs the proxy saw, and the bytes their Range headers asked for."""
    gets = [r for r in proxy.requests if r.method == "GET"]
    asked = 0
    for r in gets:
        lo, hi = r.header("Range", "").split("=", 1)[1].split("-")
        asked += int(hi) - int(lo) + 1
    return len(gets), asked


@pytest.mark.parametrize("num_workers", [None, 0, 2])
def test_counts_equal_the_servers_and_stages_add_up(served: tuple[Any, Path], fault_proxy: Any, tmp_path: Path,
                                                     num_workers: int | None) -> None:
    proxy: FaultProxy = fault_proxy(served[0], latency_ms=20)
    index = _proxied_index(served, proxy, tmp_path)
    ds = make_dataset(index, seed=1, quiet=True)
    assert ds.stats() == StreamStats()  # nothing before the first batch
    source = ds if num_workers is None else Loader(ds, num_workers=num_workers)
    n = sum(1 for _ in source)
    st = source.stats()
    assert st.batches == n == len(ds)
    assert (st.gets, st.bytes_read) == _server_gets(proxy)  # the workers' counts summed, none lost
    assert st.gets >= SHARDS and st.get_s > 0 and st.cache_wait_s == 0
    assert st.slowest_shard.startswith(f"{proxy.url}/stats/train-") and st.slowest_shard_s > 0
    assert st.as_dict()["wait_s"] == st.wait_s and set(st.stages) == {
        "get_s", "cache_wait_s", "tar_s", "collate_s", "transport_s"}
    assert st.tar_s > 0
    # the default collation only lists the samples: not timed in one process; unpacking is
    assert (st.collate_s > 0) == bool(num_workers)
    if num_workers:
        assert st.transport_s > 0  # the main process waited on its workers
    else:  # one process: the stages split the time the loop waited
        assert st.transport_s == 0
        assert sum(st.stages.values()) == pytest.approx(st.wait_s, rel=0.05)
    again = sum(1 for _ in source)  # a second epoch adds to the first
    assert source.stats().batches == n + again and source.stats().gets > st.gets


def _keys(samples: list[dict[str, Any]]) -> list[str]:
    """A collation of one's own: more than a list of the samples."""
    return [s["__key__"] for s in samples]


@pytest.mark.parametrize("num_workers", [None, 2])
def test_a_collation_of_ones_own_is_timed_and_the_stages_still_add_up(served: tuple[Any, Path], tmp_path: Path,
                                                                       num_workers: int | None) -> None:
    index = str(tmp_path / "local.wdsidx")
    build_index(str(served[1] / f"train-{{000000..{SHARDS - 1:06d}}}.tar"), BUCKET_BY, output=index)
    ds = make_dataset(index, seed=1, quiet=True, collation_fn=_keys)
    source = ds if num_workers is None else Loader(ds, num_workers=num_workers)
    n = sum(1 for _ in source)
    st = source.stats()
    assert st.batches == n > 0 and st.collate_s > 0 and st.tar_s > 0 and st.gets == 0
    if num_workers is None:
        assert sum(st.stages.values()) == pytest.approx(st.wait_s, rel=0.05)


def test_worker_notes_carry_only_the_shard_waits_that_changed_and_sum_exactly() -> None:
    worker, main = Clock(), Clock()
    reader = ReadStats()
    worker.start_reader(reader)

    def waits(*pairs: tuple[str, int]) -> None:  # what the reader records per request it waited on
        for url, ns in pairs:
            reader.get_wait_ns += ns
            reader.wait_ns_by_url[url] = reader.wait_ns_by_url.get(url, 0) + ns
            reader.waited_urls.add(url)

    def messages() -> Iterator[PackedRun]:
        waits(("a", 5), ("b", 7))
        yield PackedRun([1, 2])
        yield PackedRun([3])  # no wait in between: nothing to send
        waits(("a", 1))
        yield PackedRun([4])

    notes = []
    for run in worker.noted(messages()):
        notes.append(run[-1])
        sent = pickle.loads(pickle.dumps(run))  # as DataLoader sends it
        for item in main.received(iter([sent])):
            assert isinstance(item, PackedRun) and item == run[:-1]  # the note taken off
    assert [note[2] for note in notes] == [{"a": 5, "b": 7}, {}, {"a": 6}]
    st = main.stats(rank=3)  # b's wait came in the first note only, and is still the longest
    assert (st.rank, st.slowest_shard, st.slowest_shard_s) == (3, "b", pytest.approx(7e-9))
    assert st.get_s == pytest.approx(13e-9)
    main.end_workers()  # the iteration ended: the notes are folded in, nothing counted twice
    assert main.stats(rank=3) == st


def test_a_stalled_shard_is_named(served: tuple[Any, Path], fault_proxy: Any, tmp_path: Path) -> None:
    proxy: FaultProxy = fault_proxy(served[0])
    index = _proxied_index(served, proxy, tmp_path)
    stalled = proxy.stall_next(1, StallMode.REQUEST,
                               match=lambda r: r.method == "GET" and "train-000005" in r.target)
    ds = make_dataset(index, seed=1, quiet=True, read_options=ReadOptions(timeout=1.0, backoff=0.01))
    batches = sum(1 for _ in ds)
    st = ds.stats()
    assert st.slowest_shard == f"{proxy.url}/stats/train-000005.tar"  # waited past the 1 s timeout
    assert stalled.remaining == 0
    gets = [r for r in proxy.requests if r.method == "GET"]
    first = next(i for i, r in enumerate(gets) if "train-000005" in r.target)
    answered = gets[:first] + gets[first + 1:]
    asked = sum(int(hi) - int(lo) + 1 for lo, hi in (r.header("Range").split("=")[1].split("-") for r in answered))
    assert (st.gets, st.bytes_read) == (len(gets), asked)  # the stalled attempt is a GET, without bytes
    report = StallReport.of((st, StreamStats(rank=1, wait_s=st.wait_s / 10, batches=batches)), batches)
    assert report.slowest == 0 and report.cause == "get_s" and report.shard == st.slowest_shard
    assert report.text.startswith("rank 0 waits ") and "on GETs to " in report.text
    assert "train-000005.tar" in report.text


def _stats(rank: int, wait: float, **stages: float) -> StreamStats:
    return StreamStats(rank=rank, wait_s=wait, batches=10, **stages)


def test_the_report_names_the_slowest_rank_against_the_median_and_its_stage() -> None:
    ranks = tuple(_stats(r, 1.0, get_s=0.5, tar_s=0.5) for r in range(4))
    slow = _stats(2, 10.0, get_s=0.5, tar_s=9.5)
    report = StallReport.of(ranks[:2] + (slow,) + ranks[3:], 40)
    assert (report.slowest, report.cause, report.shard) == (2, "tar_s", "")
    assert report.ratio == pytest.approx(10.0)
    assert report.text == "rank 2 waits 10.0x the median (10 s vs 1 s over 4 ranks), on tar/member work"
    even = StallReport.of(tuple(_stats(r, 0.0) for r in range(3)), 0)
    assert even.ratio == 1.0  # nobody waited
    # with workers, the main process's transport wait mirrors the workers' GETs: GETs are named
    workers = (_stats(0, 1.0, transport_s=1.0, get_s=1.0),
               StreamStats(rank=1, wait_s=9.0, transport_s=9.0, get_s=20.0, slowest_shard="s3://b/x.tar",
                           slowest_shard_s=15.0))
    named = StallReport.of(workers, 5)
    assert (named.slowest, named.cause, named.shard) == (1, "get_s", "s3://b/x.tar")
    assert named.text.endswith("on GETs to s3://b/x.tar (15 s)")


class _Writer:
    """Stands in for torch.utils.tensorboard's SummaryWriter (tensorboard is not a dependency)."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))


def test_the_adapters_write_what_they_promise(caplog: pytest.LogCaptureFixture) -> None:
    report = StallReport.of((_stats(0, 1.0, get_s=1.0), _stats(1, 4.0, get_s=4.0)), 7)
    writer = _Writer()
    tensorboard_report(report, writer)
    tags = {t: (v, s) for t, v, s in writer.scalars}
    assert tags["data/wait_s/rank0"] == (1.0, 7) and tags["data/wait_s/rank1"] == (4.0, 7)
    assert tags["data/get_s/rank1"] == (4.0, 7) and tags["data/slowest_rank"] == (1, 7)
    assert tags["data/wait_over_median"] == (pytest.approx(1.6), 7)
    assert {s for _, _, s in writer.scalars} == {7}
    log = logging.getLogger("wds_pad.test.stalls")
    with caplog.at_level(logging.INFO, logger=log.name):
        log_report(report, log)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == f"data stalls at step 7: {report.text}"
    assert lines[1].startswith("  rank 0: wait 1 s, 0 GETs") and lines[2].startswith("  rank 1: wait 4 s")
    assert "get 4 s" in lines[2]


def test_the_reporter_reports_every_n_batches_and_draws_the_waits(served: tuple[Any, Path], tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    local = served[1]
    index = str(tmp_path / "local.wdsidx")
    build_index(str(local / f"train-{{000000..{SHARDS - 1:06d}}}.tar"), BUCKET_BY, output=index)
    ds = make_dataset(index, seed=1, quiet=True)
    writer = _Writer()
    with pytest.raises(Exception, match="every"):
        stall_report(ds, every=0)
    reporter = stall_report(Loader(ds), every=5, writer=writer, log=logging.getLogger("wds_pad.test.stalls"))
    with caplog.at_level(logging.INFO, logger="wds_pad.test.stalls"):
        n = sum(1 for _ in reporter)
    steps = [r.step for r in reporter.reports]
    assert steps == list(range(5, n + 1, 5)) + ([n] if n % 5 else [])
    assert sum(r.ranks[0].batches for r in reporter.reports) == n  # each report covers its interval
    assert all(len(r.ranks) == 1 and r.slowest == 0 for r in reporter.reports)
    assert sum(1 for r in caplog.records if r.getMessage().startswith("data stalls at step")) == len(steps)
    assert sorted({s for t, _, s in writer.scalars if t == "data/wait_s/rank0"}) == steps
    png = reporter.plot(str(tmp_path / "waits"))
    assert png.endswith("waits.png") and Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


_SLOW_JOB = r"""
import datetime, json, sys, time
import torch.distributed as dist
from wds_pad import BucketedWebDataset, Loader, stall_report

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
index, workers, rank = sys.argv[1], int(sys.argv[2]), dist.get_rank()
SLOW = 1

def slow(sample):  # the injected slowdown: a stage of this rank only, about 10x a batch's reading
    if rank == SLOW:
        time.sleep(0.01)
    return sample

ds = BucketedWebDataset(index, batch_size=4, seed=7).map(slow)
reporter = stall_report(Loader(ds, num_workers=workers))
trials = []
for epoch in range(3):
    reporter.source.set_epoch(epoch)
    for _ in reporter:
        pass
    r = reporter.reports[-1]
    trials.append({"slowest": r.slowest, "cause": r.cause, "ratio": r.ratio, "text": r.text,
                   "ranks": [s.rank for s in r.ranks], "batches": [s.batches for s in r.ranks]})
dist.destroy_process_group()
print(json.dumps(trials))
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_a_slow_rank_is_named_in_every_trial_on_gloo(served: tuple[Any, Path], tmp_path: Path,
                                                     workers: int) -> None:
    index = str(tmp_path / "local.wdsidx")
    build_index(str(served[1] / f"train-{{000000..{SHARDS - 1:06d}}}.tar"), BUCKET_BY, output=index)
    results = run_gloo_job(tmp_path, _SLOW_JOB, 2, args=(index, str(workers)), timeout=240)
    assert len(results) == 2
    for trials in results:
        assert len(trials) == 3
        for t in trials:
            assert t["ranks"] == [0, 1] and t["batches"][0] == t["batches"][1] > 0
            assert t["slowest"] == 1 and t["cause"] == "tar_s", t["text"]
            assert t["ratio"] > 1.0 and t["text"].startswith("rank 1 waits "), t["text"]
    assert results[0] == results[1]  # every rank got the same report


_SLOW_SHARDS_JOB = r"""
import datetime, json, sys
import torch.distributed as dist
from wds_pad import BucketedWebDataset, Loader, stall_report

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
rank = dist.get_rank()
# the same shards and rows; rank 1 reads them through a proxy that adds latency to every GET
index = sys.argv[2] if rank == 1 else sys.argv[1]
ds = BucketedWebDataset(index, batch_size=4, seed=7, check_agreement=False)
reporter = stall_report(Loader(ds, num_workers=int(sys.argv[3])))
for _ in reporter:
    pass
r = reporter.reports[-1]
dist.destroy_process_group()
print(json.dumps({"slowest": r.slowest, "cause": r.cause, "shard": r.shard, "text": r.text,
                  "gets": [s.gets for s in r.ranks]}))
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_a_rank_with_slow_shards_is_named_with_its_shard_on_gloo(served: tuple[Any, Path], fault_proxy: Any,
                                                                tmp_path: Path, workers: int) -> None:
    server = served[0]
    direct = str(tmp_path / "direct.wdsidx")
    build_index(f"{server.url}/stats/train-{{000000..{SHARDS - 1:06d}}}.tar", BUCKET_BY, output=direct)
    proxy: FaultProxy = fault_proxy(server)
    slow = _proxied_index(served, proxy, tmp_path)
    proxy.set_latency(400)  # a large slowdown: seconds of GET wait against tenths of a second
    results = run_gloo_job(tmp_path, _SLOW_SHARDS_JOB, 2, args=(direct, slow, str(workers)), timeout=240)
    for r in results:
        assert r["slowest"] == 1 and r["cause"] == "get_s", r["text"]
        assert r["shard"].startswith(f"{proxy.url}/stats/train-") and r["shard"] in r["text"], r["text"]
        assert r["gets"][0] > 0 and r["gets"][1] > 0
    assert results[0] == results[1]
