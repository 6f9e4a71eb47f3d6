"""Benchmark: planned (random-order) streaming vs webdataset's sequential read and litData, in one run.

Generates local shards with ``make_blob_shards`` (small ~10 KB samples: 32 shards, batch
64; large ~500 KB samples), indexes them with aspect buckets, warms the page cache, then
times every contender in turn (round robin, best of ``--repeat``):

* ``wds_pad direct``  ``BucketedWebDataset`` iterated in the main process (no decode):
  the plan's random order through the index's member table, one ``os.pread`` per sample
  (per payload for large samples), a webdataset sample dict each;
* ``wds_pad exact path``  the same batches with the member table ignored: every sample's
  tar headers parsed again (the path of indexes without a member table, and what every
  sample took before it);
* ``wds_pad Loader(2)``  the same through ``Loader(ds, num_workers=2)``;
* ``wds_pad stages, checked`` / ``unchecked``  the raw stages ``PlannedSource -> fetch ->
  plan_batched`` with and without the indexes handed to ``fetch`` (the shard check);
* ``webdataset``  ``wds.WebDataset(urls, shardshuffle=False)`` iterating every sample of
  the same shards sequentially (no decode); ``webdataset WebLoader(2)`` the same batched
  by 64 through ``wds.WebLoader(num_workers=2)``;
* ``litdata ...`` (``--peer litdata``)  the same samples converted once with
  ``litdata.optimize`` (timed, printed), streamed by ``litdata.StreamingDataset`` with
  shuffle off and on, in one process and through ``StreamingDataLoader(num_workers=2)``;
* ``bare pread loop``  a plain Python loop of ``os.pread`` over the same samples in the
  planned order, holding one batch of results at a time: the floor for random-order
  reads from Python;
* ``raw read 8 MiB``  reading the shard files sequentially with 8 MiB reads into one
  reused buffer: the bandwidth of the page cache.

Prints samples/s, MB/s, wall and CPU microseconds per sample (the process, its threads
and its finished worker processes) and ratios, then the goals of issue 15. The machine
should be otherwise idle (the run says how busy other processes kept it). Usage::

    python tools/bench/stream.py [--dir DIR] [--small 64000] [--large 1000] [--repeat 3] [--peer litdata]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from typing import Any

import numpy as np
from _common import add_sizes, case_shards, cpu_seconds, once, parser, round_robin, table
from _litdata_peer import litdata_convert, litdata_stream

from wds_pad.stream.dataset import BucketedWebDataset
from wds_pad.stream.loader import Loader
from wds_pad.errors import DroppedBucketWarning
from wds_pad.index.format import Index
from wds_pad.index.build import build_index
from wds_pad.io.options import ReadOptions
from wds_pad.stream import batchread
from wds_pad.stream.fetch import fetch
from wds_pad.stream.stages import PlannedSource, plan_batched
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


def ours_loader(ds: BucketedWebDataset, workers: int) -> int:
    n = 0
    for batch in Loader(ds, num_workers=workers):
        n += len(batch)
    return n


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


# -- driver -------------------------------------------------------------------------------
def run_case(label: str, urls: list[str], index: Index, batch_size: int, repeat: int,
             rows: list[list[str]], litdata_dir: str | None) -> dict[str, float]:
    raw_read(urls)  # warm the page cache
    total_file = sum(os.path.getsize(u) for u in urls)

    def dataset(**read: Any) -> BucketedWebDataset:
        return BucketedWebDataset(index, batch_size=batch_size, topology=Topology(world_size=1, rank=0),
                                  seed=0, check_agreement=False,
                                  read_options=ReadOptions(**read) if read else None)

    ds = dataset()
    plan = ds.plan()
    ids = np.concatenate([b.samples for b in plan])
    planned, planned_bytes = int(ids.size), int(index.length[ids].sum())
    contenders: dict[str, tuple[Any, int, int]] = {
        "wds_pad direct": (lambda: ours_direct(ds), planned, planned_bytes),
        "wds_pad exact path": (lambda: ours_exact(ds), planned, planned_bytes),
        "wds_pad Loader(2)": (lambda: ours_loader(ds, 2), planned, planned_bytes),
        "wds_pad stages, checked": (lambda: ours_stages(ds, True), planned, planned_bytes),
        "wds_pad stages, unchecked": (lambda: ours_stages(ds, False), planned, planned_bytes),
        "webdataset": (lambda: webdataset_iter(urls), len(index), total_file),
        "webdataset WebLoader(2)": (lambda: webdataset_loader(urls, batch_size, 2), len(index), total_file),
        "raw read 8 MiB": (lambda: raw_read(urls), total_file, total_file),
    }
    if litdata_dir is not None:
        for shuffle in (False, True):
            for workers in (0, 2):
                name = f"litdata {'shuffled' if shuffle else 'in order'}, {workers or 'no'} workers"
                contenders[name] = ((lambda s=shuffle, w=workers: litdata_stream(litdata_dir, s, w, batch_size)),
                                    len(index), total_file)
    expected = {name: c[1] for name, c in contenders.items()}

    def check(name: str, got: int) -> None:
        if got != expected[name]:
            raise SystemExit(f"{label}/{name}: counted {got}, expected {expected[name]}")

    best = round_robin({name: c[0] for name, c in contenders.items()}, repeat,
                       timer=lambda fn: once(fn, cpu_seconds), check=check)
    rate: dict[str, float] = {}   # samples/s
    bw: dict[str, float] = {}     # MB/s
    cpu: dict[str, float] = {}    # CPU us per sample
    for name, (_, expect, nbytes) in contenders.items():
        count = expect if name != "raw read 8 MiB" else len(index)
        rate[name], bw[name], cpu[name] = count / best[name].wall, nbytes / best[name].wall / 1e6, best[name].cpu / count * 1e6
    pread_secs, pread_cpu = min(bare_pread(index, ids, batch_size) for _ in range(repeat))
    rate["bare pread loop"], bw["bare pread loop"] = planned / pread_secs, planned_bytes / pread_secs / 1e6
    cpu["bare pread loop"] = pread_cpu / planned * 1e6
    for name in rate:
        vs_wds = f"{rate[name] / rate['webdataset']:.2f}x"
        vs_pread = f"{bw[name] / bw['bare pread loop']:.2f}x"
        rows.append([label, name, f"{rate[name]:,.0f}", f"{bw[name]:,.0f}", f"{1e6 / rate[name]:.1f}",
                     f"{cpu[name]:.1f}", vs_wds, vs_pread])
    return {"rate": rate, "bw": bw, "cpu": cpu}  # type: ignore[dict-item]


def _shards(root: str, label: str, n: int, size: int, shards: int) -> tuple[list[str], Index]:
    urls = case_shards(root, label, n, size, shards)
    index = build_index(urls, "aspect:width,height", output=os.path.join(os.path.dirname(urls[0]), "index.wdsidx"))
    return urls, index


def _goal(text: str, value: float, target: float) -> tuple[str, bool]:
    ok = value >= target
    return f"  {'ok  ' if ok else 'MISS'} {text}: {value:.2f}x (goal >= {target}x)", ok


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    add_sizes(ap)
    ap.set_defaults(small=64_000)
    ap.add_argument("--peer", action="append", default=[], choices=["litdata"],
                    help="also measure this peer (litdata: pip install litdata, see docs/streaming.md)")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore", DroppedBucketWarning)
    cases = [("10 KB", args.small, 10_000, 32, 64), ("500 KB", args.large, 500_000, 8, 8)]
    rows: list[list[str]] = []
    results: dict[str, Any] = {}
    converts: dict[str, float] = {}
    busy0, ours0, t0 = machine_busy(), cpu_seconds(), time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for label, n, size, shards, batch in cases:
            urls, index = _shards(tmp, label, n, size, shards)
            lit = None
            if "litdata" in args.peer:
                lit = os.path.join(tmp, label.replace(" ", "") + "-litdata")
                converts[label] = litdata_convert(urls, lit)
            results[label] = run_case(f"{label} x {n}", urls, index, batch, args.repeat, rows, lit)
    busy1, ours1, wall = machine_busy(), cpu_seconds(), time.perf_counter() - t0
    print(table(["case", "contender", "samples/s", "MB/s", "us/sample", "cpu us/sample",
                 "vs webdataset", "vs bare pread"], rows, align="llrrrrrr"))
    print("(cpu us/sample: CPU time of the process, its threads and its exited worker processes)")
    for label, secs in converts.items():
        print(f"litdata.optimize converted the {label} samples in {secs:.1f} s (not in the rates above)")
    print()
    small, large = results["10 KB"]["rate"], results["500 KB"]
    lines = [_goal("10 KB, one process vs webdataset sequential", small["wds_pad direct"] / small["webdataset"], 6.0),
             _goal("10 KB, one process vs the bare pread loop", small["wds_pad direct"] / small["bare pread loop"], 0.35),
             _goal("10 KB, Loader(2) vs wds.WebLoader(2)",
                   small["wds_pad Loader(2)"] / small["webdataset WebLoader(2)"], 4.0),
             _goal("500 KB, one process vs the bare pread loop (MB/s)",
                   large["bw"]["wds_pad direct"] / large["bw"]["bare pread loop"], 0.9)]
    if "litdata in order, no workers" in small:
        lines += [_goal("10 KB, one process vs litdata in order, one process",
                        small["wds_pad direct"] / small["litdata in order, no workers"], 1.0),
                  _goal("10 KB, Loader(2) vs litdata in order, 2 workers",
                        small["wds_pad Loader(2)"] / small["litdata in order, 2 workers"], 1.0)]
    print("goals (issue 15):")
    for text, _ in lines:
        print(text)
    print("all goals met" if all(ok for _, ok in lines) else "SOME GOALS MISSED")
    if busy0 is not None and busy1 is not None:
        others = max(0.0, (busy1 - busy0) - (ours1 - ours0))
        print(f"other processes kept {others / wall:.0%} of a core busy during the run"
              + (" (results unreliable: rerun on an idle machine)" if others > 0.05 * wall + 0.3 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
