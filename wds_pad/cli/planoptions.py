"""The planning options every planning command takes (``wds-pad plan``, ``wds-pad
simulate``), and the datasets they name.

One parser-building function, :func:`add_planning_options`, so an option added to
planning appears on every such command under the same name; :func:`sizing` turns the
sizing options into what ``batch_size`` plans, :func:`plan_sources` the inputs into the
datasets to plan (index files, or a synthetic ``--buckets`` dataset) and
:func:`planning_kwargs` the rest into ``plan_epoch``'s keyword arguments.

Invariants:
- a bad combination of options is a usage error (exit 2) of the command given, before
  anything is planned; so is an index given twice (its samples would appear twice);
- nothing here imports torch, and numpy only when called.
"""

from __future__ import annotations

import argparse
from typing import Any

from .common import (
    add_relocate,
    epoch_arg,
    locality_arg,
    non_negative,
    positive_int,
    positive_number,
    relocation,
    seed_arg,
    usage_error,
)

__all__ = ["add_planning_options", "plan_sources", "planning_kwargs", "sizing", "synthetic_dataset"]


def add_planning_options(p: argparse.ArgumentParser) -> None:
    """The options of a plan: its inputs, layout, sizing, seed, padding and locality."""
    p.add_argument("index", nargs="*", help="index file(s); each is one dataset (or use --buckets)")
    p.add_argument("--buckets", type=_parse_buckets, help="synthetic dataset: 'a=4,b=0,c=7'")
    p.add_argument("--world-size", type=positive_int, required=True)
    p.add_argument("--cp-size", type=positive_int, default=1)
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--batch-size", type=positive_int, help="samples per batch per DP rank")
    size.add_argument("--budget", type=positive_number, metavar="LIMIT",
                      help="a cost budget per batch instead of a batch size (index files built with --cost)")
    p.add_argument("--budget-model", choices=["sum", "max"], default="sum",
                   help="sum: a batch costs its samples' costs summed; max: its count x its largest cost")
    p.add_argument("--max-samples", type=positive_int, help="with --budget: at most this many samples a batch")
    size.add_argument("--pack", type=positive_int, metavar="L",
                      help="batches of packed sequences: packs of at most L tokens (costs; index files built "
                           "with --cost), see docs/packing.md")
    p.add_argument("--packs-per-batch", type=positive_int, metavar="B", help="with --pack: packs per batch (default 1)")
    p.add_argument("--max-segments", type=positive_int, metavar="S", help="with --pack: at most S samples a pack")
    p.add_argument("--oversize", choices=["refuse", "alone"],
                   help="with --pack: a sample longer than L is refused (default) or travels alone in its pack")
    p.add_argument("--accumulation-steps", type=positive_int, default=1,
                   help="micro-batches per optimizer step: every rank's batch count a multiple of it, "
                        "each run of it from one bucket")
    p.add_argument("--seed", type=seed_arg, required=True, help="an integer in [0, 2**64)")
    p.add_argument("--epoch", type=epoch_arg, default=0, help="an integer in [0, 2**31 - 1]")
    p.add_argument("--pad", choices=["auto", "cyclic", "drop", "none"], default="auto")
    p.add_argument("--pad-to", choices=["batch", "rank"], default="batch")
    p.add_argument("--repeats", type=non_negative, default=0, help="repeats of every dataset")
    p.add_argument("--weights", help="comma-separated weights, one per index")
    p.add_argument("--oversubscribe", action="store_true")
    p.add_argument("--proportions", help="comma-separated shares of an epoch, one per index (or one for --buckets)")
    p.add_argument("--mix-by", choices=["samples", "cost"], default="samples",
                   help="with --proportions: count shares in samples or in cost (index files built with --cost)")
    p.add_argument("--epoch-size", type=positive_number, metavar="N",
                   help="with --proportions: the epoch's samples (or cost); default: the datasets' own")
    p.add_argument("--mode", choices=["epochs", "steps"], default="epochs")
    p.add_argument("--locality", type=locality_arg, default="none",
                   help="none: buckets shuffled over all shards; shard: each rank reads its own shards "
                        "(needs index files)")
    p.add_argument("--window", type=positive_int, default=8, help="shards a rank visits at once (--locality shard)")
    add_relocate(p)
    p.add_argument("--local-world-size", type=positive_int, metavar="L",
                   help="processes per node (torchrun's --nproc-per-node), the node layout; --summary adds the "
                        "GETs of the planned rank's node when its processes share one copy of each shard")


def planning_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``plan_epoch``'s keyword arguments from the options (after :func:`sizing`)."""
    return dict(seed=args.seed, batch_size=args.batch_size, policy=args.pad,
                oversubscribe=args.oversubscribe, pad_to=args.pad_to, locality=args.locality,
                window=args.window, accumulation_steps=args.accumulation_steps, mix_by=args.mix_by,
                epoch_size=args.epoch_size)


def sizing(args: argparse.Namespace, cmd: str) -> None:
    """``--budget`` or ``--pack`` (with their options) as the ``Budget`` or ``Pack``
    planned in place of a batch size, in ``args.batch_size``."""
    if args.budget is not None:
        from ..core.budgets.budget import Budget

        args.batch_size = Budget(args.budget, args.budget_model, args.max_samples)
    if args.pack is None and (args.packs_per_batch or args.max_segments or args.oversize):
        raise usage_error(cmd, "--packs-per-batch, --max-segments and --oversize go with --pack L")
    if args.pack is not None:
        from ..core.budgets.packing import Pack

        args.batch_size = Pack(args.pack, args.packs_per_batch or 1, args.max_segments, args.oversize or "refuse")


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


