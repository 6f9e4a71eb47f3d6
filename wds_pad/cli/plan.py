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

from .common import check_node_layout, int_at_least, positive_int, print_summary, usage_error
from .budgetfill import print_budget
from .packfill import print_packs
from .planoptions import add_planning_options, plan_sources, planning_kwargs, sizing, synthetic_dataset
from .reading import print_reading

__all__ = ["add_parser", "synthetic_dataset"]


def _rank_arg(text: str) -> int | str:
    if text == "all":
        return text
    try:
        return int_at_least(0, "an integer >= 0", text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"--rank must be an integer or 'all' ({exc})") from None


def add_parser(sub: Any) -> None:
    """Register the ``plan`` subcommand."""
    p = sub.add_parser("plan", help="print this rank's (or every rank's) planned batches",
                       description="Plan an epoch (or K steps) for one rank or all ranks.")
    p.add_argument("--rank", type=_rank_arg, required=True, help="a rank, or 'all'")
    p.add_argument("--steps", type=positive_int, help="steps mode: how many global steps to print")
    add_planning_options(p)
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--json", action="store_true", help="one JSON object per batch")
    out.add_argument("--summary", action="store_true", help="a table per bucket")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    from ..core.planning.plan import iter_steps, plan_epoch
    from ..core.policy import Mode
    from ..core.topology import Topology

    if args.mode == "steps" and args.steps is None and args.json:
        raise usage_error("plan", "--mode steps needs --steps K (how many global steps to print)")
    sizing(args, "plan")
    sources, lookups = plan_sources(args, "plan")
    check_node_layout("plan", args)
    ranks = range(args.world_size) if args.rank == "all" else [args.rank]
    if args.rank != "all" and args.rank >= args.world_size:
        raise usage_error("plan", f"--rank {args.rank} is out of range for --world-size {args.world_size}")
    common = planning_kwargs(args)
    out = sys.stdout
    for i, rank in enumerate(ranks):
        topo = Topology(world_size=args.world_size, rank=rank, cp_size=args.cp_size,
                        local_world_size=args.local_world_size)
        warn = i == 0
        if args.summary:
            plan = plan_epoch(sources, topo, epoch=args.epoch, mode=args.mode, warn=True, **common)
            print_summary(plan, out, all_ranks=args.rank == "all")  # equal on every rank
            if args.budget is not None:
                print_budget(sources, topo, args, common, out)
            if args.pack is not None:
                print_packs(sources, topo, args, common, out)
            if args.index:
                print_reading(plan, getattr(args, "loaded", []), sources, topo, args, out)
            return 0
        if args.mode == Mode.EPOCHS.value:
            plans: Any = [plan_epoch(sources, topo, epoch=args.epoch, mode=args.mode, warn=warn, **common)]
        else:
            plans = iter_steps(sources, topo, start_epoch=args.epoch, **common)
        _print_json(plans, topo, args.steps, lookups, out)
    return 0


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
