"""Benchmark: packed batches planned ahead against an online greedy packer, fixed batches and budgets.

A corpus of ``--samples`` token counts drawn log-normally (median ``--median``, sigma
``--sigma``, clipped to [1, ``--longest``]), each from one of ``--sources`` sources (of
different median lengths), is planned for one epoch on ``--dp`` DP ranks, for each
``--seq-len`` (8192 and 4096; a sample longer than L travels alone, cut to L):

* ``pack``: ``batch_size=Pack(L, packs=B)`` over one bucket, over buckets by source, and
  over 5 length bands (what docs/packing.md warns against);
* ``online greedy`` (the peer, written here as Megatron-Energon describes its packing):
  the samples in a shuffled stream fill a buffer of ``--buffer`` (1,000) samples; the
  buffer is packed greedily, first fit in arrival order, and every pack it made is
  emitted. Run once over the whole stream (its fill) and once per DP rank over that
  rank's share (its steps per rank);
* ``fixed batch``: the largest batch size that can never exceed B x L tokens
  (``B * L // longest``), one bucket; ``budget``: ``Budget(B * L)``, one bucket.

Printed per plan: batches (steps) per rank, the fill of real tokens (real tokens / (packs
x L); for fixed batches and budgets, / (batches x B x L)), padded copies not counted; the
steps balance (most steps of a rank over fewest) and the token balance (per step, the
fullest rank's tokens over the step's mean: mean and worst). Ratios are ours over the
peer in the same run. Then one rank's planning time and extra peak RSS at ``--huge``
samples (10^8) on ``--huge-dp`` ranks (10^4), against a budget in the same run (each in a
fresh process); targets: fill >= 0.97, ours >= the online packer's, steps balance <= 1.02,
one rank <= 0.3 s and <= 64 MB (tools/bench/scale.py). Usage::

    python tools/bench/packing.py [--samples 1000000] [--dp 8] [--packs 4] [--huge 1e8] [--huge-dp 10000]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import numpy as np
from _common import PeakRss, parser, table

from wds_pad import Budget, Dataset, Pack, Topology, plan_epoch

EDGES = (256, 512, 1024, 2048)


def corpus(samples: int, median: float, sigma: float, longest: int, sources: int, seed: int = 0
           ) -> tuple[np.ndarray, np.ndarray]:
    """Token counts and each sample's source (source s has median ``median * 0.6 ** s``... normalised)."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, sources, samples)
    scale = np.asarray([1.6, 1.0, 0.6, 0.35][:sources] if sources <= 4 else np.ones(sources))
    scale = scale / np.exp(np.mean(np.log(scale)))
    cost = np.clip(np.round(rng.lognormal(np.log(median), sigma, samples) * scale[src]), 1, longest)
    return cost.astype(np.float32), src


def datasets(cost: np.ndarray, src: np.ndarray) -> dict[str, Dataset]:
    band = np.searchsorted(np.asarray(EDGES), cost, side="right")
    return {"one bucket": Dataset("t", {0: np.arange(cost.size)}, cost=cost),
            "by source": Dataset("t", {int(s): np.flatnonzero(src == s) for s in np.unique(src)}, cost=cost),
            "length bands": Dataset("t", {int(b): np.flatnonzero(band == b) for b in np.unique(band)}, cost=cost)}


def measure(ds: Dataset, cost: np.ndarray, dp: int, sizing: Any, seq_len: int, packs: int) -> dict[str, float]:
    """Batches per rank, fill of real tokens, steps and token balance over every DP rank."""
    clipped = np.minimum(cost.astype(np.float64), seq_len)
    real = 0.0
    per_rank = []
    counts = []
    for d in range(dp):
        plan = plan_epoch(ds, Topology(dp, d), seed=1, batch_size=sizing, warn=False)
        c = clipped[plan.samples]
        real += float(c[~plan.pad].sum())
        per_rank.append(np.add.reduceat(c, plan.offsets[:-1]) if len(plan) else np.zeros(0))
        counts.append(len(plan))
    batches = max(counts)
    fill = real / (sum(counts) * packs * seq_len)
    steps = np.stack([np.pad(r, (0, batches - r.size)) for r in per_rank])
    bal = steps.max(axis=0) / np.maximum(steps.mean(axis=0), 1e-9)
    return {"batches": batches, "fill": fill, "steps_balance": max(counts) / max(min(counts), 1),
            "tokens_mean": float(bal.mean()), "tokens_worst": float(bal.max())}


def online_greedy(lengths: np.ndarray, seq_len: int, buffer: int) -> tuple[int, float]:
    """The peer: (packs, real tokens) of greedy first fit over a buffer of ``buffer`` samples
    of the stream, every pack of a buffer emitted when it is full."""
    lengths = np.minimum(lengths.astype(np.float64), seq_len)
    packs = 0
    for lo in range(0, lengths.size, buffer):
        room = np.empty(0)
        for x in lengths[lo:lo + buffer].tolist():
            fits = np.flatnonzero(room >= x)
            if fits.size:
                room[fits[0]] -= x
            else:
                room = np.append(room, seq_len - x)
        packs += room.size
    return packs, float(lengths.sum())


