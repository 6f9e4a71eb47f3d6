"""Benchmark: batches by a cost budget against a fixed batch size, on length-skewed data.

A corpus of ``--samples`` token counts drawn log-normally (median ``e^--mu``, ``--sigma``,
clipped to [16, ``--max-len``]) in 5 length buckets (edges 256, 512, 1024, 2048) is planned
for one epoch on ``--dp`` DP ranks two ways, for both budget models:

* ``budget``: ``batch_size=Budget(--budget, model)``;
* ``fixed batch`` (the peer): the largest fixed ``batch_size`` with which no batch can
  exceed the budget (``floor(budget / longest sample)``), what one batch size for every
  bucket forces.

For each it prints the steps per epoch, the mean fill (a rank's batch cost over the
budget, padded copies included), the padding waste (1 - fill), the worst balance (the
costliest DP rank's batch at a step over that step's mean), and the ratios budget /
fixed. Then the planning cost of one rank at ``--huge`` samples (10^8) and
``--huge-dp`` ranks (10^4): ``plan_epoch`` + the first batch, wall seconds and extra peak
RSS, beside the same for a fixed batch size in the same run (each in a fresh process),
against the rank goal of tools/bench/scale.py (<= 0.3 s, <= 64 MB). Usage::

    python tools/bench/budget.py [--samples 200000] [--dp 8] [--budget 16384] [--huge 1e8] [--huge-dp 10000]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import numpy as np
from _common import PeakRss, parser, table

from wds_pad import Budget, Dataset, Topology, plan_epoch
from wds_pad.core.budgets.budget import batch_cost

EDGES = (256, 512, 1024, 2048)


def corpus(samples: int, mu: float, sigma: float, max_len: int, seed: int = 0) -> tuple[Dataset, np.ndarray]:
    """Token counts and a Dataset of 5 length buckets whose ids are sorted by cost inside
    each bucket (as an index with costs stores its cost order)."""
    rng = np.random.default_rng(seed)
    cost = np.clip(rng.lognormal(mu, sigma, samples), 16, max_len).astype(np.float32)
    band = np.searchsorted(np.asarray(EDGES), cost, side="right")
    buckets = {f"<{EDGES[b]}" if b < len(EDGES) else f">={EDGES[-1]}": np.flatnonzero(band == b)
               for b in range(len(EDGES) + 1)}
    return Dataset("tokens", buckets, cost=cost), cost


def measure(ds: Dataset, cost: np.ndarray, dp: int, batch: Any, model: str) -> dict[str, float]:
    """Steps, mean fill and worst balance of one epoch over every DP rank."""
    plans = [plan_epoch(ds, Topology(dp, d), seed=1, batch_size=batch, warn=False) for d in range(dp)]
    limit = batch.limit if isinstance(batch, Budget) else BUDGET
    per_step: dict[int, list[float]] = {}
    for plan in plans:
        for b in plan:
            per_step.setdefault(b.step, []).append(batch_cost(cost[b.samples], model))
    costs = np.asarray([c for v in per_step.values() for c in v])
    worst = max(max(v) / (sum(v) / len(v)) for v in per_step.values())
    return {"steps": plans[0].steps, "fill": float(costs.mean() / limit), "worst": worst,
            "over": int(np.count_nonzero(costs > limit))}


def huge_case(samples: int, dp: int, kind: str, budget: float) -> dict[str, Any]:
    """One rank's plan + first batch at ``samples`` samples on ``dp`` ranks (a fresh process)."""
    rng = np.random.default_rng(0)
    nb = 5
    sizes = np.diff(np.linspace(0, samples, nb + 1).astype(np.int64))
    cost = np.clip(rng.lognormal(6.0, 0.9, samples), 16, 8192).astype(np.float32)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    order = np.empty(samples, np.int64)  # each bucket's rows in cost order (what an index stores)
    for b in range(nb):
        lo, hi = int(bounds[b]), int(bounds[b + 1])
        order[lo:hi] = lo + np.argsort(cost[lo:hi], kind="stable")
    buckets = {b: range(int(bounds[b]), int(bounds[b + 1])) for b in range(nb)}
    ds = Dataset("huge", buckets, cost=cost,
                 cost_order=lambda key: order[int(bounds[key]):int(bounds[key + 1])])
    batch: Any = Budget(budget) if kind == "budget" else max(1, int(budget // 8192))
    with PeakRss() as peak:
        t = time.perf_counter()
        plan = plan_epoch(ds, Topology(dp, dp // 3), seed=1, batch_size=batch, warn=False)
        plan[0]
        wall = time.perf_counter() - t
    return {"wall_s": wall, "extra_mb": peak.extra_mb, "steps": plan.steps, "batches": len(plan)}


def spawn(kind: str, args: Any) -> dict[str, Any]:
    code = (f"import sys, json; sys.path.insert(0, {str(sys.path[0])!r}); import budget as b; "
            f"print(json.dumps(b.huge_case({int(args.huge)}, {args.huge_dp}, {kind!r}, {args.budget})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"the {kind} case failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


BUDGET = 16384.0


def main() -> None:
    global BUDGET
    p = parser(__doc__)
    p.add_argument("--samples", type=int, default=200_000)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--budget", type=float, default=16384)
    p.add_argument("--mu", type=float, default=6.0)
    p.add_argument("--sigma", type=float, default=0.9)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--huge", type=float, default=1e8)
    p.add_argument("--huge-dp", type=int, default=10_000)
    args = p.parse_args()
    BUDGET = args.budget
    ds, cost = corpus(args.samples, args.mu, args.sigma, args.max_len)
    print(f"corpus: {args.samples} samples, median {np.median(cost):.0f} tokens, longest {cost.max():.0f}; "
          f"buckets {[int(v.size) for v in ds.buckets.values()]}; dp {args.dp}, budget {args.budget:g}")
    fixed = max(1, int(args.budget // float(cost.max())))
    rows = []
    for model in ("sum", "max"):
        ours = measure(ds, cost, args.dp, Budget(args.budget, model), model)
        peer = measure(ds, cost, args.dp, fixed, model)
        for name, m in ((f"budget ({model})", ours), (f"fixed batch {fixed} ({model})", peer)):
            rows.append([name, m["steps"], f"{100 * m['fill']:.1f}%", f"{100 * (1 - m['fill']):.1f}%",
                         f"{m['worst']:.3f}x", m["over"]])
        rows.append([f"  budget / fixed ({model})", f"{ours['steps'] / peer['steps']:.3f}x",
                     f"{ours['fill'] / peer['fill']:.2f}x", "", "", ""])
    print(table(["plan", "steps/epoch", "mean fill", "padding waste", "worst balance", "over budget"], rows,
                align="lrrrrr"))
    print("targets: mean fill >= 90% (sum); worst balance <= 1.10x (sum), <= 1.25x (max)")
    if args.huge:
        ours, peer = spawn("budget", args), spawn("fixed", args)
        print(table(["one rank at scale", "samples", "ranks", "wall s", "extra MB", "steps"],
                    [[name, f"{args.huge:.0e}", args.huge_dp, f"{m['wall_s']:.3f}", f"{m['extra_mb']:.0f}",
                      m["steps"]] for name, m in (("budget", ours), ("fixed batch", peer))], align="lrrrrr"))
        print(f"budget / fixed: {ours['wall_s'] / max(peer['wall_s'], 1e-9):.2f}x the time; "
              "target (tools/bench/scale.py, one rank): <= 0.3 s and <= 64 MB")


if __name__ == "__main__":
    main()
