"""Benchmark: plan one rank's epoch with the vectorised planner vs the pure-list reference.

Each case (implementation x size) runs in its own subprocess, so one case's memory never
inflates another's. A case builds a synthetic dataset (1,000 buckets of skewed,
log-normal sizes, ids shuffled), then times two phases:

- ``build``: the Dataset construction (sorting every bucket's ids);
- ``plan``:  planning one rank's epoch (dp_size 1,024, batch 4, oversubscribe on so no
  bucket is dropped, cyclic padding).

Times are CPU seconds of this process (both planners are single-threaded, so on an idle
machine they equal wall time; on a shared one they are not inflated by other
processes), the best of ``--repeat`` untraced runs (the list version above 10^6 samples
runs once); peak memory of each phase is measured with tracemalloc in one more pass
(numpy reports its buffers to tracemalloc). The list reference runs
on the largest size only if its time, extrapolated linearly from the previous size,
stays under ``--list-limit`` seconds; otherwise the table says so.

Usage::

    python tools/bench/plan.py                     # 10^6 and 10^7 samples
    python tools/bench/plan.py --sizes 1e5,1e6     # smaller, quicker
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tracemalloc
import warnings
from typing import Any, Callable

import numpy as np
from _common import Columns, add_repeat, once, parser

SEED = 20240601


def bucket_sizes(total: int, buckets: int) -> np.ndarray:
    """Skewed sizes: log-normal weights (sigma 1.5), at least 1 sample each, summing to total."""
    rng = np.random.default_rng(0)
    w = rng.lognormal(0.0, 1.5, size=buckets)
    sizes = np.maximum(1, np.floor(w / w.sum() * (total - buckets))).astype(np.int64) + 0
    sizes[np.argmax(sizes)] += total - int(sizes.sum())
    return sizes


def make_inputs(total: int, buckets: int) -> list[np.ndarray]:
    ids = np.random.default_rng(1).permutation(total).astype(np.int64)
    return np.split(ids, np.cumsum(bucket_sizes(total, buckets))[:-1])


def _measure(fn: Callable[[], Any], memory: bool) -> tuple[Any, float]:
    """Run fn once; return (result, seconds) or, with memory, (result, peak MB)."""
    if memory:
        tracemalloc.start()
        tracemalloc.reset_peak()
        result = fn()
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        return result, peak
    t = once(fn)  # CPU time: both planners are single-threaded, and CPU time is not
    return t.result, t.cpu  # inflated by other processes on a shared machine


def run_case(impl: str, total: int, buckets: int, dp: int, batch: int, repeat: int) -> dict[str, Any]:
    from wds_pad import Dataset, Topology, plan_epoch

    parts = make_inputs(total, buckets)
    rank = dp // 2 + 1  # any rank: every rank does the same work
    out: dict[str, Any] = {"impl": impl, "total": total, "build_s": float("inf"), "plan_s": float("inf")}
    for memory in [False] * repeat + [True]:
        if impl == "numpy":
            ds, build = _measure(lambda: Dataset("bench", {i: p for i, p in enumerate(parts)}), memory)
            topo = Topology(world_size=dp, rank=rank)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan, run = _measure(lambda: plan_epoch(ds, topo, seed=SEED, batch_size=batch, policy="cyclic",
                                                        oversubscribe=True, warn=False), memory)
            batches, entries = len(plan), int(plan.samples.size)
        else:
            from _plan_lists import ListDataset, plan_epoch_lists

            raw = [p.tolist() for p in parts]
            lds, build = _measure(lambda: ListDataset("bench", {i: sorted(p) for i, p in enumerate(raw)}), memory)
            ref, run = _measure(lambda: plan_epoch_lists([lds], world_size=dp, rank=rank, seed=SEED,
                                                         batch_size=batch, policy="cyclic", oversubscribe=True),
                                memory)
            batches, entries = len(ref.batches), sum(len(b[3]) for b in ref.batches)
            del raw
        if memory:
            out["build_mb"], out["plan_mb"] = build, run
        else:  # best of `repeat` untraced runs: the least disturbed by other processes
            out["build_s"], out["plan_s"] = min(out["build_s"], build), min(out["plan_s"], run)
        out["batches"], out["entries"] = batches, entries
    return out


def spawn(impl: str, total: int, args: argparse.Namespace, timeout: float) -> dict[str, Any] | None:
    repeat = args.repeat if impl == "numpy" or total <= 10**6 else 1
    cmd = [sys.executable, __file__, "--case", impl, str(total), "--buckets", str(args.buckets),
           "--dp", str(args.dp), "--batch-size", str(args.batch_size), "--repeat", str(repeat)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--sizes", default="1e6,1e7", help="comma-separated sample counts")
    p.add_argument("--buckets", type=int, default=1000)
    p.add_argument("--dp", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4)
    add_repeat(p, 3, help="timed runs per case, best kept (the list version above 10^6 runs once)")
    p.add_argument("--list-limit", type=float, default=60.0, help="max predicted seconds for the list version")
    p.add_argument("--case", nargs=2, metavar=("IMPL", "TOTAL"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        impl, total = args.case
        print(json.dumps(run_case(impl, int(total), args.buckets, args.dp, args.batch_size, args.repeat)))
        return 0

    sizes = [int(float(s)) for s in args.sizes.split(",")]
    print(f"one rank's epoch: {args.buckets} buckets (log-normal sizes), dp_size {args.dp}, "
          f"batch {args.batch_size}, cyclic + oversubscribe; CPU s: best of {args.repeat} untraced runs, "
          "peak MB: tracemalloc")
    cols = Columns("{:>10}  {:<6} {:>8} {:>8} {:>8} {:>9} {:>8} {:>8}")
    print(cols.header("samples", "impl", "build s", "plan s", "total s", "build MB", "plan MB", "batches"))
    last_list: tuple[int, float] | None = None
    notes = []
    for total in sizes:
        fast = spawn("numpy", total, args, timeout=600)
        assert fast is not None
        slow = None
        predicted = None if last_list is None else last_list[1] * total / last_list[0]
        if predicted is None or predicted <= args.list_limit:
            slow = spawn("lists", total, args, timeout=max(4 * args.list_limit, 60))
            if slow is not None:
                last_list = (total, slow["build_s"] + slow["plan_s"])
                if (slow["batches"], slow["entries"]) != (fast["batches"], fast["entries"]):
                    notes.append(f"{total}: list and numpy plans differ in size!")
        else:
            notes.append(f"list version skipped at {total:.0e} samples: predicted {predicted:.0f} s "
                         f"> --list-limit {args.list_limit:.0f} s (ratios for it: see {last_list[0]:.0e})")  # type: ignore[index]
        for r in (fast, slow):
            if r is None:
                continue
            print(cols.line(f"{total:.0e}", r["impl"], f"{r['build_s']:.3f}", f"{r['plan_s']:.3f}",
                            f"{r['build_s'] + r['plan_s']:.3f}", f"{r['build_mb']:.1f}", f"{r['plan_mb']:.1f}",
                            r["batches"]))
        if slow is not None:
            ratio = lambda k: slow[k] / fast[k] if fast[k] else float("inf")  # noqa: E731
            tot = (slow["build_s"] + slow["plan_s"]) / (fast["build_s"] + fast["plan_s"])
            print(cols.line("", "ratio", *(f"{x:.1f}x" for x in (ratio("build_s"), ratio("plan_s"), tot,
                                                                  ratio("build_mb"), ratio("plan_mb")))))
    for note in notes:
        print("note:", note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
