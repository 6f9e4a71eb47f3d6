"""``wds-pad plan``: an epoch (or K steps) of one rank's or every rank's batches.

Plans from index files or from a synthetic ``--buckets`` dataset; never imports torch
(the planner is pure numpy), so it starts fast.

Invariants:
- ``--json`` prints one JSON object per batch and nothing else on stdout, in step
  order, rank after rank for ``--rank all``; with index files each record also names
  the samples' shard URLs and keys;
- ``--summary`` prints one table per bucket for the (first) rank; with ``--rank all``
  its last line speaks of every rank (each gets the same number of batches); with index
  files it ends with what the epoch costs to read on that rank, for the chosen
  ``--locality`` beside the other one (``locality:`` lines: GETs, distinct shards per
  batch, the shuffle quality), and with ``--local-world-size`` under each the GETs of the
  rank's node when its processes share one copy of each shard;
- a bad combination of options is a usage error (exit 2) before anything is planned,
  and so is an index given twice (the same file, or one with the same digest and
  shards): its samples would silently appear twice per epoch.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .common import (
    _epoch_arg,
    _int_at_least,
    _locality_arg,
    _non_negative,
    _positive,
    _positive_number,
    _print_summary,
    _seed_arg,
    _usage,
    add_relocate,
    check_node_layout,
    relocation,
)
from .budgetfill import print_budget
from .reading import print_reading

__all__ = ["add_parser", "synthetic_dataset"]


def _parse_buckets(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, count = part.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"bucket {part!r} is not NAME=COUNT (e.g. 'a=4,b=0,c=7')")
        try:
            n = int(count)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bucket {name!r}: count {count!r} is not an integer") from None
        if n < 0:
            raise argparse.ArgumentTypeError(f"bucket {name!r}: count must be >= 0, got {n}")
        if name.strip() in out:
            raise argparse.ArgumentTypeError(f"bucket {name.strip()!r} is listed twice")
        out[name.strip()] = n
    if not out:
        raise argparse.ArgumentTypeError("no buckets given; use e.g. --buckets 'a=4,b=0,c=7'")
    return out


def _rank_arg(text: str) -> int | str:
    if text == "all":
        return text
    try:
        return _int_at_least(0, "an integer >= 0", text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"--rank must be an integer or 'all' ({exc})") from None


def synthetic_dataset(buckets: dict[str, int], name: str = "synthetic") -> Any:
    """A Dataset whose ids are numbered from 0 in the order the buckets are listed."""
    import numpy as np

    from ..core.dataset import Dataset

    out, start = {}, 0
    for key, count in buckets.items():
        out[key] = np.arange(start, start + count, dtype=np.int64)
        start += count
    return Dataset(name=name, buckets=out)


def add_parser(sub: Any) -> None:
    """Register the ``plan`` subcommand."""
    p = sub.add_parser("plan", help="print this rank's (or every rank's) planned batches",
                       description="Plan an epoch (or K steps) for one rank or all ranks.")
    p.add_argument("index", nargs="*", help="index file(s); each is one dataset (or use --buckets)")
    p.add_argument("--buckets", type=_parse_buckets, help="synthetic dataset: 'a=4,b=0,c=7'")
    p.add_argument("--world-size", type=_positive, required=True)
    p.add_argument("--rank", type=_rank_arg, required=True, help="a rank, or 'all'")
    p.add_argument("--cp-size", type=_positive, default=1)
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--batch-size", type=_positive, help="samples per batch per DP rank")
    size.add_argument("--budget", type=_positive_number, metavar="LIMIT",
                      help="a cost budget per batch instead of a batch size (index files built with --cost)")
    p.add_argument("--budget-model", choices=["sum", "max"], default="sum",
                   help="sum: a batch costs its samples' costs summed; max: its count x its largest cost")
    p.add_argument("--max-samples", type=_positive, help="with --budget: at most this many samples a batch")
    p.add_argument("--accumulation-steps", type=_positive, default=1,
                   help="micro-batches per optimizer step: every rank's batch count a multiple of it, "
                        "each run of it from one bucket")
    p.add_argument("--seed", type=_seed_arg, required=True, help="an integer in [0, 2**64)")
    p.add_argument("--epoch", type=_epoch_arg, default=0, help="an integer in [0, 2**31 - 1]")
    p.add_argument("--pad", choices=["auto", "cyclic", "drop", "none"], default="auto")
    p.add_argument("--pad-to", choices=["batch", "rank"], default="batch")
    p.add_argument("--repeats", type=_non_negative, default=0, help="repeats of every dataset")
    p.add_argument("--weights", help="comma-separated weights, one per index")
    p.add_argument("--oversubscribe", action="store_true")
    p.add_argument("--proportions", help="comma-separated shares of an epoch, one per index (or one for --buckets)")
    p.add_argument("--mix-by", choices=["samples", "cost"], default="samples",
                   help="with --proportions: count shares in samples or in cost (index files built with --cost)")
    p.add_argument("--epoch-size", type=_positive_number, metavar="N",
                   help="with --proportions: the epoch's samples (or cost); default: the datasets' own")
    p.add_argument("--mode", choices=["epochs", "steps"], default="epochs")
    p.add_argument("--steps", type=_positive, help="steps mode: how many global steps to print")
    p.add_argument("--locality", type=_locality_arg, default="none",
                   help="none: buckets shuffled over all shards; shard: each rank reads its own shards "
                        "(needs index files)")
    p.add_argument("--window", type=_positive, default=8, help="shards a rank visits at once (--locality shard)")
    add_relocate(p)
    p.add_argument("--local-world-size", type=_positive, metavar="L",
                   help="processes per node (torchrun's --nproc-per-node), the node layout; --summary adds the "
                        "GETs of the planned rank's node when its processes share one copy of each shard")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--json", action="store_true", help="one JSON object per batch")
    out.add_argument("--summary", action="store_true", help="a table per bucket")
    p.set_defaults(func=_cmd_plan)


def _plan_sources(args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    """The datasets to plan, and per dataset a ``ids -> (urls, keys)`` lookup or None."""
    from ..core.dataset import Dataset

    if bool(args.index) == bool(args.buckets):
        raise _usage("plan", "give either INDEX file(s) or --buckets, not both and not neither")
    if args.buckets and args.budget is not None:
        raise _usage("plan", "--budget needs INDEX file(s) built with --cost: --buckets has no costs")
    if args.budget is None and (args.max_samples is not None or args.budget_model != "sum"):
        raise _usage("plan", "--budget-model and --max-samples go with --budget LIMIT")
    if args.buckets:
        if args.locality != "none":
            raise _usage("plan", f"--locality {args.locality} needs INDEX file(s): --buckets has no shards")
        ds = synthetic_dataset(args.buckets)
        return _with_proportions([Dataset(ds.name, ds.buckets, repeats=args.repeats)], args), [None]
    from ..index.codec import load_index  # lazily: only when an index file is planned

    weights = [1.0] * len(args.index)
    if args.weights:
        try:
            weights = [float(w) for w in args.weights.split(",")]
        except ValueError:
            raise _usage("plan", f"--weights {args.weights!r} is not a list of numbers") from None
        if len(weights) != len(args.index):
            raise _usage("plan", f"--weights has {len(weights)} values for {len(args.index)} index files")
    datasets, lookups, names = [], [], set()
    seen: dict[tuple[str, tuple[str, ...]], tuple[int, str]] = {}
    for i, (path, weight) in enumerate(zip(args.index, weights)):
        idx = load_index(path, relocate=relocation(args))
        _refuse_twice(i, path, idx, seen)
        ds = idx.to_dataset(repeats=args.repeats, weight=weight, costs=args.budget is not None or args.mix_by == "cost")
        if ds.name in names:
            ds = Dataset(f"{ds.name}#{i}", ds.buckets, repeats=ds.repeats, weight=ds.weight, cost=ds.cost,
                         cost_order=ds.cost_order)
        names.add(ds.name)
        ds = _with_proportions([ds], args, i, len(args.index))[0]
        if args.locality != "none":
            from ..core.locality import shard_map_of

            ds = shard_map_of(idx, ds)
        args.loaded = [*getattr(args, "loaded", []), idx]
        datasets.append(ds)
        lookups.append(_describe(idx, args))
    return datasets, lookups


def _with_proportions(dss: list[Any], args: argparse.Namespace, at: int = 0, count: int = 1) -> list[Any]:
    """``dss`` (the datasets from ``at`` on) with their ``--proportions`` (core/proportion.py)."""
    import dataclasses

    if not args.proportions:
        return dss
    try:
        shares = [float(x) for x in args.proportions.split(",")]
    except ValueError:
        raise _usage("plan", f"--proportions {args.proportions!r} is not a list of numbers") from None
    if len(shares) != count:
        raise _usage("plan", f"--proportions has {len(shares)} values for {count} dataset(s)")
    return [dataclasses.replace(ds, proportion=p) for ds, p in zip(dss, shares[at:])]


def _refuse_twice(i: int, path: str, idx: Any, seen: dict[tuple[str, tuple[str, ...]], tuple[int, str]]) -> None:
    """A usage error if ``idx`` holds the samples of an index given before (the same file,
    or a copy: the same content digest and shards), which would plan each sample twice."""
    import os

    j, first = seen.setdefault(idx.samples_identity, (i, path))
    if j == i:
        return
    same_file = first == path or os.path.realpath(first) == os.path.realpath(path)
    what = (f"index {path!r} is given twice (INDEX {j + 1} and {i + 1})" if same_file else
            f"index {path!r} holds the same samples as {first!r} (digest {idx.digest[:16]}, the same shards)")
    raise _usage("plan", f"{what}: each of its samples would be planned twice per epoch, as two datasets; "
                         "give each index once (to see every sample more than once per epoch: --repeats N)")


def _cmd_plan(args: argparse.Namespace) -> int:
    from ..core.plan import iter_steps, plan_epoch
    from ..core.policy import Mode
    from ..core.topology import Topology

    if args.mode == "steps" and args.steps is None and args.json:
        raise _usage("plan", "--mode steps needs --steps K (how many global steps to print)")
    if args.budget is not None:
        from ..core.budget import Budget

        args.batch_size = Budget(args.budget, args.budget_model, args.max_samples)
    sources, lookups = _plan_sources(args)
    check_node_layout("plan", args)
    ranks = range(args.world_size) if args.rank == "all" else [args.rank]
    if args.rank != "all" and args.rank >= args.world_size:
        raise _usage("plan", f"--rank {args.rank} is out of range for --world-size {args.world_size}")
    common = dict(seed=args.seed, batch_size=args.batch_size, policy=args.pad,
                  oversubscribe=args.oversubscribe, pad_to=args.pad_to, locality=args.locality,
                  window=args.window, accumulation_steps=args.accumulation_steps, mix_by=args.mix_by,
                  epoch_size=args.epoch_size)
    out = sys.stdout
    for i, rank in enumerate(ranks):
        topo = Topology(world_size=args.world_size, rank=rank, cp_size=args.cp_size,
                        local_world_size=args.local_world_size)
        warn = i == 0
        if args.summary:
            plan = plan_epoch(sources, topo, epoch=args.epoch, mode=args.mode, warn=True, **common)
            _print_summary(plan, out, all_ranks=args.rank == "all")  # equal on every rank
            if args.budget is not None:
                print_budget(sources, topo, args, common, out)
            if args.index:
                print_reading(plan, getattr(args, "loaded", []), sources, topo, args, out)
            return 0
        if args.mode == Mode.EPOCHS.value:
            plans: Any = [plan_epoch(sources, topo, epoch=args.epoch, mode=args.mode, warn=warn, **common)]
        else:
            plans = iter_steps(sources, topo, start_epoch=args.epoch, **common)
        _print_json(plans, topo, args.steps, lookups, out)
    return 0


def _describe(index: Any, args: argparse.Namespace) -> Any:
    """``ids -> (urls, keys, cost)`` of an index's samples: the batch's cost under the
    budget's model (or summed) when the index records costs, else None."""
    from ..core.budget import batch_cost

    model = args.budget_model if args.budget is not None else "sum"

    def lookup(ids: Any) -> tuple[Any, Any, Any]:
        urls, keys = index.describe_samples(ids)
        cost = None if index.cost is None else batch_cost(index.cost[ids], model)
        return urls, keys, cost
    return lookup


def _print_json(plans: Any, topo: Any, max_steps: int | None, lookups: list[Any], out: Any) -> None:
    done = 0
    for plan in plans:
        for batch in plan:
            if max_steps is not None and done + batch.step >= max_steps:
                return
            record = batch.to_json(topo)
            lookup = lookups[plan.datasets.index(batch.dataset)]
            if lookup is not None:
                record["urls"], record["keys"], cost = lookup(batch.samples)
                if cost is not None:
                    record["cost"] = cost
            out.write(json.dumps(record) + "\n")
        done += plan.steps
        if max_steps is None:
            return
