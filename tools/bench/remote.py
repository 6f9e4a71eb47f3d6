"""Benchmark: planned random-order streaming over HTTP with latency vs webdataset, one run.

Serves ``make_blob_shards`` output (default 2,000 samples of ~100 KB in 20 shards) with
nginx on loopback, behind our FaultProxy (``tools/faultproxy.py``, run as its own
process) adding a fixed latency (default 20 ms) to every request. Then times:

* ``webdataset sequential``  ``wds.WebDataset(proxy_urls, shardshuffle=False)``: one
  GET per shard, streamed by webdataset's default ``curl`` pipe for http URLs (the URLs
  are the proxy's, so curl goes through it; the proxy's CPU time proves it);
* ``wds_pad planned``  ``BucketedWebDataset`` over the same proxy URLs in the plan's
  random order, one ranged GET per sample, ``max_in_flight`` 32 and 64, iterated through
  ``Loader`` with 0 (main process) and 2 DataLoader workers;
* ``in-flight sweep``  one reader (``Loader`` with 0 workers) at max_in_flight 1, 4, 16,
  32, 64: samples/s per DataLoader worker against the ranges in flight, and as a ratio
  against the same reader at 1 in flight (target: >= 4x at 16 in flight). Low settings
  stream only a prefix of the epoch (they are latency-bound; a prefix measures the rate).

Every streamed sample is checked: the first 8 bytes of its ``bin`` member are its index.
Prints samples/s, MB/s, the ratio to webdataset, and CPU seconds per run of the proxy
and of the client (this process plus its reaped children: curl, DataLoader workers). Target: planned random order >= 0.5x webdataset's sequential
throughput at 20 ms. Usage::

    python tools/bench/remote.py [--samples 2000] [--sample-bytes 100000] [--shards 20]
                                 [--latency-ms 20] [--repeat 1]

Needs nginx (``/usr/sbin/nginx``) and curl; loopback only.
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import webdataset as wds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: servers
from servers import NginxServer, _wait_http, free_port  # noqa: E402

from wds_pad.cli.synth import make_blob_shards  # noqa: E402
from wds_pad.stream.dataset import BucketedWebDataset  # noqa: E402
from wds_pad.stream.loader import Loader  # noqa: E402
from wds_pad.errors import DroppedBucketWarning  # noqa: E402
from wds_pad.index.format import Index  # noqa: E402
from wds_pad.index.build import build_index  # noqa: E402
from wds_pad.io.options import ReadOptions  # noqa: E402
from wds_pad.core.topology import Topology  # noqa: E402

FAULTPROXY = Path(__file__).resolve().parents[1] / "faultproxy.py"


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ProxyProcess:
    """tools/faultproxy.py in its own process (so it never shares our GIL)."""

    def __init__(self, upstream_port: int, latency_ms: float) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(  # noqa: S603 (fixed argv, loopback)
            [sys.executable, str(FAULTPROXY), "--upstream", f"127.0.0.1:{upstream_port}",
             "--port", str(self.port), "--latency-ms", str(latency_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _wait_http(self.url + "/", self.proc, None, 15)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> str:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        return out.strip().splitlines()[-1] if out.strip() else ""


def check(key: str, payload: bytes) -> None:
    if int.from_bytes(payload[:8], "little") != int(key):
        raise AssertionError(f"sample {key}: payload starts with the wrong index")


def run_webdataset(urls: list[str]) -> tuple[int, int]:
    n = nbytes = 0
    for s in wds.WebDataset(urls, shardshuffle=False):
        check(s["__key__"], s["bin"])
        n += 1
        nbytes += len(s["bin"]) + len(s["json"])
    return n, nbytes


def run_ours(index: Index, in_flight: int, workers: int, max_batches: int | None,
             batch_size: int) -> tuple[int, int]:
    ds = BucketedWebDataset(index, batch_size=batch_size, topology=Topology(world_size=1, rank=0),
                            seed=0, pad="drop",
                            read_options=ReadOptions(max_in_flight=in_flight))
    n = nbytes = 0
    for batch in itertools.islice(Loader(ds, num_workers=workers), max_batches):
        for s in batch:
            check(s["__key__"], s["bin"])
            n += 1
            nbytes += len(s["bin"]) + len(s["json"])
    return n, nbytes


def own_cpu() -> float:
    """CPU seconds of this process plus its reaped children (curl, DataLoader workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def timed(proxy: ProxyProcess, repeat: int, fn: Callable[[], tuple[int, int]]) -> dict[str, Any]:
    best: dict[str, Any] | None = None
    for _ in range(repeat):
        cpu0, mine0, t0 = proxy.cpu(), own_cpu(), time.perf_counter()
        n, nbytes = fn()
        wall = time.perf_counter() - t0
        row = {"n": n, "wall": wall, "sps": n / wall, "mbps": nbytes / wall / 1e6,
               "proxy_cpu": proxy.cpu() - cpu0, "our_cpu": own_cpu() - mine0}
        if best is None or row["sps"] > best["sps"]:
            best = row
    assert best is not None
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--sample-bytes", type=int, default=100_000)
    parser.add_argument("--shards", type=int, default=20)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--dir", help="where to write shards (default: a temp dir, removed)")
    args = parser.parse_args(argv)
    if shutil.which("curl") is None:
        print("curl is not installed (apt-get install curl): webdataset streams http via curl")
        return 2
    warnings.simplefilter("ignore", DroppedBucketWarning)
    warnings.filterwarnings("ignore", "This DataLoader will create")
    root = Path(args.dir or tempfile.mkdtemp(prefix="wds_pad_remote_"))
    try:
        t0 = time.perf_counter()
        paths = make_blob_shards(root, samples=args.samples, sample_bytes=args.sample_bytes,
                                 shards=args.shards, seed=0)
        total = sum(os.path.getsize(p) for p in paths)
        print(f"{args.samples} samples of ~{args.sample_bytes / 1e3:.0f} KB in {args.shards} shards "
              f"({total / 1e6:.0f} MB), generated in {time.perf_counter() - t0:.1f} s")
        with NginxServer(root) as nginx:
            proxy = ProxyProcess(nginx.port, args.latency_ms)
            try:
                urls = [f"{proxy.url}/{Path(p).name}" for p in paths]
                t0 = time.perf_counter()
                index = build_index(urls, "aspect:width,height")  # over HTTP, through the proxy
                print(f"indexed over HTTP in {time.perf_counter() - t0:.1f} s "
                      f"({len(index)} samples, {len(index.buckets)} buckets)")
                report(args, proxy, urls, index)
            finally:
                print(f"proxy: {proxy.stop()}")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def report(args: argparse.Namespace, proxy: ProxyProcess, urls: list[str], index: Index) -> None:
    rows: list[tuple[str, dict[str, Any]]] = []
    lat = args.latency_ms
    print(f"\nlatency {lat:.0f} ms per request (FaultProxy process pid {proxy.proc.pid}), "
          f"batch_size {args.batch_size}, best of {args.repeat}\n")
    ref = timed(proxy, args.repeat, lambda: run_webdataset(urls))
    rows.append(("webdataset sequential (curl)", ref))
    for in_flight, workers in ((32, 0), (64, 0), (32, 2), (64, 2)):
        rows.append((f"wds_pad planned  in-flight {in_flight:2d}, workers {workers}",
                     timed(proxy, args.repeat, lambda: run_ours(index, in_flight, workers, None,
                                                                args.batch_size))))
    head = f"{'contender':42s} {'samples':>7s} {'wall s':>7s} {'samples/s':>10s} {'MB/s':>7s} " \
           f"{'x wds':>6s} {'proxy cpu s':>11s} {'client cpu s':>12s}"
    print(head)
    print("-" * len(head))
    for name, r in rows:
        print(f"{name:42s} {r['n']:7d} {r['wall']:7.2f} {r['sps']:10.0f} {r['mbps']:7.1f} "
              f"{r['sps'] / ref['sps']:6.2f} {r['proxy_cpu']:11.2f} {r['our_cpu']:12.2f}")

    print(f"\nsamples/s of one reader (Loader, 0 workers) against ranges in flight, {lat:.0f} ms:")
    print(f"{'in flight':>9s} {'samples':>7s} {'samples/s':>10s} {'MB/s':>7s} {'latency bound':>13s} "
          f"{'x 1 in flight':>13s} {'proxy cpu %':>11s} {'client cpu %':>12s}")
    n_batches = max(1, len(index) // args.batch_size)
    sweep: dict[int, float] = {}
    for in_flight in (1, 4, 16, 32, 64):
        # latency-bound settings stream a prefix of about 2 s worth of requests
        budget = max(2, min(n_batches, int(2.0 / (lat / 1000) * in_flight / args.batch_size)))
        r = timed(proxy, 1, lambda: run_ours(index, in_flight, 0, budget, args.batch_size))
        bound = in_flight / (lat / 1000) if lat else float("inf")
        sweep[in_flight] = r["sps"]
        print(f"{in_flight:9d} {r['n']:7d} {r['sps']:10.0f} {r['mbps']:7.1f} {bound:13.0f} "
              f"{r['sps'] / sweep[1]:13.2f} {100 * r['proxy_cpu'] / r['wall']:11.0f} "
              f"{100 * r['our_cpu'] / r['wall']:12.0f}")
    best = max(r["sps"] for name, r in rows[1:])
    print(f"\nbest planned / webdataset sequential: {best / ref['sps']:.2f}x (target >= 0.5x)")
    # The speed-up the tests used to assert in wall-clock time (tests/io/test_read.py and
    # tests/io/test_object_storage.py now count requests in flight instead): the same reader,
    # one request at a time as the peer, measured in this run.
    print(f"16 in flight / 1 in flight: {sweep[16] / sweep[1]:.1f}x, "
          f"32 / 1: {sweep[32] / sweep[1]:.1f}x (target >= 4x: latency hidden by requests in flight)")


if __name__ == "__main__":
    sys.exit(main())
