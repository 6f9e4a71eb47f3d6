"""Benchmark: proportions by cost against weights, on two datasets of different lengths.

Two corpora of token counts drawn log-normally, a "short" one (``--short`` samples, median
about ``--short-median`` tokens) and a "long" one (``--long`` samples, median about
``--long-median`` tokens), are planned for one epoch on ``--dp`` DP ranks two ways:

* ``proportions``: ``Dataset(proportion=p)`` with ``--shares`` (default 1:1) and
  ``mix_by="cost"``: each corpus's share of the epoch's tokens is asked for;
* ``weights`` (the peer, what loaders that mix by weights give): the same shares given as
  ``weight``, the epoch the datasets as they are.

For each it prints every corpus's share of the epoch's tokens (padded copies included:
they are trained on), the asked share, the error relative to it (the goal: within 1%),
and the planning time of one rank (``plan_epoch``, wall seconds), with the ratio
proportions / weights measured in the same run. Usage::

    python tools/bench/proportions.py [--short 400000] [--long 50000] [--dp 8] [--shares 1,1]
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from _common import parser, table

from wds_pad import Dataset, Topology, plan_epoch


def corpus(name: str, n: int, median: float, seed: int, **kw: Any) -> Dataset:
    rng = np.random.default_rng(seed)
    tokens = np.clip(rng.lognormal(np.log(median), 0.8, n), 16, 8192).astype(np.int64)
    return Dataset(name, {"all": np.arange(n)}, cost=tokens, **kw)


def shares(dss: list[Dataset], dp: int, **kw: Any) -> tuple[dict[str, float], float]:
    """Each dataset's tokens over every rank's epoch, and one rank's planning seconds."""
    got = {ds.name: 0.0 for ds in dss}
    cost = {ds.name: ds.cost for ds in dss}
    seconds = 0.0
    for r in range(dp):
        t0 = time.perf_counter()
        plan = plan_epoch(dss, Topology(dp, r), seed=1, batch_size=32, warn=False, **kw)
        seconds = time.perf_counter() - t0 if r == 0 else seconds
        for b in plan:
            got[b.dataset] += float(cost[b.dataset][b.samples].sum())
    return got, seconds


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--short", type=int, default=400_000)
    p.add_argument("--long", type=int, default=50_000)
    p.add_argument("--short-median", type=float, default=200.0)
    p.add_argument("--long-median", type=float, default=2000.0)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--shares", default="1,1")
    args = p.parse_args()
    want = np.asarray([float(x) for x in args.shares.split(",")])
    want = want / want.sum()
    rows = []
    seconds = {}
    for how in ("proportions", "weights"):
        extra = [{"proportion": float(w)} if how == "proportions" else {"weight": float(w)} for w in want]
        dss = [corpus("short", args.short, args.short_median, 1, **extra[0]),
               corpus("long", args.long, args.long_median, 2, **extra[1])]
        got, seconds[how] = shares(dss, args.dp, **({"mix_by": "cost"} if how == "proportions" else {}))
        total = sum(got.values())
        for ds, w in zip(dss, want):
            share = got[ds.name] / total
            rows.append([how, ds.name, f"{got[ds.name]:.4g}", f"{share:.4f}", f"{w:.4f}",
                         f"{100 * abs(share - w) / w:.2f}%", f"{seconds[how]:.3f}"])
    print(table(["mix", "dataset", "tokens", "share", "asked", "error", "plan s (rank 0)"], rows))
    worst = max(float(r[5].rstrip("%")) for r in rows if r[0] == "proportions")
    print(f"proportions: worst share error {worst:.2f}% (goal <= 1%); planning time proportions / weights "
          f"{seconds['proportions'] / max(seconds['weights'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
