"""What a plan costs to read, as ``wds-pad plan --summary`` and ``wds-pad inspect
--locality`` print it: per locality, the planned rank's reads, and its node's when the
node's processes share one copy of each shard.

The figures are cli/readfigures.py's (pure, over core/local/reads.py's reads); this
module plans what they need with the command's arguments (the planned locality and,
beside it, ``none``, or ``shard`` when ``none`` is planned; every rank of the node with
``--local-world-size``) and prints them as ``locality ...`` lines, or returns them as JSON.

Invariants:
- the rank's and the node's plans are ``plan_epoch`` with the command's arguments and
  each rank's ``Topology``; CP peers share their DP rank's plan;
- the lines and the JSON hold the same figures; nothing here imports torch, and numpy
  only when called.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any, Sequence

from .common import format_bytes

__all__ = ["print_reading", "reading_figures", "reading_json"]


def reading_figures(plan: Any, indexes: Sequence[Any], sources: Sequence[Any], topo: Any,
                    args: argparse.Namespace) -> dict[str, tuple[Any, Any]]:
    """locality -> (this rank's ``LocalityFigures``, its node's ``NodeFigures`` or None),
    for the planned locality and, beside it, ``none`` (``shard`` when ``none`` is planned).

    The node's figures need ``topo.local_world_size``: every rank of the node is planned
    with the same arguments (CP peers share their DP rank's plan), as its processes would.
    """
    from .readfigures import figures, node_figures
    from ..core.local.locality import Locality, shard_map_of
    from ..core.planning.plan import plan_epoch
    from ..core.topology import Topology
    from ..io.options import ReadOptions

    block = ReadOptions().block_bytes
    shard_of = [ix.shard for ix in indexes]
    lengths = [ix.length for ix in indexes]
    shard_bytes = [[max(s.size, 0) for s in ix.shards] for ix in indexes]
    chosen = plan.locality.value
    beside = Locality.SHARD.value if chosen == Locality.NONE.value else Locality.NONE.value
    plain = [getattr(s, "dataset", s) for s in sources]
    out: dict[str, tuple[Any, Any]] = {}
    for name in (chosen, beside):
        datasets = plain if name == Locality.NONE.value else [shard_map_of(ix, d) for ix, d in zip(indexes, plain)]
        by_dp = {topo.dp_rank: plan} if name == chosen else {}

        def plan_of(t: Any) -> Any:
            if t.dp_rank not in by_dp:
                by_dp[t.dp_rank] = plan_epoch(
                    datasets, t, seed=args.seed, epoch=getattr(args, "epoch", 0), batch_size=args.batch_size,
                    policy=args.pad, oversubscribe=args.oversubscribe, pad_to=getattr(args, "pad_to", "batch"),
                    mode=getattr(args, "mode", "epochs"), warn=False, locality=name, window=args.window,
                    accumulation_steps=getattr(args, "accumulation_steps", 1))
            return by_dp[t.dp_rank]

        f = figures(plan_of(topo), shard_of, lengths, shard_bytes, block)
        node = None
        if topo.local_world_size:
            ranks = range(topo.node * topo.local_world_size, (topo.node + 1) * topo.local_world_size)
            node = node_figures([plan_of(Topology(topo.world_size, r, cp_size=topo.cp_size,
                                                 local_world_size=topo.local_world_size)) for r in ranks],
                                shard_of, lengths, shard_bytes, block)
        out[name] = (f, node)
    return out


def reading_json(reading: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """The figures of :func:`reading_figures` as JSON: per locality the rank's, and the
    node's (null without a node layout)."""
    out = {}
    for name, (f, node) in reading.items():
        out[name] = {**asdict(f), "foreign_fraction": f.foreign_fraction,
                     "node": None if node is None else {**asdict(node), "gets_per_shard": node.gets_per_shard}}
    return out


def print_reading(plan: Any, indexes: Sequence[Any], sources: Sequence[Any], topo: Any,
                  args: argparse.Namespace, out: Any,
                  reading: dict[str, tuple[Any, Any]] | None = None) -> None:
    """What this rank's epoch costs to read (``plan --summary`` with index files): shards
    read whole, single-range reads, distinct shards per batch, the shuffle quality, GETs
    and bytes read per byte used, for the planned locality beside the other one; with a
    node layout, under each, its node's GETs when the node shares one copy of each shard."""
    from ..io.options import ReadOptions

    block = ReadOptions().block_bytes
    reading = reading if reading is not None else reading_figures(plan, indexes, sources, topo, args)
    for i, (name, (f, node)) in enumerate(reading.items()):
        chosen = "" if i == 0 else " (the other choice)"
        out.write(f"locality {name}{chosen}: rank {topo.rank} reads {f.shards} shards whole "
                  f"(window {args.window}), {f.single} of {f.entries} samples by single reads "
                  f"({100 * f.foreign_fraction:.1f}%; {f.foreign} foreign), "
                  f"{f.distinct_per_batch:.1f} distinct shards per batch, shuffle quality "
                  f"{f.shuffle_quality:.2f} bits, "
                  f"{f.gets} GETs per epoch (blocks of {format_bytes(block)}), bytes read / used "
                  f"{f.bytes_read / max(f.bytes_used, 1):.2f}\n")
        if node is not None:
            out.write(_node_line(node, topo) + "\n")


def _node_line(node: Any, topo: Any) -> str:
    """One node's reading cost, under its locality's line."""
    first = topo.node * topo.local_world_size
    head = (f"  node {topo.node} (ranks {first}-{first + topo.local_world_size - 1}, one copy of each shard): "
            f"holds {node.shards} shards, {node.gets} GETs per epoch")
    if node.gets_per_shard is None:
        return f"{head} (every sample a single read); {node.alone} without sharing"
    return (f"{head} = {node.gets_per_shard:.2f} x the shards it holds ({node.single} single reads of "
            f"shards it does not hold, {node.served} served by its copy); {node.alone} without sharing")