def synthetic_dataset(buckets: dict[str, int], name: str = "synthetic") -> Any:
    """A Dataset whose ids are numbered from 0 in the order the buckets are listed."""
    import numpy as np

    from ..core.dataset import Dataset

    out, start = {}, 0
    for key, count in buckets.items():
        out[key] = np.arange(start, start + count, dtype=np.int64)
        start += count
    return Dataset(name=name, buckets=out)


def plan_sources(args: argparse.Namespace, cmd: str) -> tuple[list[Any], list[Any]]:
    """The datasets to plan, and per dataset a ``ids -> (urls, keys)`` lookup or None."""
    from ..core.dataset import Dataset

    if bool(args.index) == bool(args.buckets):
        raise usage_error(cmd, "give either INDEX file(s) or --buckets, not both and not neither")
    if args.buckets and args.budget is not None:
        raise usage_error(cmd, "--budget needs INDEX file(s) built with --cost: --buckets has no costs")
    if args.budget is None and (args.max_samples is not None or args.budget_model != "sum"):
        raise usage_error(cmd, "--budget-model and --max-samples go with --budget LIMIT")
    if args.buckets and args.pack is not None:
        raise usage_error(cmd, "--pack needs INDEX file(s) built with --cost: --buckets has no costs")
    if args.buckets:
        if args.locality != "none":
            raise usage_error(cmd, f"--locality {args.locality} needs INDEX file(s): --buckets has no shards")
        ds = synthetic_dataset(args.buckets)
        return _with_proportions(cmd, [Dataset(ds.name, ds.buckets, repeats=args.repeats)], args), [None]
    from ..index.codec import load_index  # lazily: only when an index file is planned

    weights = [1.0] * len(args.index)
    if args.weights:
        try:
            weights = [float(w) for w in args.weights.split(",")]
        except ValueError:
            raise usage_error(cmd, f"--weights {args.weights!r} is not a list of numbers") from None
        if len(weights) != len(args.index):
            raise usage_error(cmd, f"--weights has {len(weights)} values for {len(args.index)} index files")
    datasets, lookups, names = [], [], set()
    seen: dict[tuple[str, tuple[str, ...]], tuple[int, str]] = {}
    for i, (path, weight) in enumerate(zip(args.index, weights)):
        idx = load_index(path, relocate=relocation(args))
        _refuse_twice(cmd, i, path, idx, seen)
        ds = idx.to_dataset(repeats=args.repeats, weight=weight, costs=args.budget is not None or args.pack is not None or args.mix_by == "cost")
        if ds.name in names:
            ds = Dataset(f"{ds.name}#{i}", ds.buckets, repeats=ds.repeats, weight=ds.weight, cost=ds.cost,
                         cost_order=ds.cost_order)
        names.add(ds.name)
        ds = _with_proportions(cmd, [ds], args, i, len(args.index))[0]
        if args.locality != "none":
            from ..core.local.locality import shard_map_of

            ds = shard_map_of(idx, ds)
        args.loaded = [*getattr(args, "loaded", []), idx]
        datasets.append(ds)
        lookups.append(_describe(idx, args))
    return datasets, lookups


def _with_proportions(cmd: str, dss: list[Any], args: argparse.Namespace, at: int = 0,
                      count: int = 1) -> list[Any]:
    """``dss`` (the datasets from ``at`` on) with their ``--proportions`` (core/planning/proportion.py)."""
    import dataclasses

    if not args.proportions:
        return dss
    try:
        shares = [float(x) for x in args.proportions.split(",")]
    except ValueError:
        raise usage_error(cmd, f"--proportions {args.proportions!r} is not a list of numbers") from None
    if len(shares) != count:
        raise usage_error(cmd, f"--proportions has {len(shares)} values for {count} dataset(s)")
    return [dataclasses.replace(ds, proportion=p) for ds, p in zip(dss, shares[at:])]


def _refuse_twice(cmd: str, i: int, path: str, idx: Any, seen: dict[tuple[str, tuple[str, ...]], tuple[int, str]]) -> None:
    """A usage error if ``idx`` holds the samples of an index given before (the same file,
    or a copy: the same content digest and shards), which would plan each sample twice."""
    import os

    j, first = seen.setdefault(idx.samples_identity, (i, path))
    if j == i:
        return
    same_file = first == path or os.path.realpath(first) == os.path.realpath(path)
    what = (f"index {path!r} is given twice (INDEX {j + 1} and {i + 1})" if same_file else
            f"index {path!r} holds the same samples as {first!r} (digest {idx.digest[:16]}, the same shards)")
    raise usage_error(cmd, f"{what}: each of its samples would be planned twice per epoch, as two datasets; "
                         "give each index once (to see every sample more than once per epoch: --repeats N)")


def _describe(index: Any, args: argparse.Namespace) -> Any:
    """``ids -> (urls, keys, cost)`` of an index's samples: the batch's cost under the
    budget's model (or summed) when the index records costs, else None."""
    from ..core.budgets.budget import batch_cost

    model = args.budget_model if args.budget is not None else "sum"

    def lookup(ids: Any) -> tuple[Any, Any, Any]:
        urls, keys = index.describe_samples(ids)
        cost = None if index.cost is None else batch_cost(index.cost[ids], model)
        return urls, keys, cost
    return lookup
