"""Benchmark: planned (random-order) streaming vs webdataset's sequential read and litData, in one run.

Generates local shards with ``make_blob_shards`` (small ~10 KB samples: 32 shards, batch
64; large ~500 KB samples: 8 shards, batch 8), written by ``--producer`` (default ``webdataset``: what
``wds.TarWriter`` writes, a pax header before every member, as most real shards are)
and, beside them, by ``--also-producer`` (default ``tarfile-ustar``: plain ustar
headers; ``none`` skips it). It indexes them with aspect buckets, warms the page cache,
then times every contender in turn (round robin, best of ``--repeat``), the contenders of
both shard kinds in the same round robin:

* ``wds_pad direct``  ``BucketedWebDataset`` iterated in the main process (no decode):
  the plan's random order through the index's member table, one ``os.pread`` per sample
  (per payload for large samples) the first time the process streams a shard, then a
  copy out of the shard's kept mapping (``wds_pad.io.shardmaps``: the best of
  ``--repeat`` runs is a later epoch's), a webdataset sample dict each; ``wds_pad direct,
  os.pread`` the same with ``ReadOptions(map_local=False)``: every epoch as the first;
* ``wds_pad batch 1``  the same with ``batch_size=1``: one sample per batch;
* ``wds_pad exact path``  the same batches with the member table ignored: every sample's
  tar headers parsed again (the path of indexes without a member table, and what every
  sample took before it);
* ``wds_pad Loader(2)``  the same through ``Loader(ds, num_workers=2)`` (each batch crosses
  from its worker as one buffer in shared memory, rebuilt into sample dicts here);
  ``wds_pad Loader(2), batch 1`` the same with ``batch_size=1``;
* ``wds_pad direct, zero_copy`` / ``wds_pad Loader(2), zero_copy``  the same with
  ``zero_copy=True``: members are read-only memoryviews over the batch's buffer;
* ``wds_pad Loader(2), persistent`` (and ``, zero_copy``)  one ``Loader(ds, num_workers=2,
  persistent_workers=True)`` iterated once per timed run, as a training loop iterates its
  loader every epoch: its workers start in its first run and serve the later ones (which
  read out of their kept mappings); their CPU is read from /proc while they live;
* ``wds_pad stages, checked`` / ``unchecked``  the raw stages ``PlannedSource -> fetch ->
  plan_batched`` with and without the indexes handed to ``fetch`` (the shard check);
* ``webdataset``  ``wds.WebDataset(urls, shardshuffle=False)`` iterating every sample of
  the same shards sequentially (no decode); ``webdataset WebLoader(2)`` the same batched
  by 64 through ``wds.WebLoader(num_workers=2)``;
* ``litdata ...`` (``--peer litdata``)  the same samples converted once with
  ``litdata.optimize`` (timed, printed), streamed by ``litdata.StreamingDataset`` with
  shuffle off and on, in one process and through ``StreamingDataLoader(num_workers=2)``,
  and in order through one ``StreamingDataLoader(num_workers=2, persistent_workers=True)``;
* ``bare pread loop``  a plain Python loop of ``os.pread`` over the same samples in the
  planned order, holding one batch of results at a time: the floor for random-order
  reads from Python;
* ``raw read 8 MiB``  reading the shard files sequentially with 8 MiB reads into one
  reused buffer: the bandwidth of the page cache.

Outside the round robin, the machine's ceiling for workers that copy: every planned
sample copied once out of the shards' mappings into a reused buffer the size of a
worker's ring, by 2 processes at once (every other batch each, as 2 workers take them)
against 1 (all of them), in MB/s. Where the copy takes the memory's bandwidth, this is
the most ``Loader(2)`` can gain over one process when its workers copy every byte once
(``zero_copy`` batches, and batches through the ring): one process copies every byte
once too.

On the ``--also-producer`` shards only the fast path's contenders (``wds_pad direct``,
``wds_pad batch 1``) and their peers (``webdataset``, the bare pread loop) run.
Prints samples/s, MB/s, wall and CPU microseconds per sample (the process, its threads
and its finished worker processes) and ratios against the peers on the same shards
(litData: its own format, converted from the ``--producer`` shards), then the fast
path's ratios on the ``--producer`` shards, each beside the target it compares with, the
Loader rows' CPU microseconds per sample split between the main process and its workers
(each run's ``RUSAGE_SELF`` and ``RUSAGE_CHILDREN``: the workers are joined when the loop
ends; kept workers' from /proc) beside one process's, and
the ratios docs/streaming.md cites (measured there on ``tarfile-ustar`` shards). The
machine should be otherwise idle (the run says how busy other processes kept it). Usage::

    python tools/bench/stream.py [--dir DIR] [--small 64000] [--large 4000] [--repeat 3]
                                 [--producer webdataset] [--also-producer tarfile-ustar] [--peer litdata]
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile
import time
import warnings
from typing import Any

import numpy as np
from _common import add_sizes, case_shards, cpu_seconds, once, parser, round_robin, table
from _litdata_peer import litdata_convert, litdata_iterate, litdata_loader, litdata_stream
from _stats_cost import counter_ns_per_batch, loader_ns_per_batch

from wds_pad.stream.dataset import BucketedWebDataset
from wds_pad.stream.loader import Loader
from wds_pad.io.options import ReadOptions
from wds_pad.errors import DroppedBucketWarning
from wds_pad.index.record import Index
from wds_pad.index.build import build_index
from wds_pad.stream import batchread
from wds_pad.stream.fetch import fetch
from wds_pad.stream.stages import PlannedSource, plan_batched
from wds_pad.stream.transport import run_length
from wds_pad.core.topology import Topology


def machine_busy() -> float | None:
    """CPU seconds the whole machine has spent busy so far (Linux ``/proc/stat``), else None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


