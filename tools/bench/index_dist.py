"""Benchmark: distributed indexing over HTTP with latency, 1 process vs 4, in one run.

Serves ``make_blob_shards`` output (default 2,000 small shards) with nginx on loopback,
behind tools/faultproxy.py in its own process adding a fixed latency (default 20 ms) to
every request, then indexes it as a user would, each contender a fresh command (so each
pays for its own interpreter, imports and, for torchrun, rendezvous):

* ``1 process``       ``python -m wds_pad index URLS -o OUT`` (``--workers 8``), the peer;
* ``1 process, w32``  the same with ``--workers 32``: as many requests in flight as 4 x 8;
* ``torchrun 4 x w8`` ``torchrun --nproc-per-node 4 -m wds_pad index --distributed ...``.

Each contender gets a fresh proxy, whose request count gives requests per shard. Every
output must be byte-identical to the peer's (same digest, same bytes), or the script
fails. Prints wall time, speed-up over the peer, and requests per shard. Usage::

    python tools/bench/index_dist.py [--shards 2000] [--samples-per-shard 8]
                                     [--sample-bytes 2000] [--latency-ms 20] [--repeat 1]

Needs nginx (``/usr/sbin/nginx``); loopback only.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import Columns, add_repeat, parser  # first: tools/ and the repo root on sys.path
from remote import FAULTPROXY, ProxyProcess
from servers import NginxServer, _wait_http, free_port

from wds_pad.cli.synth import make_blob_shards  # noqa: E402


class SamePortProxy(ProxyProcess):
    """remote.py's proxy process on a port given: every contender's shard URLs (and so
    its index bytes) are the same, and each contender's proxy counts only its requests."""

    def __init__(self, upstream_port: int, latency_ms: float, port: int) -> None:  # noqa: D107
        self.port = port
        self.proc = subprocess.Popen(  # noqa: S603 (fixed argv, loopback)
            [sys.executable, str(FAULTPROXY), "--upstream", f"127.0.0.1:{upstream_port}",
             "--port", str(port), "--latency-ms", str(latency_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _wait_http(self.url + "/", self.proc, None, 15)


def run(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall time of the command, the time its report states: from the command's start
    of work, after imports and, distributed, before the process group, to the index)."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)  # noqa: S603 (fixed argv)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:8])} ... failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    stated = re.search(r" in ([0-9.]+) s -> ", proc.stdout)
    return wall, float(stated.group(1)) if stated else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--shards", type=int, default=2000)
    ap.add_argument("--samples-per-shard", type=int, default=8)
    ap.add_argument("--sample-bytes", type=int, default=2000)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--part-shards", type=int, default=64)
    add_repeat(ap, 1)
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="wds_pad_index_dist_"))
    try:
        data = root / "www"
        paths = make_blob_shards(data, samples=args.shards * args.samples_per_shard, sample_bytes=args.sample_bytes,
                                 shards=args.shards, seed=0)
        total = sum(os.path.getsize(p) for p in paths)
        print(f"{args.shards} shards of {args.samples_per_shard} samples of ~{args.sample_bytes} B "
              f"({total / 1e6:.0f} MB) over HTTP, {args.latency_ms:.0f} ms per request "
              f"(nginx + FaultProxy process), {os.cpu_count()} cores\n")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
        last = len(paths) - 1
        contenders = [
            ("1 process, --workers 8", lambda pattern, out: [sys.executable, "-m", "wds_pad", "index", pattern, "-o",
                                                            out, "--bucket-by", "aspect:width,height", "--workers",
                                                            "8", "--no-progress"]),
            ("1 process, --workers 32", lambda pattern, out: [sys.executable, "-m", "wds_pad", "index", pattern, "-o",
                                                             out, "--bucket-by", "aspect:width,height", "--workers",
                                                             "32", "--no-progress"]),
            (f"torchrun {args.procs} x --workers 8", lambda pattern, out: [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.procs),
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "wds_pad", "index",
                "--distributed", pattern, "-o", out, "--bucket-by", "aspect:width,height", "--workers", "8",
                "--part-shards", str(args.part_shards), "--no-progress"]),
        ]
        rows = []
        reference: bytes | None = None
        port = free_port()
        with NginxServer(data) as nginx:
            for label, make in contenders:
                best = None
                for rep in range(args.repeat):
                    proxy = SamePortProxy(nginx.port, args.latency_ms, port)
                    try:
                        pattern = f"{proxy.url}/shard-{{000000..{last:06d}}}.tar"
                        out = root / f"run-{len(rows)}-{rep}" / "train.wdsidx"
                        out.parent.mkdir()
                        wall, stated = run(make(pattern, str(out)), env)
                    finally:
                        seen = proxy.stop()
                    requests = int(re.search(r"requests seen: (\d+)", seen).group(1))  # type: ignore[union-attr]
                    got = out.read_bytes()
                    if reference is None:
                        reference = got
                    elif got != reference:
                        raise SystemExit(f"{label}: the index differs from the one-process build")
                    if best is None or wall < best[0]:
                        best = (wall, stated, requests)
                rows.append((label, *best))  # type: ignore[misc]
        peer, peer_stated = rows[0][1], rows[0][2]
        cols = Columns("{:28} {:>8} {:>9} {:>9} {:>9} {:>9} {:>10}")
        print(cols.header("contender", "wall s", "speed-up", "index s", "speed-up", "requests", "per shard"))
        for label, wall, stated, requests in rows:
            requests -= 1  # the proxy's own start-up probe (GET /)
            print(cols.line(label, f"{wall:.2f}", f"{peer / wall:.2f}x", f"{stated:.2f}", f"{peer_stated / stated:.2f}x",
                            requests, f"{requests / args.shards:.2f}"))
        print("\nwall s: the whole command (interpreter, imports; torchrun: its agent, 4 workers importing torch, "
              "rendezvous); index s: the time the command reports (distributed: from before the process group "
              "to the merged index)")
        print("every index byte-identical to the one-process build; requests per shard include the index's "
              "one HEAD per shard and its reads (one ranged GET for a shard this small)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