def huge_case(samples: int, dp: int, kind: str, seq_len: int, packs: int, sources: int) -> dict[str, Any]:
    """One rank's plan + first batch at ``samples`` samples on ``dp`` ranks (a fresh process)."""
    rng = np.random.default_rng(0)
    sizes = np.diff(np.linspace(0, samples, sources + 1).astype(np.int64))
    cost = np.clip(np.round(rng.lognormal(np.log(400), 1.0, samples)), 1, seq_len).astype(np.float32)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    order = np.empty(samples, np.int64)  # each bucket's rows in cost order (what an index stores)
    for b in range(sources):
        lo, hi = int(bounds[b]), int(bounds[b + 1])
        order[lo:hi] = lo + np.argsort(cost[lo:hi], kind="stable")
    buckets = {b: range(int(bounds[b]), int(bounds[b + 1])) for b in range(sources)}
    ds = Dataset("huge", buckets, cost=cost, cost_order=lambda key: order[int(bounds[key]):int(bounds[key + 1])])
    sizing: Any = Pack(seq_len, packs=packs) if kind == "pack" else Budget(seq_len * packs)
    with PeakRss() as peak:
        t = time.perf_counter()
        plan = plan_epoch(ds, Topology(dp, dp // 3), seed=1, batch_size=sizing, warn=False)
        plan[0]
        wall = time.perf_counter() - t
    return {"wall_s": wall, "extra_mb": peak.extra_mb, "steps": plan.steps}


def spawn(kind: str, args: Any) -> dict[str, Any]:
    code = (f"import sys, json; sys.path.insert(0, {str(sys.path[0])!r}); import packing as p; "
            f"print(json.dumps(p.huge_case({int(args.huge)}, {args.huge_dp}, {kind!r}, 8192, {args.packs}, "
            f"{args.sources})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"the {kind} case failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--samples", type=int, default=1_000_000)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--packs", type=int, default=4, help="packs per batch (B)")
    p.add_argument("--seq-len", default="8192,4096")
    p.add_argument("--median", type=float, default=400)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--longest", type=int, default=8192)
    p.add_argument("--sources", type=int, default=4)
    p.add_argument("--buffer", type=int, default=1000)
    p.add_argument("--huge", type=float, default=1e8)
    p.add_argument("--huge-dp", type=int, default=10_000)
    args = p.parse_args()
    cost, src = corpus(args.samples, args.median, args.sigma, args.longest, args.sources)
    dss = datasets(cost, src)
    print(f"corpus: {args.samples} samples, median {np.median(cost):.0f} tokens, longest {cost.max():.0f}; "
          f"{args.sources} sources; dp {args.dp}, {args.packs} packs per batch")
    stream = cost[np.random.default_rng(1).permutation(cost.size)]
    for L in (int(x) for x in args.seq_len.split(",")):
        rows = []
        t = time.perf_counter()
        peer_packs, peer_tokens = online_greedy(stream, L, args.buffer)
        peer_fill = peer_tokens / (peer_packs * L)
        shares = [online_greedy(stream[d::args.dp], L, args.buffer)[0] // args.packs for d in range(args.dp)]
        peer_s = time.perf_counter() - t
        ours = {}
        for name, ds in dss.items():
            ours[name] = measure(ds, cost, args.dp, Pack(L, packs=args.packs, oversize="alone"), L, args.packs)
        fixed = measure(dss["one bucket"], cost, args.dp, max(1, args.packs * L // args.longest), L, args.packs)
        budget = measure(dss["one bucket"], cost, args.dp, Budget(args.packs * L), L, args.packs)
        for name, m in [*((f"pack, {k}", v) for k, v in ours.items()),
                        (f"fixed batch {max(1, args.packs * L // args.longest)}", fixed),
                        (f"budget {args.packs * L}", budget)]:
            rows.append([name, m["batches"], f"{m['fill']:.4f}", f"{m['steps_balance']:.3f}",
                         f"{m['tokens_mean']:.3f} / {m['tokens_worst']:.3f}"])
        rows.append([f"online greedy, buffer {args.buffer}", f"{max(shares)}", f"{peer_fill:.4f}",
                     f"{max(shares) / max(min(shares), 1):.3f}", "-"])
        print(f"\nL = {L}")
        print(table(["plan", "batches/rank", "fill", "steps balance", "token balance mean / worst"], rows,
                    align="lrrrr"))
        for k in ("one bucket", "by source"):
            print(f"pack ({k}) / online greedy: fill {ours[k]['fill'] / peer_fill:.4f}x")
        print(f"pack (one bucket) / fixed batch: fill {ours['one bucket']['fill'] / fixed['fill']:.2f}x; "
              f"/ budget: {ours['one bucket']['fill'] / budget['fill']:.3f}x (online packer ran {peer_s:.1f} s)")
    print("targets: fill >= 0.97 and >= the online packer's; steps balance <= 1.02")
    if args.huge:
        ours_h, peer_h = spawn("pack", args), spawn("budget", args)
        print(table(["one rank at scale", "samples", "ranks", "wall s", "extra MB", "steps"],
                    [[name, f"{args.huge:.0e}", args.huge_dp, f"{m['wall_s']:.3f}", f"{m['extra_mb']:.0f}",
                      m["steps"]] for name, m in (("pack 8192", ours_h), ("budget", peer_h))], align="lrrrrr"))
        print(f"pack / budget: {ours_h['wall_s'] / max(peer_h['wall_s'], 1e-9):.2f}x the time; "
              "target (tools/bench/scale.py, one rank): <= 0.3 s and <= 64 MB")


if __name__ == "__main__":
    main()
