"""``wds-pad inspect``: show an index's buckets and shards, optionally with the padding
a job would get and a plot of it.

Invariants:
- ``--json`` prints exactly one JSON object on stdout, and nothing else; with
  ``--locality`` its ``reading`` holds the figures the tables print (rank 0's, and node
  0's with ``--local-world-size``), per locality;
- the padding shown is what ``plan_epoch`` does with each bucket for the given job
  (it needs both ``--world-size`` and ``--batch-size``, else a usage error, exit 2);
- loading the index and planning its padding never import torch;
- ``--plot`` names a format matplotlib writes (PNG when it has no extension: the name
  printed is the file written), checked before the index is loaded;
- an index with costs shows each bucket's cost distribution (min / median / mean /
  max; the median and the dearest samples read from the stored cost order, nothing
  sorted), and with ``--budget B`` how many samples cost more than B, with their keys
  (they will travel alone in a batch); ``--json`` carries the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Hashable

from .common import (
    locality_arg,
    format_bytes,
    non_negative,
    positive_int,
    report_excluded,
    usage_error,
    add_relocate,
    bucket_order,
    check_node_layout,
    format_table,
    relocation,
)
from .plot import draw_buckets, plot_path
from .reading import print_reading, reading_figures, reading_json

__all__ = ["add_parser"]


def _json_key(key: Hashable) -> str:
    """A bucket key as a JSON object key (JSON keys are strings)."""
    return key if isinstance(key, str) else json.dumps(key if not isinstance(key, tuple) else list(key))



def add_parser(sub: Any) -> None:
    """Register the ``inspect`` subcommand."""
    p = sub.add_parser("inspect", help="show an index: buckets, shards, excluded samples",
                       description="Show an index's buckets and shards; optionally plot them with padding.")
    p.add_argument("index", metavar="INDEX", help="index file (path or URL)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--plot", metavar="FILE.png", help="bar chart of bucket sizes (needs matplotlib)")
    p.add_argument("--world-size", type=positive_int, help="with --batch-size: also show padding for this job")
    p.add_argument("--batch-size", type=positive_int, help="samples per batch per DP rank")
    p.add_argument("--cp-size", type=positive_int, default=1, help="context-parallel size (default 1)")
    p.add_argument("--seed", type=non_negative, default=0, help="plan seed (padding amounts do not depend on it)")
    p.add_argument("--pad", choices=["auto", "cyclic", "drop", "none"], default="auto", help="padding policy")
    p.add_argument("--repeats", type=non_negative, default=0)
    p.add_argument("--oversubscribe", action="store_true")
    p.add_argument("--proportions", type=float, metavar="P", help="the index's share of an epoch (one index: "
                   "with --epoch-size, the epoch it is planned to)")
    p.add_argument("--mix-by", choices=["samples", "cost"], default="samples", help="with --proportions")
    p.add_argument("--epoch-size", type=float, metavar="N", help="with --proportions: the epoch's samples (or cost)")
    p.add_argument("--locality", type=locality_arg, default=None,
                   help="with --world-size/--batch-size: also show what rank 0's epoch costs to read")
    p.add_argument("--window", type=positive_int, default=8, help="shards a rank visits at once (--locality shard)")
    p.add_argument("--budget", type=_budget_arg, metavar="B",
                   help="an index with costs: also count, per bucket, the samples dearer than B and name them "
                        "(each travels alone in a batch under a budget of B)")
    add_relocate(p)
    p.add_argument("--local-world-size", type=positive_int, metavar="L",
                   help="with --locality: processes per node; also show what node 0's epoch costs to read "
                        "when its processes share one copy of each shard")
    p.set_defaults(func=_cmd_inspect)


def _budget_arg(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


_KEYS_SHOWN, _KEYS_JSON = 5, 1000  # keys of samples over the budget: in a table, in --json


def _cost_stats(index: Any, budget: float | None) -> dict[Hashable, dict[str, Any]]:
    """Per bucket (table order) its cost distribution and, with ``budget``, the samples
    dearer than it (count, and keys dearest first: at most ``_KEYS_JSON``)."""
    import numpy as np

    cost, bo = index.cost, index.bucket_offsets
    sums = np.add.reduceat(cost.astype(np.float64), bo[:-1]) if len(index) else np.zeros(len(index.buckets))
    out: dict[Hashable, dict[str, Any]] = {}
    for b, key in enumerate(index.buckets):
        lo, hi = int(bo[b]), int(bo[b + 1])
        n = hi - lo
        if not n:
            out[key] = {"samples": 0}
            continue
        ends = index.cost_order(lo, hi, [0, (n - 1) // 2, n // 2, n - 1])
        low, mid1, mid2, high = (cost[i].item() for i in ends)
        stats: dict[str, Any] = {"samples": n, "min": low, "median": (mid1 + mid2) / 2 if n % 2 == 0 else mid1,
                                 "mean": float(sums[b]) / n, "max": high}
        if budget is not None:
            ranked = cost[index.cost_order(lo, hi)]  # cheapest first
            over = n - int(np.searchsorted(ranked, budget, side="right"))
            dear = index.cost_order(lo, hi, np.arange(n - 1, n - 1 - min(over, _KEYS_JSON), -1))
            stats["over_budget"] = {"count": over, "keys": [index.key(int(i)) for i in dear]}
        out[key] = stats
    return out


def _padding_stats(args: argparse.Namespace, index: Any) -> dict[Hashable, Any] | None:
    """Per bucket, what ``plan_epoch`` does with it for the given job, or None."""
    if args.world_size is None and args.batch_size is None:
        return None
    if args.world_size is None or args.batch_size is None:
        raise usage_error("inspect", "padding needs both --world-size and --batch-size")
    from ..core.planning.plan import plan_epoch
    from ..core.topology import Topology

    topo = Topology(world_size=args.world_size, rank=0, cp_size=args.cp_size)
    plan = plan_epoch(_dataset(index, args), topo, seed=args.seed, batch_size=args.batch_size,
                      policy=args.pad, oversubscribe=args.oversubscribe, warn=False, **_mixing(args))
    return {s.bucket: s for s in plan.stats}


def _summary(index: Any, pad: dict[Hashable, Any] | None, budget: float | None = None) -> dict[str, Any]:
    from ..index.layout import FORMAT_VERSION

    counts, sizes = index.bucket_counts(), index.bucket_bytes()
    per_shard = [s.samples for s in index.shards if s.size >= 0]
    record: dict[str, Any] = {
        "path": index.path, "name": index.name, "version": FORMAT_VERSION, "digest": index.digest,
        "bucket_by": dict(index.bucket_by), "exts": list(index.exts),
        "shards": len(index.shards), "samples": len(index),
        "bytes": int(sum(sizes.values())), "shard_bytes": int(sum(max(s.size, 0) for s in index.shards)),
        "min_samples_per_shard": min(per_shard, default=0), "max_samples_per_shard": max(per_shard, default=0),
        "buckets": {_json_key(k): v for k, v in counts.items()},
        "bucket_bytes": {_json_key(k): v for k, v in sizes.items()},
        "excluded": int(index.excluded.get("count", 0)),
        "skipped_shards": list(index.excluded.get("shards", [])),
        "excluded_samples": list(index.excluded.get("samples", [])),
    }
    missing, why = index.members_missing()
    record["without_member_table"] = {"samples": missing, "why": why}
    if index.cost is not None:
        record["cost"] = {"kind": index.cost_kind, "budget": budget,
                          "buckets": {_json_key(k): v for k, v in _cost_stats(index, budget).items()}}
    if pad is not None:
        record["padding"] = {_json_key(k): {"padded_length": s.padded_length, "padded_copies": s.padded_copies,
                                            "truncated": s.truncated, "dropped": s.dropped, "steps": s.steps}
                             for k, s in pad.items()}
    return record


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ..index.codec import load_index

    if args.local_world_size is not None and args.locality is None:
        raise usage_error("inspect", "--local-world-size L needs --locality (with --world-size and --batch-size): "
                                "it adds node 0's reading cost to the locality lines")
    if args.locality is not None:
        check_node_layout("inspect", args)
    if args.plot:  # a format matplotlib cannot write is refused before anything is loaded
        args.plot = plot_path(args.plot)
    index = load_index(args.index, relocate=relocation(args))
    if args.budget is not None and index.cost is None:
        raise usage_error("inspect", f"--budget needs an index with costs; {args.index} has none (build it with "
                                "`wds-pad index ... --cost json:FIELD|image:pixels|bytes`)")
    pad = _padding_stats(args, index)
    what_if = _what_if_locality(index, args) if pad is not None and args.locality is not None else None
    if args.plot:
        draw_buckets(index, pad, args, {name: f for name, (f, _) in what_if[1].items()} if what_if else None)
    if args.json:
        record = _summary(index, pad, args.budget)
        if what_if is not None:
            record["reading"] = reading_json(what_if[1])
        sys.stdout.write(json.dumps(record) + "\n")
        return 0
    _print_tables(index, pad, args, sys.stdout)
    if what_if is not None:
        plan, reading, ds, topo = what_if
        sys.stdout.write("\n")
        print_reading(plan, [index], [ds], topo, args, sys.stdout, reading)
    if args.plot:
        sys.stdout.write(f"plot written to {args.plot}\n")
    return 0


def _dataset(index: Any, args: argparse.Namespace) -> Any:
    """The index as the planned Dataset: its repeats, and its ``--proportions`` (core/planning/proportion.py)."""
    import dataclasses

    ds = index.to_dataset(repeats=args.repeats, **({"costs": True} if args.mix_by == "cost" else {}))
    return ds if args.proportions is None else dataclasses.replace(ds, proportion=args.proportions)


def _mixing(args: argparse.Namespace) -> dict[str, Any]:
    return {"mix_by": args.mix_by, "epoch_size": args.epoch_size}


def _what_if_locality(index: Any, args: argparse.Namespace) -> tuple[Any, dict[str, Any], Any, Any]:
    """Rank 0's plan under ``--locality``, what it and the other locality cost to read
    (and node 0's, with ``--local-world-size``), its dataset and topology."""
    from ..core.local.locality import shard_map_of
    from ..core.planning.plan import plan_epoch
    from ..core.topology import Topology

    topo = Topology(world_size=args.world_size, rank=0, cp_size=args.cp_size,
                    local_world_size=args.local_world_size)
    ds = _dataset(index, args)
    source = ds if args.locality == "none" else shard_map_of(index, ds)
    plan = plan_epoch(source, topo, seed=args.seed, batch_size=args.batch_size, policy=args.pad,
                      oversubscribe=args.oversubscribe, warn=False, locality=args.locality, window=args.window,
                      **_mixing(args))
    return plan, reading_figures(plan, [index], [ds], topo, args), ds, topo


def _print_tables(index: Any, pad: dict[Hashable, Any] | None, args: argparse.Namespace, out: Any) -> None:
    from ..index.layout import FORMAT_VERSION

    total = len(index)
    counts, sizes = index.bucket_counts(), index.bucket_bytes()
    by = dict(index.bucket_by)
    desc = ", ".join([str(by.pop("kind", "?"))] + [f"{k}={v}" for k, v in by.items() if v is not None])
    out.write(f"index {index.path} (format v{FORMAT_VERSION}, digest {index.digest[:16]}), name {index.name!r}\n")
    out.write(f"bucket_by: {desc}; members: {', '.join(index.exts) or '-'}\n\n")
    headers = ["bucket", "samples", "%", "bytes", "mean sample"]
    rows = []
    for key in bucket_order(counts):
        n = counts[key]
        row = [str(key), n, f"{100 * n / total:.1f}%" if total else "-", format_bytes(sizes[key]),
               format_bytes(sizes[key] / n) if n else "-"]
        if pad is not None:
            s = pad[key]
            row += [s.padded_copies, s.truncated, "dropped" if s.dropped else ("empty" if not n else "kept")]
        rows.append(row)
    if pad is not None:
        headers += ["pad copies", "truncated", "status"]
    rows.append(["total", total, "100.0%" if total else "-", format_bytes(sum(sizes.values())),
                 format_bytes(sum(sizes.values()) / total) if total else "-"]
                + ([sum(s.padded_copies for s in pad.values()), sum(s.truncated for s in pad.values()), ""]
                   if pad is not None else []))
    out.write(format_table(headers, rows, align="lrrrr" + ("rrl" if pad is not None else "")) + "\n")
    if pad is not None:
        out.write(f"(padding for world size {args.world_size}, cp size {args.cp_size}, batch size "
                  f"{args.batch_size}, policy {args.pad})\n")
    per_shard = [s.samples for s in index.shards if s.size >= 0]
    nbytes = sum(max(s.size, 0) for s in index.shards)
    skipped = [s for s in index.shards if s.error is not None]
    out.write(f"\nshards: {len(index.shards)}, {format_bytes(nbytes)}, samples per shard "
              f"min {min(per_shard, default=0)} / max {max(per_shard, default=0)}, "
              f"{len(skipped)} with errors\n")
    missing, why = index.members_missing()
    if missing:  # the fallback is never silent: those samples' headers are parsed on every read
        out.write(f"member table: {missing} of {total} samples have none and stream through the "
                  f"exact path (every tar header parsed): {why}\n")
    else:
        out.write("member table: every sample (streaming reads payloads without parsing tar headers)\n")
    report_excluded(index, out)
    if index.cost is not None:
        _print_costs(index, args.budget, out)


def _print_costs(index: Any, budget: float | None, out: Any) -> None:
    """The per-bucket cost table (and, with ``budget``, the samples dearer than it)."""
    stats = _cost_stats(index, budget)
    headers = ["bucket", "min", "median", "mean", "max"] + ([f"over {_num(budget)}"] if budget is not None else [])
    rows = []
    for key in bucket_order(stats):
        s = stats[key]
        if not s["samples"]:
            rows.append([str(key), "-", "-", "-", "-"] + (["-"] if budget is not None else []))
            continue
        rows.append([str(key), _num(s["min"]), _num(s["median"]), _num(s["mean"]), _num(s["max"])]
                    + ([s["over_budget"]["count"]] if budget is not None else []))
    out.write(f"\ncost {index.cost_kind} per sample:\n")
    out.write(format_table(headers, rows, align="lrrrr" + ("r" if budget is not None else "")) + "\n")
    if budget is None:
        return
    dear = [(key, stats[key]["over_budget"]) for key in bucket_order(stats)
            if stats[key].get("over_budget", {}).get("count")]
    total = sum(o["count"] for _, o in dear)
    out.write(f"{total} samples cost more than the budget {_num(budget)}: each travels alone in a batch\n")
    for key, o in dear:
        more = f", ... ({o['count'] - _KEYS_SHOWN} more)" if o["count"] > _KEYS_SHOWN else ""
        out.write(f"  {key}: {', '.join(repr(k) for k in o['keys'][:_KEYS_SHOWN])}{more}\n")


def _num(value: Any) -> str:
    """A cost in a table: whole numbers as such, others with 4 significant digits."""
    v = float(value)
    return f"{int(v):,}" if v == int(v) and abs(v) < 1e15 else f"{v:,.4g}"
