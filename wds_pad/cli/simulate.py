"""``wds-pad simulate``: what a job will read, before it runs.

Takes every planning option of ``wds-pad plan`` (:mod:`wds_pad.cli.planoptions`) and
plans every rank of the job for ``--epochs`` epochs, as its processes would; the counts
and the time and price model are core/local/simulate.py's. Prints per epoch the job's GETs and
bytes, per node its GETs, the time to the first batch, the share of steps that would
wait for data at ``--step-ms``, the peak bytes of a node's cache folder, and the price;
``--json``: one object.

Invariants:
- the plans are ``plan_epoch``'s with the command's options and each rank's
  ``Topology`` (context-parallel peers share their DP rank's plan), exactly what the
  job's streams follow; a node is ``--local-world-size`` processes sharing one cache
  folder (without it, every process is a node of its own);
- a bad combination of options is a usage error (exit 2) before anything is planned;
  nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .common import check_node_layout, format_bytes, format_table, non_negative, positive_int, usage_error
from .planoptions import add_planning_options, plan_sources, planning_kwargs, sizing

__all__ = ["add_parser"]

#: The stream's start before its first request (``--start-ms``): the mean of a job's first
#: batch less the model's reads in six runs of tools/bench/simulate.py on a 2-core machine
#: (docs/object-storage.md): a property of the machine, not of the plan.
START_MS = 300.0
#: How far apart the job's processes start their streams (``--start-skew-ms``): the mean
#: spread of the ranks' first requests in six runs of tools/bench/simulate.py (13-225 ms).
START_SKEW_MS = 110.0


def _number(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def add_parser(sub: Any) -> None:
    """Register the ``simulate`` subcommand."""
    p = sub.add_parser("simulate", help="predict a job's GETs, bytes, stalls and price before it runs",
                       description="Predict, from the plans of every rank, what a job will read.")
    add_planning_options(p)
    p.add_argument("--epochs", type=positive_int, default=1, help="epochs to simulate, from --epoch on")
    p.add_argument("--latency-ms", type=_number, default=20.0, help="latency of one GET")
    p.add_argument("--bandwidth-mbps", type=_number, default=1000.0, help="a node's bandwidth to the store")
    p.add_argument("--step-ms", type=_number, default=100.0, help="the training step's time, data aside")
    p.add_argument("--in-flight", type=positive_int, help="reads a process keeps sent ahead of the one it hands "
                   "out (default: ReadOptions' max_in_flight)")
    p.add_argument("--lookahead-steps", type=non_negative, default=0,
                   help="batches the job's loader makes ahead of the step that asks for them (DataLoader "
                   "workers x prefetch_factor; 0: each batch is made inside next(), as with num_workers=0)")
    p.add_argument("--start-ms", type=_number, default=START_MS, help="the stream's start before its first "
                   f"request: plans of the node, connections, imports (default {START_MS:g}: measured on a "
                   "2-core machine, see docs/object-storage.md; measure yours)")
    p.add_argument("--start-skew-ms", type=_number, default=START_SKEW_MS, help="how far apart the job's "
                   "processes start their streams: process i of P starts i/(P-1) of it after the first "
                   f"(default {START_SKEW_MS:g}: measured on a 2-core machine, see docs/object-storage.md)")
    p.add_argument("--stall-ms", type=_number, default=10.0, help="a step stalls when it waits longer than this")
    p.add_argument("--block-bytes", type=positive_int, help="bytes of one GET of a shard read whole "
                   "(default: ReadOptions' block_bytes)")
    p.add_argument("--price-per-get", type=_number, default=0.0, help="USD per GET (S3 standard: 0.0000004)")
    p.add_argument("--price-per-gb", type=_number, default=0.0, help="USD per GB read (egress)")
    p.add_argument("--warm", action="store_true", help="the nodes' cache folders hold what each node holds in "
                   "the first simulated epoch: a job resumed in that epoch, or a new job on the folders of an "
                   "earlier one where a node holds the same shards every epoch (node locality, shard on one node)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=_cmd_simulate)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from ..core.planning.plan import plan_epoch
    from ..core.local.simulate import Link, Prices, simulate
    from ..core.topology import Topology
    from ..io.options import ReadOptions

    if not args.index:
        raise usage_error("simulate", "give INDEX file(s): the simulation needs each sample's shard and bytes")
    if args.bandwidth_mbps <= 0:
        raise usage_error("simulate", "--bandwidth-mbps must be > 0")
    sizing(args, "simulate")
    sources, _ = plan_sources(args, "simulate")
    check_node_layout("simulate", args)
    indexes = getattr(args, "loaded", [])
    per_node = args.local_world_size or 1
    if args.world_size % per_node:
        raise usage_error("simulate", f"--world-size {args.world_size} is not a multiple of --local-world-size {per_node}")
    kw = planning_kwargs(args)
    epochs = list(range(args.epoch, args.epoch + args.epochs))
    plans = []
    for i, epoch in enumerate(epochs):
        by_dp: dict[int, Any] = {}

        def plan_of(rank: int, epoch: int = epoch, warn: bool = i == 0) -> Any:
            topo = Topology(world_size=args.world_size, rank=rank, cp_size=args.cp_size,
                            local_world_size=args.local_world_size)
            if topo.dp_rank not in by_dp:
                by_dp[topo.dp_rank] = plan_epoch(sources, topo, epoch=epoch, mode=args.mode,
                                                 warn=warn and not by_dp, **kw)
            return by_dp[topo.dp_rank]
        plans.append([[plan_of(r) for r in range(n * per_node, (n + 1) * per_node)]
                      for n in range(args.world_size // per_node)])
    block = args.block_bytes or ReadOptions().block_bytes
    sim = simulate(plans, [ix.shard for ix in indexes], [ix.length for ix in indexes],
                   [[max(s.size, 0) for s in ix.shards] for ix in indexes], block, epochs=epochs,
                   link=Link(latency_s=args.latency_ms / 1000, bandwidth=args.bandwidth_mbps * 1e6 / 8,
                             step_s=args.step_ms / 1000, in_flight=args.in_flight or ReadOptions().max_in_flight,
                             lookahead=args.lookahead_steps, start_s=args.start_ms / 1000,
                             start_skew_s=args.start_skew_ms / 1000,
                             stall_s=args.stall_ms / 1000),
                   prices=Prices(per_get=args.price_per_get, per_gb=args.price_per_gb), warm=args.warm,
                   offsets=[ix.offset for ix in indexes])
    out = sys.stdout
    if args.json:
        out.write(json.dumps(sim.to_json()) + "\n")
        return 0
    _print(sim, args, per_node, out)
    return 0


def _print(sim: Any, args: argparse.Namespace, per_node: int, out: Any) -> None:
    nodes = len(sim.nodes)
    out.write(f"{args.world_size} ranks in {nodes} node(s) of {per_node}, locality {args.locality}, "
              f"{'warm' if args.warm else 'empty'} cache folders; {args.latency_ms:g} ms a GET, "
              f"{args.bandwidth_mbps:g} Mbit/s a node, {args.step_ms:g} ms a step\n")
    headers = ["epoch", "steps", "GETs", "bytes"] + [f"node {n} GETs" for n in range(min(nodes, 4))]
    rows = []
    for e, epoch in enumerate(sim.epochs):
        rows.append([epoch, sim.steps[e], sim.gets_per_epoch[e], format_bytes(sim.bytes_per_epoch[e])]
                    + [sim.nodes[n][e].gets for n in range(min(nodes, 4))])
    out.write(format_table(headers, rows) + "\n")
    if nodes > 4:
        out.write(f"(nodes 4-{nodes - 1} in --json)\n")
    out.write(f"first batch after {sim.first_batch_s:.2f} s; {100 * sim.stall_share:.1f}% of steps wait for "
              f"data ({sim.stalls}); peak cache folder {format_bytes(sim.peak_cache_bytes)} a node; "
              f"cost {sim.cost_usd:.6f} USD\n")
