"""Benchmark: ``wds-pad simulate``'s time to first batch and stall share against a real job's.

A job of 4 ranks in 2 simulated nodes of 2 (gloo on loopback, started as torchrun starts
them, each node its own cache folder: ``tools/nodejob.py``) streams ``--shards`` shards
over loopback HTTP behind our FaultProxy at 20, 50 and 100 ms a request, in lockstep (a
barrier after each batch), sleeping ``--step-ms`` after each batch as a training step.
Each rank logs how long every ``next()`` waited. Measured: the first batch's wait (the
slowest rank's, from the loader's start) and the share of later steps whose slowest
rank waited more than ``--stall-ms``; predicted: ``wds-pad simulate --json`` for the same
options, latency and ``--stall-ms`` (the GETs, counted at the proxy, beside), its
``--start-ms`` and ``--start-skew-ms`` left at their defaults (the start and the spread of the
ranks' starts they assume are this benchmark's, measured). Printed as predicted / measured,
against the 15 % target.

``--trace`` shows when each rank starts: each rank runs through :func:`traced_rank`, which
times (on the machine's clock) its rendezvous, its ``iter()``, every GET of a shard block it
sends and every batch it gets; printed per rank: ``iter()`` after the last rank left the
rendezvous, its first GET after the job's first, and its wait at step 1.

Usage::

    python tools/bench/simulate.py [--shards 16] [--samples 320] [--step-ms 100] [--locality shard] [--trace]

Loopback only; nginx or the Python fallback.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
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


def traced_rank() -> int:
    """One rank of ``tools/nodejob.py``, timed: writes ``<state>/trace-<rank>.json``."""
    import torch.distributed as dist

    import wds_pad.io.inflight as inflight
    from wds_pad import Loader

    rec: dict[str, Any] = {"gets": [], "batches": []}
    init, loader_iter, get_block = dist.init_process_group, Loader.__iter__, inflight.InFlight._get_block

    def timed_init(*a: Any, **k: Any) -> None:
        init(*a, **k)
        rec["rendezvous"] = time.time()

    def timed_iter(self: Any) -> Any:
        rec.setdefault("iter", time.time())
        for batch in loader_iter(self):
            rec["batches"].append(time.time())
            yield batch

    def timed_get(self: Any, url: str, start: int, length: int) -> Any:
        rec["gets"].append(time.time())
        return get_block(self, url, start, length)

    dist.init_process_group, Loader.__iter__, inflight.InFlight._get_block = timed_init, timed_iter, timed_get
    code = nodejob.rank_main()
    state = sys.argv[sys.argv.index("--state") + 1]
    Path(state, f"trace-{os.environ['RANK']}.json").write_text(json.dumps(rec))
    return code


def starts(state: Path, waits: dict[int, list[float]]) -> str:
    """Per rank: ``iter()`` after the rendezvous, the first GET after the job's first, step 1's wait."""
    tr = {r: json.loads((state / f"trace-{r}.json").read_text()) for r in range(NPROCS)}
    left = max(t["rendezvous"] for t in tr.values())
    first = min(t["gets"][0] for t in tr.values() if t["gets"])
    return "; ".join(f"rank {r}: iter {1000 * (t['iter'] - left):.0f}, GET "
                     + (f"{1000 * (t['gets'][0] - first):.0f}" if t["gets"] else "-")
                     + (f" (own iter +{1000 * (t['gets'][0] - t['iter']):.0f})" if t["gets"] else "")
                     + f", batch 0 at iter +{1000 * (t['batches'][0] - t['iter']):.0f}"
                     + f", wait {1000 * waits[r][1]:.0f}" for r, t in tr.items())


def measured(index: str, reference: Path, root: Path, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    state, cache = root / f"state-{tag}", root / f"cache-{tag}"
    state.mkdir()
    job = nodejob.Job(["--index", index, "--reference", str(reference), "--cache-dir", str(cache), "--state", str(state),
                       "--epochs", str(args.epochs), "--workers", str(args.workers), "--cp", "1",
                       "--batch-size", str(args.batch_size), "--seed", "5", "--window", "2",
                       "--block-bytes", str(args.block_bytes), "--locality", args.locality,
                       "--local-world-size", str(PER_NODE), "--lockstep", "--step-ms", str(args.step_ms)],
                      NPROCS, run=tag, timeout=600, script=Path(__file__) if args.trace else nodejob.HERE,
                      env={"SIMBENCH_TRACE": "1"} if args.trace else None).start()
    if job.wait() != [0] * NPROCS:
        raise SystemExit(f"{tag}: the job failed:\n{job.outputs()}")
    logs = nodejob.logs(state, NPROCS)
    steps = min(len(v) for v in logs.values())
    wait = [max(logs[r][s]["wait"] for r in logs) for s in range(steps)]
    stalled = [(s, wait[s]) for s in range(1, steps) if wait[s] * 1000 > args.stall_ms]
    return {"first_batch_s": wait[0], "stall_share": len(stalled) / max(steps - 1, 1), "stalls": len(stalled),
            "stalled": stalled,
            "starts": starts(state, {r: [e["wait"] for e in v] for r, v in logs.items()}) if args.trace else ""}


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
    ap.add_argument("--trace", action="store_true", help="time each rank's start and GETs (see above)")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="wds_pad_simbench_"))
    try:
        www = root / "www"
        make_blob_shards(www / "d", samples=args.samples, sample_bytes=args.sample_bytes, shards=args.shards, seed=1)
        names = sorted(p.name for p in (www / "d").glob("*.tar"))
        rows, stalled, traced = [], [], []
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
                    traced.append(f"  {ms:g} ms: {m['starts']}")
            finally:
                proxy.stop()
        print(table(["latency", "first batch s, sim", "measured", "ratio", "stall share, sim", "measured", "ratio",
                     "GETs, sim", "counted", "wall s"], rows))
        print("\nthe job's stalled steps (the slowest rank's wait):", *stalled, sep="\n")
        if args.trace:
            print("\neach rank's start (ms): iter() after the rendezvous, its first GET after the job's first; "
                  "its wait at step 1:", *traced, sep="\n")
        print("\ntarget: each ratio within 0.85-1.15")
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(traced_rank() if os.environ.get("SIMBENCH_TRACE") else main())
