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

``--runs N`` runs the job N times at each latency (the model is pure: it is asked once) and
prints, after each run's row, the median run's figures against the model's and how many runs
were within 15 %: the start of a job of four processes on a shared machine varies by
hundreds of milliseconds from run to run, the model gives the typical one.

``--trace`` shows when each rank starts: each rank runs through :func:`traced_rank`, which
times (on the machine's clock) its rendezvous, its ``iter()``, every GET of a shard block it
sends and every batch it gets; printed per rank: ``iter()`` after the last rank left the
rendezvous, its first GET after the job's first, and its wait at step 1; and per job the
median time of a GET of a shard block from its send to its bytes (the proxy's latency plus
what the loopback server, the proxy and the client add: 2-3 ms here).

Usage::

    python tools/bench/simulate.py [--shards 16] [--samples 320] [--step-ms 100] [--locality shard] [--runs 1] [--trace]

Loopback only; nginx or the Python fallback.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
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

    rec: dict[str, Any] = {"gets": [], "took": [], "batches": []}
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
        sent = time.time()
        rec["gets"].append(sent)
        fut = get_block(self, url, start, length)
        fut.add_done_callback(lambda _: rec["took"].append(time.time() - sent))
        return fut

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


def get_times(state: Path) -> list[float]:
    """Every GET's time in the job, every rank's: from its send to its bytes (seconds)."""
    return [x for r in range(NPROCS) for x in json.loads((state / f"trace-{r}.json").read_text())["took"]]


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
            "starts": starts(state, {r: [e["wait"] for e in v] for r, v in logs.items()}) if args.trace else "",
            "get_s": get_times(state) if args.trace else []}


def _ratio(p: float, m: float) -> str:
    return f"{p / m:.2f}" if m > 0 else ("1.00" if p == 0 else "inf")


def _within(p: float, m: float) -> bool:
    """Whether the model's figure is within 15 % of the measured one (both 0 agree)."""
    return p == m == 0 or (m > 0 and 0.85 <= p / m <= 1.15)


HEADERS = ["latency", "first batch s, sim", "measured", "ratio", "stall share, sim", "measured", "ratio",
           "GETs, sim", "counted", "wall s"]


def _row(label: str, p: dict[str, Any], m: dict[str, Any]) -> list[str]:
    """One row of the table: the model's figures (``p``) beside a measured job's (``m``)."""
    return [label, f"{p['first_batch_s']:.3f}", f"{m['first_batch_s']:.3f}", _ratio(p["first_batch_s"], m["first_batch_s"]),
            f"{p['stall_share']:.3f}", f"{m['stall_share']:.3f}", _ratio(p["stall_share"], m["stall_share"]),
            f"{sum(p['gets_per_epoch'])}", f"{m['gets']:g}", f"{m['wall']:.0f}"]


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
    ap.add_argument("--runs", type=int, default=1, help="jobs at each latency: each one's row, then their median's")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="wds_pad_simbench_"))
    try:
        www = root / "www"
        make_blob_shards(www / "d", samples=args.samples, sample_bytes=args.sample_bytes, shards=args.shards, seed=1)
        names = sorted(p.name for p in (www / "d").glob("*.tar"))
        rows, stalled, traced, took, medians, hits = [], [], [], [], [], [0, 0, 0]
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
                    p = predicted(index, args, ms)
                    runs = []
                    for k in range(args.runs):
                        proxy.reset_counters()
                        t = time.perf_counter()
                        m = measured(index, www / "d", root, args, f"{ms:g}-{k}")
                        m["gets"], m["wall"] = proxy.requests_seen, time.perf_counter() - t
                        runs.append(m)
                        label = f"{ms:g} ms" + (f", run {k + 1}" if args.runs > 1 else "")
                        rows.append(_row(label, p, m))
                        waits = ", ".join(f"{s} ({w * 1000:.0f} ms)" for s, w in m["stalled"]) or "none"
                        stalled.append(f"  {label}: {waits}")
                        traced.append(f"  {label}: {m['starts']}")
                        if m["get_s"]:
                            took.append(f"  {label}: median {1000 * statistics.median(m['get_s']):.1f} ms over "
                                        f"{len(m['get_s'])} GETs, the proxy's latency + "
                                        f"{1000 * statistics.median(m['get_s']) - ms:.1f} ms")
                    if args.runs > 1:
                        med = {key: statistics.median(r[key] for r in runs) for key in ("first_batch_s", "stall_share")}
                        medians.append(_row(f"{ms:g} ms", p, {**med, "gets": statistics.median(r["gets"] for r in runs),
                                                             "wall": sum(r["wall"] for r in runs)}))
                        hits[0] += sum(_within(p["first_batch_s"], r["first_batch_s"]) for r in runs)
                        hits[1] += sum(_within(p["stall_share"], r["stall_share"]) for r in runs)
                        hits[2] += len(runs)
            finally:
                proxy.stop()
        print(table(HEADERS, rows))
        if medians:
            print(f"\nthe median of {args.runs} runs at each latency (GETs: the median count; wall s: all runs):")
            print(table(HEADERS, medians))
            print(f"\nruns within 15 %: first batch {hits[0]} of {hits[2]}, stall share {hits[1]} of {hits[2]}")
        print("\nthe job's stalled steps (the slowest rank's wait):", *stalled, sep="\n")
        if args.trace:
            print("\neach rank's start (ms): iter() after the rendezvous, its first GET after the job's first; "
                  "its wait at step 1:", *traced, sep="\n")
            print("\neach GET's time in the job, from its send to its bytes:", *took, sep="\n")
        print("\ntarget: each ratio within 0.85-1.15")
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(traced_rank() if os.environ.get("SIMBENCH_TRACE") else main())
