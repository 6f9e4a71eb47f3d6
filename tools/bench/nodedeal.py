"""Benchmark: what ``locality="node"`` reads from other nodes, epoch after epoch (plans only).

The dataset of docs/object-storage.md (10^5 samples of 100 KB in 200 shards of 50 MB, 20
Zipf buckets; each sample a token cost of 64-1023), planned for node 0's processes at dp
8, 16, 32 and 64 with 8 (and 4) DP ranks a node, window 8, seed 11, under three sizings:
a fixed batch (32), a budget (``Budget(17408)``, about 32 samples) and packs
(``Pack(4096, packs=4)``). For each, from the plans alone (``wds_pad.core.local.simulate``,
the figures ``wds-pad simulate`` prints; one GET a shard fetched whole):

* **dealt**: the shards dealt to node 0;
* **GETs/dealt e0**: node 0's GETs in epoch 0 per shard dealt to it (1.00: each of its
  shards once and nothing from other nodes);
* **foreign**: the other nodes' shards node 0 reads in epoch 0;
* **new later**: the other nodes' shards it reads in epochs 1..E-1 that no earlier epoch
  read, as a share of the shards dealt to it (what its cache folder has not kept);
* **GETs later**: its GETs in epochs 1..E-1 (a node holds every other node's shard it
  reads, so a shard read again costs nothing).

``--baseline REV`` measures the same in the same run with the planner of another
revision (exported with ``git archive``) and prints both, side by side.

Usage::

    python tools/bench/nodedeal.py [--epochs 3] [--dp 8 16 32 64] [--local 8 4] [--baseline REV]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

from _common import TOOLS, parser, table  # first: tools/ on sys.path

ROOT = TOOLS.parent


def _dataset() -> tuple[Any, Any, Any, Any]:
    import numpy as np

    from wds_pad import Dataset, ShardMap

    rng = np.random.default_rng(0)
    zipf = 1.0 / np.arange(1, 21) ** 1.2
    bucket = rng.choice(20, size=10**5, p=zipf / zipf.sum())  # the same data as the docs
    cost = rng.integers(64, 1024, size=10**5)
    shard = np.repeat(np.arange(200), 500)
    ds = Dataset("d", {k: np.flatnonzero(bucket == k) for k in range(20)}, cost=cost)
    return ShardMap(ds, shard), shard, np.full(10**5, 100_000), np.full(200, 500 * 100_000)


def measure(dps: list[int], locals_: list[int], epochs: int) -> list[dict[str, Any]]:
    """One row per (ranks a node, dp, sizing): node 0's figures."""
    import numpy as np

    from wds_pad import Budget, DroppedBucketWarning, Pack, Topology, plan_epoch
    from wds_pad.core.local.simulate import simulate

    sm, shard, sample_bytes, shard_bytes = _dataset()
    sizings = {"batch 32": 32, "budget 17408": Budget(17408), "pack 4x4096": Pack(4096, packs=4)}
    rows = []
    for local in locals_:
        for dp in dps:
            if dp % local:
                continue
            for name, size in sizings.items():
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DroppedBucketWarning)
                    plans = [[plan_epoch(sm, Topology(dp, r, local_world_size=local), seed=11, epoch=e,
                                         batch_size=size, locality="node", window=8) for r in range(local)]
                             for e in range(epochs)]
                mine = set(plans[0][0].buckets.local.rank_shards(0).tolist())
                sim = simulate([[node] for node in plans], [shard], [sample_bytes], [shard_bytes], 64 << 20)
                gets = sim.nodes[0]
                read = [set(shard[np.concatenate([p.samples for p in node])].tolist()) - mine for node in plans]
                seen, new = set(read[0]), 0
                for r in read[1:]:
                    new += len(r - seen)
                    seen |= r
                rows.append({"local": local, "dp": dp, "sizing": name, "dealt": len(mine),
                             "gets0": gets[0].gets, "foreign": len(read[0]), "new_later": new,
                             "gets_later": sum(c.gets for c in gets[1:])})
    return rows


def _baseline(rev: str, argv: list[str]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="nodedeal-") as tmp:
        archive = subprocess.run(["git", "archive", rev, "wds_pad"], cwd=ROOT, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        env = dict(os.environ, WDS_PAD_TREE=tmp)
        out = subprocess.run([sys.executable, __file__, *argv, "--json"], env=env, capture_output=True,
                             text=True, check=True).stdout
    return json.loads(out)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--dp", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--local", type=int, nargs="+", default=[8, 4])
    p.add_argument("--baseline", default=None, help="a revision whose planner is measured beside this tree's")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args()
    if os.environ.get("WDS_PAD_TREE"):  # a baseline run: that tree's wds_pad first
        sys.path.insert(0, os.environ["WDS_PAD_TREE"])
    argv = ["--epochs", str(args.epochs), "--dp", *map(str, args.dp), "--local", *map(str, args.local)]
    base = _baseline(args.baseline, argv) if args.baseline else None
    rows = measure(args.dp, args.local, args.epochs)
    if args.json:
        print(json.dumps(rows))
        return

    def cells(r: dict[str, Any]) -> list[str]:
        return [f"{r['gets0'] / r['dealt']:.2f}", str(r["foreign"]),
                f"{r['new_later']} ({100 * r['new_later'] / r['dealt']:.0f}%)", str(r["gets_later"])]

    heads = ["GETs/dealt e0", "foreign", f"new later (e1-{args.epochs - 1})", "GETs later"]
    headers = ["ranks/node", "dp", "sizing", "dealt"] + heads
    if base is not None:
        headers = headers[:4] + [f"{h} {args.baseline}" for h in heads] + heads
    out = []
    for i, r in enumerate(rows):
        row = [str(r["local"]), str(r["dp"]), r["sizing"], str(r["dealt"])]
        out.append(row + (cells(base[i]) if base is not None else []) + cells(r))
    print(f"node 0 of locality='node', {args.epochs} epochs, window 8, seed 11; one GET a shard fetched whole")
    print(table(headers, out))


if __name__ == "__main__":
    main()
