"""Benchmark: ``wds-pad simulate``'s time to first batch and stall share against a real job's.

A job of 4 ranks in 2 simulated nodes of 2 (gloo on loopback, started as torchrun starts
them, each node its own cache folder: ``tools/nodejob.py``) streams ``--shards`` shards
over loopback HTTP behind our FaultProxy at 20, 50 and 100 ms a request, in lockstep (a
barrier after each batch), sleeping ``--step-ms`` after each batch as a training step.
Each rank logs how long every ``next()`` waited. Measured: the first batch's wait (the
slowest rank's, from the loader's start) and the share of later steps whose slowest
rank waited more than ``--stall-ms``; predicted: ``wds-pad simulate --json`` for the same
options, latency and ``--stall-ms`` (the GETs, counted at the proxy, beside), its
``--start-ms`` left at its default (the start it assumes is this benchmark's, measured). Printed as predicted /
measured, against the 15 % target.

Usage::

    python tools/bench/simulate.py [--shards 16] [--samples 320] [--step-ms 100] [--locality shard]

Loopback only; nginx or the Python fallback.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from _common import parser, table  # first: tools/ on sys.path

import nodejob  # noqa: E402
from faultproxy import FaultProxy  # noqa: E402
from servers import http_server  # noqa: E402

from wds_pad.cli import main as wds_pad  # noqa: E402
from wds_pad.cli.synth import make_blob_shards  # noqa: E402
from wds_pad.index.build import build_index  # noqa: E402

NPROCS, PER_NODE = 4, 2


def predicted(index: str, args: argparse.Namespace, latency_ms: float) -> dict[str, Any]:
    out = io.StringIO()
    with redirect_stdout(out):
        wds_pad(["simulate", index, "--world-size", str(NPROCS), "--local-world-size", str(PER_NODE),
                 "--batch-size", str(args.batch_size), "--seed", "5", "--window", "2", "--locality", args.locality,
                 "--epochs", str(args.epochs), "--block-bytes", str(args.block_bytes), "--in-flight", "8",
                 "--latency-ms", str(latency_ms), "--bandwidth-mbps", str(args.bandwidth_mbps),
                 "--step-ms", str(args.step_ms), "--stall-ms", str(args.stall_ms), "--json"])
    return json.loads(out.getvalue())


def measured(index: str, reference: Path, root: Path, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    state, cache = root / f"state-{tag}", root / f"cache-{tag}"
    state.mkdir()
    job = nodejob.Job(["--index", index, "--reference", str(reference), "--cache-dir", str(cache), "--state", str(state),
                       "--epochs", str(args.epochs), "--workers", str(args.workers), "--cp", "1",
                       "--batch-size", str(args.batch_size), "--seed", "5", "--window", "2",
                       "--block-bytes", str(args.block_bytes), "--locality", args.locality,
                       "--local-world-size", str(PER_NODE), "--lockstep", "--step-ms", str(args.step_ms)],
                      NPROCS, run=tag, timeout=600).start()
    if job.wait() != [0] * NPROCS:
        raise SystemExit(f"{tag}: the job failed:\n{job.outputs()}")
    logs = nodejob.logs(state, NPROCS)
    steps = min(len(v) for v in logs.values())
    wait = [max(logs[r][s]["wait"] for r in logs) for s in range(steps)]
    stalled = [(s, wait[s]) for s in range(1, steps) if wait[s] * 1000 > args.stall_ms]
    return {"first_batch_s": wait[0], "stall_share": len(stalled) / max(steps - 1, 1), "stalls": len(stalled),
            "stalled": stalled}


def _ratio(p: float, m: float) -> str:
    return f"{p / m:.2f}" if m > 0 else ("1.00" if p == 0 else "inf")


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--samples", type=int, default=320)
    ap.add_argument("--sample-bytes", type=int, default=4000)
    ap.add_argument("--block-bytes", type=int, default=16 * 1024)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--locality", choices=["none", "shard", "node"], default="shard")
    ap.add_argument("--step-ms", type=float, default=100.0)
    ap.add_argument("--stall-ms", type=float, default=10.0, help="a measured step stalls when it waited longer")
    ap.add_argument("--bandwidth-mbps", type=float, default=8000.0, help="the model's loopback bandwidth")
    ap.add_argument("--latencies", default="20,50,100")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="wds_pad_simbench_"))
    try:
        www = root / "www"
        make_blob_shards(www / "d", samples=args.samples, sample_bytes=args.sample_bytes, shards=args.shards, seed=1)
        names = sorted(p.name for p in (www / "d").glob("*.tar"))
        rows, stalled = [], []
        with http_server(www) as server:
            proxy = FaultProxy(server.host, server.port).start()
            try:
                urls = [f"http://{proxy.host}:{proxy.port}/d/{n}" for n in names]
                index = str(root / "ix.wdsidx")
                build_index(urls, "aspect:width,height", output=index)
                print(f"{args.samples} samples in {args.shards} shards over {server!r}; {NPROCS} ranks in "
                      f"{NPROCS // PER_NODE} nodes, locality {args.locality}, batch {args.batch_size}, "
                      f"{args.workers} workers, step {args.step_ms:g} ms, a measured stall: a wait over "
                      f"{args.stall_ms:g} ms\n")
                for ms in (float(x) for x in args.latencies.split(",")):
                    proxy.set_latency(ms)
                    proxy.reset_counters()
                    t = time.perf_counter()
                    m = measured(index, www / "d", root, args, f"{ms:g}")
                    gets = proxy.requests_seen
                    p = predicted(index, args, ms)
                    rows.append([f"{ms:g} ms", f"{p['first_batch_s']:.3f}", f"{m['first_batch_s']:.3f}",
                                 _ratio(p["first_batch_s"], m["first_batch_s"]),
                                 f"{p['stall_share']:.3f}", f"{m['stall_share']:.3f}",
                                 _ratio(p["stall_share"], m["stall_share"]),
                                 f"{sum(p['gets_per_epoch'])}", f"{gets}", f"{time.perf_counter() - t:.0f}"])
                    waits = ", ".join(f"{s} ({w * 1000:.0f} ms)" for s, w in m["stalled"]) or "none"
                    stalled.append(f"  {ms:g} ms: {waits}")
            finally:
                proxy.stop()
        print(table(["latency", "first batch s, sim", "measured", "ratio", "stall share, sim", "measured", "ratio",
                     "GETs, sim", "counted", "wall s"], rows))
        print("\nthe job's stalled steps (the slowest rank's wait):", *stalled, sep="\n")
        print("\ntarget: each ratio within 0.85-1.15")
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