# -- contenders ---------------------------------------------------------------------------
def ours_direct(ds: BucketedWebDataset) -> int:
    n = 0
    for batch in ds:
        n += len(batch)
    return n


def ours_exact(ds: BucketedWebDataset) -> int:
    """The batches with the member table ignored: every sample's headers parsed."""
    real = batchread.BatchReader.read
    batchread.BatchReader.read = lambda self, batch: None  # type: ignore[method-assign]
    try:
        return ours_direct(ds)
    finally:
        batchread.BatchReader.read = real  # type: ignore[method-assign]


#: per Loader contender, each timed run's CPU seconds (main process, its workers)
SPLIT: dict[str, list[tuple[float, float]]] = {}
#: the Loaders whose workers live between timed runs (persistent_workers): their CPU is
#: read from /proc, since a process that has not exited is not in RUSAGE_CHILDREN
KEPT: list[Any] = []


def _live_cpu(loaders: list[Any]) -> float:
    """CPU seconds so far of the live workers ``loaders`` keep (``Loader._kept``; litData's
    DataLoader iterator), from /proc/<pid>/stat."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for loader in loaders:
        kept = getattr(loader, "_kept", None)
        workers = [w for k in kept for w in k.batches._workers] if kept is not None else \
            list(getattr(getattr(loader, "_iterator", None), "_workers", ()))
        for w in workers:
            try:
                with open(f"/proc/{w.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
            except (FileNotFoundError, ProcessLookupError):
                pass
    return total


def all_cpu() -> float:
    """``cpu_seconds()`` and the CPU of the live workers of every kept Loader."""
    return cpu_seconds() + _live_cpu(KEPT)


def _own_and_children() -> tuple[float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def ours_loader(ds: BucketedWebDataset, workers: int, name: str | None = None, loader: Loader | None = None) -> int:
    """``name``: record the run's CPU split between this process and its workers in SPLIT
    (the workers are joined when the loop ends, so their CPU is counted as children's; a
    kept ``loader``'s live workers are read from /proc)."""
    loader = loader if loader is not None else Loader(ds, num_workers=workers)
    n, (own0, kids0), live0 = 0, _own_and_children(), _live_cpu([loader])
    for batch in loader:
        n += len(batch)
    (own1, kids1), live1 = _own_and_children(), _live_cpu([loader])
    if name is not None:
        SPLIT.setdefault(name, []).append((own1 - own0, kids1 - kids0 + live1 - live0))
    return n


def _kept_loader(ds: BucketedWebDataset) -> Loader:
    """A Loader of 2 workers it keeps between iterations, registered in KEPT."""
    loader = Loader(ds, num_workers=2, persistent_workers=True)
    KEPT.append(loader)
    return loader


def loader_start(ds: BucketedWebDataset, workers: int) -> float:
    """Seconds from ``iter(Loader(ds, num_workers=workers))`` to its first batch: the
    workers' start, paid again at every epoch (counted in the Loader's rates)."""
    t = time.perf_counter()
    it = iter(Loader(ds, num_workers=workers))
    next(it)
    secs = time.perf_counter() - t
    it.close()
    return secs


def ours_stages(ds: BucketedWebDataset, checked: bool) -> int:
    """The stages without the dataset; ``checked``: fetch gets the indexes (the shard check)."""
    stage = fetch(ds.read_options, spec=ds.spec if checked else None)
    n = 0
    for batch in plan_batched()(stage(iter(PlannedSource(ds.spec, worker=(0, 1))))):
        n += len(batch)
    return n


def webdataset_iter(urls: list[str]) -> int:
    import webdataset as wds

    n = 0
    for _ in wds.WebDataset(urls, shardshuffle=False):
        n += 1
    return n


def webdataset_loader(urls: list[str], batch: int, workers: int) -> int:
    import webdataset as wds

    pipeline = wds.WebDataset(urls, shardshuffle=False, nodesplitter=None,
                              workersplitter=wds.split_by_worker).batched(batch, collation_fn=list)
    n = 0
    for b in wds.WebLoader(pipeline, batch_size=None, num_workers=workers):
        n += len(b)
    return n


def bare_pread(index: Index, ids: np.ndarray, batch_size: int) -> tuple[float, float]:
    """The floor: os.pread of every planned range, nothing else; returns (wall, CPU) seconds.

    Descriptors are opened once, outside the timing. Like a trainer, the loop holds one
    batch of results alive at a time, so it pays the same allocator cost as a stream.
    """
    fds = [os.open(u, os.O_RDONLY) for u in index.urls]
    try:
        shard = [fds[s] for s in index.shard[ids].tolist()]
        offsets, lengths = index.offset[ids].tolist(), index.length[ids].tolist()
        c, t = cpu_seconds(), time.perf_counter()
        pread, batch = os.pread, []
        for fd, off, ln in zip(shard, offsets, lengths):
            batch.append(pread(fd, ln, off))
            if len(batch) == batch_size:
                batch = []
        return time.perf_counter() - t, cpu_seconds() - c
    finally:
        for fd in fds:
            os.close(fd)


def raw_read(urls: list[str]) -> int:
    """Sequential 8 MiB reads into one reused buffer: the page cache's bandwidth."""
    n, buf = 0, bytearray(8 << 20)
    for url in urls:
        with open(url, "rb", buffering=0) as f:
            while got := f.readinto(buf):
                n += got
    return n


def _copy_share(urls: list[str], shard: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, batch: int,
                part: int, parts: int, ring: int, out: Any) -> None:
    """In one of ``parts`` processes: the planned samples of every ``parts``-th batch (as
    DataLoader workers take them), each copied out of its shard's mapping into a reused
    buffer of ``ring`` bytes (a worker's ring); puts (bytes copied, wall seconds)."""
    import mmap

    maps = []
    for u in urls:
        with open(u, "rb") as f:
            maps.append(memoryview(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)))
    buf = memoryview(mmap.mmap(-1, ring))  # shared anonymous memory, as a ring is
    mine = (np.arange(shard.size) // batch) % parts == part
    rows = zip(shard[mine].tolist(), offsets[mine].tolist(), lengths[mine].tolist())
    t, at, n = time.perf_counter(), 0, 0
    for s, o, ln in rows:
        if at + ln > ring:
            at = 0
        buf[at:at + ln] = maps[s][o:o + ln]
        at += ln
        n += ln
    out.put((n, time.perf_counter() - t))


def copy_rate(urls: list[str], index: Index, ids: np.ndarray, batch: int, parts: int, ring: int) -> float:
    """Bytes a second at which ``parts`` processes at once copy every planned sample once,
    out of the shards' mappings into rings of ``ring`` bytes: the machine's rate for the
    copy a Loader's workers make of every byte (``zero_copy``), or one process makes."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    out = ctx.Queue()
    args = (urls, index.shard[ids], index.offset[ids], index.length[ids], batch)
    procs = [ctx.Process(target=_copy_share, args=(*args, p, parts, ring, out)) for p in range(parts)]
    for p in procs:
        p.start()
    got = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return sum(n for n, _ in got) / max(w for _, w in got)


def copy_ceiling(urls: list[str], index: Index, ids: np.ndarray, batch: int, repeat: int) -> float:
    """How much faster 2 processes copy every planned sample once than 1 process does (best
    rates of ``repeat`` rounds, alternated), into rings the size a worker makes for these
    batches: on a machine whose memory bandwidth the copy takes, the most Loader(2) can gain
    where its workers copy every byte once, as ``zero_copy`` batches are."""
    from wds_pad.stream.ring import ring_bytes

    nbytes = int(index.length[ids[:batch]].sum())
    ring = ring_bytes(nbytes, run=run_length(batch, nbytes / batch))
    one = two = 0.0
    for _ in range(repeat):
        one = max(one, copy_rate(urls, index, ids, batch, 1, ring))
        two = max(two, copy_rate(urls, index, ids, batch, 2, ring))
    return two / one


# -- driver -------------------------------------------------------------------------------
USTAR = "tarfile-ustar"
# contenders that run on the --also-producer shards too: the fast path and its peers
BOTH_KINDS = ("wds_pad direct", "wds_pad batch 1", "wds_pad direct, zero_copy", "webdataset")


def run_case(label: str, kinds: dict[str, tuple[list[str], Index]], batch_size: int, repeat: int,
             rows: list[list[str]], litdata_dir: str | None) -> dict[str, dict[str, dict[str, float]]]:
    """Times one sample size on every shard kind (the first is the main one) in one round
    robin; returns ``{kind: {"rate" | "bw" | "cpu": {contender: value}}}``."""
    main = next(iter(kinds))

    def dataset(index: Index, batch: int, zero_copy: bool = False, **kw: Any) -> BucketedWebDataset:
        return BucketedWebDataset(index, batch_size=batch, topology=Topology(world_size=1, rank=0),
                                  seed=0, check_agreement=False, zero_copy=zero_copy, **kw)

    contenders: dict[str, tuple[Any, int, int]] = {}  # "kind|name" -> (fn, samples, bytes)
    ids_of: dict[str, np.ndarray] = {}
    for kind, (urls, index) in kinds.items():
        raw_read(urls)  # warm the page cache
        total_file = sum(os.path.getsize(u) for u in urls)
        ds, ds1, dsz = dataset(index, batch_size), dataset(index, 1), dataset(index, batch_size, True)
        kept, keptz = _kept_loader(dataset(index, batch_size)), _kept_loader(dataset(index, batch_size, True))
        ids = ids_of[kind] = np.concatenate([b.samples for b in ds.plan()])
        ids1 = np.concatenate([b.samples for b in ds1.plan()])
        planned, planned_bytes = int(ids.size), int(index.length[ids].sum())
        mine: dict[str, tuple[Any, int, int]] = {
            "wds_pad direct": (lambda ds=ds: ours_direct(ds), planned, planned_bytes),
            "wds_pad direct, os.pread": (lambda dsp=dataset(index, batch_size, read_options=ReadOptions(
                map_local=False)): ours_direct(dsp), planned, planned_bytes),
            "wds_pad batch 1": (lambda ds1=ds1: ours_direct(ds1), int(ids1.size), int(index.length[ids1].sum())),
            "wds_pad exact path": (lambda ds=ds: ours_exact(ds), planned, planned_bytes),
            "wds_pad Loader(2)": (lambda ds=ds, k=kind: ours_loader(ds, 2, f"{k}|wds_pad Loader(2)"), planned,
                                  planned_bytes),
            "wds_pad Loader(2), batch 1": (lambda ds1=ds1, k=kind: ours_loader(ds1, 2, f"{k}|wds_pad Loader(2), "
                                                                                   "batch 1"), int(ids1.size),
                                           int(index.length[ids1].sum())),
            "wds_pad direct, zero_copy": (lambda dsz=dsz: ours_direct(dsz), planned, planned_bytes),
            "wds_pad Loader(2), zero_copy": (lambda dsz=dsz, k=kind: ours_loader(dsz, 2, f"{k}|wds_pad Loader(2), "
                                                                                      "zero_copy"), planned,
                                             planned_bytes),
            "wds_pad Loader(2), persistent": (lambda k=kind, kl=kept: ours_loader(
                kl.dataset, 2, f"{k}|wds_pad Loader(2), persistent", kl), planned, planned_bytes),
            "wds_pad Loader(2), persistent, zero_copy": (lambda k=kind, kl=keptz: ours_loader(
                kl.dataset, 2, f"{k}|wds_pad Loader(2), persistent, zero_copy", kl), planned, planned_bytes),
            "wds_pad stages, checked": (lambda ds=ds: ours_stages(ds, True), planned, planned_bytes),
            "wds_pad stages, unchecked": (lambda ds=ds: ours_stages(ds, False), planned, planned_bytes),
            "webdataset": (lambda urls=urls: webdataset_iter(urls), len(index), total_file),
            "webdataset WebLoader(2)": (lambda urls=urls: webdataset_loader(urls, batch_size, 2), len(index),
                                        total_file),
            "raw read 8 MiB": (lambda urls=urls: raw_read(urls), total_file, total_file),
        }
        if litdata_dir is not None and kind == main:
            for shuffle in (False, True):
                for workers in (0, 2):
                    name = f"litdata {'shuffled' if shuffle else 'in order'}, {workers or 'no'} workers"
                    mine[name] = ((lambda s=shuffle, w=workers: litdata_stream(litdata_dir, s, w, batch_size)),
                                  len(index), total_file)
            lit_kept = litdata_loader(litdata_dir, 2, batch_size)
            KEPT.append(lit_kept)
            mine["litdata in order, 2 persistent workers"] = (lambda lk=lit_kept: litdata_iterate(lk), len(index),
                                                               total_file)
        for name, c in mine.items():
            if kind == main or name in BOTH_KINDS:
                contenders[f"{kind}|{name}"] = c
    expected = {key: c[1] for key, c in contenders.items()}

    def check(key: str, got: int) -> None:
        if got != expected[key]:
            raise SystemExit(f"{label}/{key}: counted {got}, expected {expected[key]}")

    SPLIT.clear()
    try:
        best = round_robin({key: c[0] for key, c in contenders.items()}, repeat,
                           timer=lambda fn: once(fn, all_cpu), check=check)
    finally:  # their workers end (counted as children's from now on: no timing is running)
        for loader in KEPT:
            close = getattr(loader, "close", None) or getattr(getattr(loader, "_iterator", None),
                                                                "_shutdown_workers", None)
            if close is not None:
                close()
        KEPT.clear()
    out: dict[str, dict[str, dict[str, Any]]] = {k: {"rate": {}, "bw": {}, "cpu": {}, "start": {}, "split": {}}
                                                 for k in kinds}
    for key, runs in SPLIT.items():  # the run of least CPU in all: its main and workers' shares
        kind, name = key.split("|", 1)
        own, kids = min(runs, key=sum)
        out[kind]["split"][name] = (own / contenders[key][1] * 1e6, kids / contenders[key][1] * 1e6)
    for key, (_, expect, nbytes) in contenders.items():
        kind, name = key.split("|", 1)
        r = out[kind]
        count = expect if name != "raw read 8 MiB" else len(kinds[kind][1])
        r["rate"][name], r["bw"][name] = count / best[key].wall, nbytes / best[key].wall / 1e6
        r["cpu"][name] = best[key].cpu / count * 1e6
    first = dataset(kinds[main][1], batch_size)
    out[main]["start"]["wds_pad Loader(2)"] = min(loader_start(first, 2) for _ in range(repeat))
    urls, index = kinds[main]  # the machine's ceiling for copies by two processes, outside the round robin
    out[main]["ceiling"] = copy_ceiling(urls, index, ids_of[main], batch_size, repeat)  # type: ignore[assignment]
    for kind, (_, index) in kinds.items():  # outside the round robin: descriptors opened untimed
        ids, r = ids_of[kind], out[kind]
        pread_secs, pread_cpu = min(bare_pread(index, ids, batch_size) for _ in range(repeat))
        r["rate"]["bare pread loop"] = ids.size / pread_secs
        r["bw"]["bare pread loop"] = int(index.length[ids].sum()) / pread_secs / 1e6
        r["cpu"]["bare pread loop"] = pread_cpu / ids.size * 1e6
    lit = out[main]["rate"].get("litdata in order, no workers")
    for kind, r in out.items():
        rate, bw, cpu = r["rate"], r["bw"], r["cpu"]
        for name in rate:
            row = [label, kind, name, f"{rate[name]:,.0f}", f"{bw[name]:,.0f}", f"{1e6 / rate[name]:.1f}",
                   f"{cpu[name]:.1f}", f"{rate[name] / rate['webdataset']:.2f}x",
                   f"{bw[name] / bw['bare pread loop']:.2f}x"]
            rows.append(row + ([f"{rate[name] / lit:.2f}x"] if lit else []))
    return out


def _shards(root: str, label: str, n: int, size: int, shards: int, producer: str) -> tuple[list[str], Index]:
    urls = case_shards(root, label, n, size, shards, producer=producer)
    index = build_index(urls, "aspect:width,height", output=os.path.join(os.path.dirname(urls[0]), "index.wdsidx"))
    return urls, index


def _ratio(text: str, value: float, target: float) -> list[str]:
    """One row of the targets table: what is compared, the measured ratio, its target."""
    return [text, f"{value:.2f}x", f">= {target}x"]


def targets(results: dict[str, dict[str, dict[str, dict[str, float]]]], main: str) -> list[list[str]]:
    """The local fast path's ratios and their targets, on the ``main`` shards (ustar: on those)."""
    small, large = results["10 KB"][main], results["500 KB"][main]
    rate = small["rate"]
    rows = [_ratio("10 KB, batch 64, one process vs the bare pread loop",
                   rate["wds_pad direct"] / rate["bare pread loop"], 0.45)]
    if "litdata in order, no workers" in rate:
        rows.append(_ratio("10 KB, batch 64, one process vs litData in order, one process",
                           rate["wds_pad direct"] / rate["litdata in order, no workers"], 1.0))
    rows.append(_ratio("10 KB, batch 1 vs webdataset sequential",
                       rate["wds_pad batch 1"] / rate["webdataset"], 3.0))
    ustar = results["10 KB"].get(USTAR)
    if ustar is not None and main != USTAR:
        rows.append(_ratio(f"10 KB, batch 1 vs webdataset sequential, both on {USTAR} shards",
                           ustar["rate"]["wds_pad batch 1"] / ustar["rate"]["webdataset"], 2.0))
    rows.append(_ratio("500 KB, one process vs the bare pread loop (MB/s)",
                       large["bw"]["wds_pad direct"] / large["bw"]["bare pread loop"], 0.9))
    # workers: batches cross in shared memory; zero_copy: members are views of the batch buffer;
    # persistent: workers kept between epochs (the later epochs' figure, as one process's is)
    for kept in ("", ", persistent"):
        rows += [_ratio(f"10 KB, Loader(2){kept} vs one process",
                        rate[f"wds_pad Loader(2){kept}"] / rate["wds_pad direct"], 1.4),
                 _ratio(f"500 KB, Loader(2){kept} vs one process (MB/s)",
                        large["bw"][f"wds_pad Loader(2){kept}"] / large["bw"]["wds_pad direct"], 1.0),
                 _ratio(f"500 KB, Loader(2){kept} zero_copy vs one process (MB/s)",
                        large["bw"][f"wds_pad Loader(2){kept}, zero_copy"] / large["bw"]["wds_pad direct"], 1.5)]
    for label, r in (("10 KB", small), ("500 KB", large)):
        rows.append([f"{label}, the machine: every planned byte copied once, 2 processes at once vs 1 (MB/s)",
                     f"{r['ceiling']:.2f}x", "(a ceiling)"])
    rows += [_ratio("10 KB, one process zero_copy vs the bare pread loop",
                    rate["wds_pad direct, zero_copy"] / rate["bare pread loop"], 0.7)]
    if "litdata in order, no workers" in rate:
        rows += [_ratio("10 KB, one process zero_copy vs litData in order, one process",
                        rate["wds_pad direct, zero_copy"] / rate["litdata in order, no workers"], 1.0),
                 _ratio("10 KB, Loader(2) vs litData in order, 2 workers",
                        rate["wds_pad Loader(2)"] / rate["litdata in order, 2 workers"], 3.0),
                 _ratio("10 KB, both with persistent workers, Loader(2) vs litData in order, 2 workers",
                        rate["wds_pad Loader(2), persistent"] / rate["litdata in order, 2 persistent workers"],
                        3.0)]
    rows.append(_ratio("10 KB, one process (bytes) vs the bare pread loop",
                       rate["wds_pad direct"] / rate["bare pread loop"], 0.55))
    rows.append(["10 KB, one process (bytes), os.pread every epoch vs the bare pread loop",
                 f"{rate['wds_pad direct, os.pread'] / rate['bare pread loop']:.2f}x", "(a first epoch)"])
    cpu = small["cpu"]
    for kept in ("", ", persistent"):
        rows.append([f"10 KB, cpu us/sample of Loader(2){kept} (all processes) over one process",
                     f"{cpu[f'wds_pad Loader(2){kept}'] / cpu['wds_pad direct']:.2f}x", "<= 1.3x"])
    # the stats counters: per batch (per message with workers), never per sample; the
    # contenders' default collation only lists the samples, so it is not timed
    per_batch_us = counter_ns_per_batch() / 1e3
    rows += [[f"10 KB, the stats counters over cpu us/sample, batch {b}",
              f"{per_batch_us / b / cpu[name]:.2%}", "< 1%"] for b, name in ((64, "wds_pad direct"),
                                                                             (1, "wds_pad batch 1"))]
    for b, name in ((64, "wds_pad Loader(2)"), (1, "wds_pad Loader(2), batch 1")):
        main_ns, worker_ns = loader_ns_per_batch(run_length(b, 10_000))  # as many batches a message
        rows.append([f"10 KB, the stats counters over cpu us/sample, Loader(2), batch {b} (all processes)",
                     f"{(main_ns + worker_ns) / 1e3 / b / cpu[name]:.2%}", "< 1%"])
    return rows


def split_rows(results: dict[str, Any], kind: str) -> list[list[str]]:
    """Per Loader contender: CPU us per sample in the main process, in its workers, in all,
    and one process's (the matching ``wds_pad direct`` row)."""
    rows = []
    for label, r in results.items():
        for name, (own, kids) in r[kind]["split"].items():
            one = r[kind]["cpu"][name.replace(", persistent", "").replace("Loader(2)", "direct")
                                 .replace("direct, batch 1", "batch 1")]
            rows.append([label, name, f"{own:.1f}", f"{kids:.1f}", f"{own + kids:.1f}", f"{one:.1f}",
                         f"{(own + kids) / one:.2f}x"])
    return rows


def counter_costs() -> str:
    """What the stats counters add to a batch, in nanoseconds (the rows above divide them)."""
    loader = [(b, *loader_ns_per_batch(run_length(b, 10_000))) for b in (64, 1)]
    return (f"the stats counters per batch: {counter_ns_per_batch():.0f} ns in one process, "
            f"{counter_ns_per_batch(timed_collation=True):.0f} ns with a timed collation; Loader(2) "
            + ", ".join(f"at batch {b}: {m:.0f} ns in the main process + {w:.0f} ns in a worker" for b, m, w in loader))


def cited(results: dict[str, dict[str, dict[str, dict[str, float]]]], kind: str) -> list[str]:
    """The ratios docs/streaming.md cites, on the ``kind`` shards."""
    small, large = results["10 KB"][kind]["rate"], results["500 KB"][kind]["bw"]
    out = [f"  10 KB, one process vs webdataset sequential: {small['wds_pad direct'] / small['webdataset']:.2f}x",
           f"  10 KB, one process vs the bare pread loop: {small['wds_pad direct'] / small['bare pread loop']:.2f}x"]
    if "wds_pad Loader(2)" in small:
        out.append(f"  10 KB, Loader(2) vs wds.WebLoader(2): "
                   f"{small['wds_pad Loader(2)'] / small['webdataset WebLoader(2)']:.2f}x")
    if "litdata in order, no workers" in small:
        out += [f"  10 KB, one process vs litData in order, one process: "
                f"{small['wds_pad direct'] / small['litdata in order, no workers']:.2f}x",
                f"  10 KB, Loader(2) vs litData in order, 2 workers: "
                f"{small['wds_pad Loader(2)'] / small['litdata in order, 2 workers']:.2f}x"]
    out.append(f"  500 KB, one process vs the bare pread loop (MB/s): "
               f"{large['wds_pad direct'] / large['bare pread loop']:.2f}x")
    return out


def main(argv: list[str] | None = None) -> int:
    from wds_pad.cli.synth import PRODUCERS

    ap = parser(__doc__)
    add_sizes(ap)
    ap.set_defaults(small=64_000, large=4_000)  # 2 GB at 500 KB: the workers' start-up is not the run
    ap.add_argument("--also-producer", default=USTAR, choices=[*PRODUCERS, "none"],
                    help=f"also measure the fast path and its peers on shards written by this producer "
                         f"(default: {USTAR}; none: only --producer's)")
    ap.add_argument("--peer", action="append", default=[], choices=["litdata"],
                    help="also measure this peer (litdata: pip install litdata, see docs/streaming.md)")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore", DroppedBucketWarning)
    producers = [args.producer] + [p for p in (args.also_producer,) if p not in ("none", args.producer)]
    cases = [("10 KB", args.small, 10_000, 32, 64), ("500 KB", args.large, 500_000, 8, 8)]
    rows: list[list[str]] = []
    results: dict[str, Any] = {}
    converts: dict[str, float] = {}
    busy0, ours0, t0 = machine_busy(), cpu_seconds(), time.perf_counter()
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for label, n, size, shards, batch in cases:
            kinds = {p: _shards(tmp, label, n, size, shards, p) for p in producers}
            lit = None
            if "litdata" in args.peer:
                lit = os.path.join(tmp, label.replace(" ", "") + "-litdata")
                converts[label] = litdata_convert(kinds[args.producer][0], lit)
            results[label] = run_case(f"{label} x {n}", kinds, batch, args.repeat, rows, lit)
    busy1, ours1, wall = machine_busy(), cpu_seconds(), time.perf_counter() - t0
    print(table(["case", "shards", "contender", "samples/s", "MB/s", "us/sample", "cpu us/sample",
                 "vs webdataset", "vs bare pread"] + (["vs litdata"] if converts else []),
                rows, align="lllrrrrrr" + ("r" if converts else "")))
    print("(shards: the producer that wrote them; vs webdataset, vs bare pread: against that peer on the "
          "same shards, samples/s and MB/s;")
    if converts:
        print(" vs litdata: against litData in order, one process, samples/s, in its own format converted "
              f"from the {args.producer} shards;")
    print(" cpu us/sample: CPU time of the process, its threads and its exited worker processes)")
    for label, secs in converts.items():
        print(f"litdata.optimize converted the {label} samples in {secs:.1f} s (not in the rates above)")
    print()
    print(f"the local fast path against its targets, on {args.producer} shards:")
    print(table(["comparison", "ratio", "target"], targets(results, args.producer), align="lrr"))
    print("  (the ratios over HTTP, locality='shard' at 20 ms: tools/bench/remote.py)")
    print(f"  ({counter_costs()})")
    starts = ", ".join(f"{label} {r[args.producer]['start']['wds_pad Loader(2)'] * 1e3:.0f} ms"
                       for label, r in results.items())
    print("\nCPU per sample of the Loader rows, split between the main process and its workers "
          f"(the run of least CPU in all), against one process (wds_pad direct), on {args.producer} shards:")
    print(table(["case", "contender", "main us", "workers us", "all us", "one process us", "all / one process"],
                split_rows(results, args.producer), align="llrrrrr"))
    print(f"Loader(2) start-up, iter() to the first batch (in its rates above; workers start at every epoch): "
          f"{starts}")
    for kind in producers:
        print(f"\nratios docs/streaming.md cites (measured there on {USTAR} shards, which "
              f"--producer {USTAR} reruns in full), on {kind} shards:")
        print("\n".join(cited(results, kind)))
    if busy0 is not None and busy1 is not None:
        others = max(0.0, (busy1 - busy0) - (ours1 - ours0))
        print(f"other processes kept {others / wall:.0%} of a core busy during the run"
              + (" (results unreliable: rerun on an idle machine)" if others > 0.05 * wall + 0.3 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
