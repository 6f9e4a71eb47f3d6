"""``wds-pad demo``: the planner on a realistic simulated job.

Several strongly skewed buckets, 8 ranks with context-parallel size 2; prints the
per-bucket summary and checks the invariants on the spot.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from .plan import Dataset, plan_epoch
from .topology import Topology

SIMULATED_BUCKETS = {"1:1": 5400, "4:3": 2300, "3:4": 1150, "16:9": 610, "9:16": 170, "21:9": 23, "1:3": 0}


def run_demo(args: argparse.Namespace) -> int:
    out = sys.stdout
    start, buckets = 0, {}
    for key, n in SIMULATED_BUCKETS.items():
        buckets[key] = np.arange(start, start + n)
        start += n
    ds = Dataset("images", buckets)
    from .cli import _print_summary

    plans = []
    for rank in range(args.world_size):
        topo = Topology(world_size=args.world_size, rank=rank, cp_size=args.cp_size)
        plans.append(plan_epoch(ds, topo, seed=args.seed, epoch=0, batch_size=args.batch_size,
                                oversubscribe=True, warn=False))
    out.write("simulated job: " + ", ".join(f"{k}={v}" for k, v in SIMULATED_BUCKETS.items()) + "\n\n")
    _print_summary(plans[0], out)
    counts = {len(p) for p in plans}
    same_buckets = all(np.array_equal(p.schedule, plans[0].schedule) for p in plans)
    cp_equal = all(np.array_equal(plans[r].samples, plans[r - r % args.cp_size].samples)
                   for r in range(args.world_size))
    out.write(f"\nper rank: {', '.join(f'rank {p.topology.rank} -> {len(p)} batches' for p in plans)}\n")
    out.write(f"equal batch counts: {len(counts) == 1}; same bucket at every step: {same_buckets}; "
              f"CP peers identical: {cp_equal}\n")
    return 0 if len(counts) == 1 and same_buckets and cp_equal else 1
