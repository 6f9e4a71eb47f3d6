"""``wds-pad plan --summary --pack``: how many packs each bucket makes and how full they are.

Invariants:
- the fill is real tokens over packs x seq_len: each real sample counted once (padded
  copies add no fill), a sample longer than seq_len (``--oversize alone``) counted as the
  seq_len tokens its pack keeps;
- every DP rank is planned (CP peers hold the same packs).
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from .common import format_table

__all__ = ["print_packs"]


def print_packs(sources: Sequence[Any], topo: Any, args: argparse.Namespace, common: dict[str, Any],
                out: Any) -> None:
    """Per bucket: its steps, its packs over all DP ranks, their mean segments and fill
    (real tokens / (packs x seq_len)); then the epoch's fill."""
    import numpy as np

    from ..core.planning.plan import plan_epoch
    from ..core.topology import Topology

    pack = common["batch_size"]
    costs = [getattr(s, "dataset", s).cost for s in sources]
    seen: dict[tuple[str, Any], list[float]] = {}  # steps, packs, segments, real tokens
    for d in range(topo.dp_size):
        plan = plan_epoch(sources, Topology(topo.world_size, d * topo.cp_size, cp_size=topo.cp_size,
                                            local_world_size=topo.local_world_size),
                          epoch=args.epoch, mode=args.mode, warn=False, **common)
        for b in plan:
            c = np.minimum(np.asarray(costs[plan.datasets.index(b.dataset)][b.samples], np.float64), pack.seq_len)
            real = np.bincount(b.pack, weights=np.where(b.pad, 0.0, c), minlength=pack.packs)
            row = seen.setdefault((b.dataset, b.bucket), [0, 0, 0, 0.0])
            row[0] += d == 0
            row[1] += pack.packs
            row[2] += int(b.samples.size)
            row[3] += float(np.minimum(real, pack.seq_len).sum())
    rows = [[ds, str(bucket), int(st), int(n), f"{seg / max(n, 1):.1f}", _fill(tok / max(n * pack.seq_len, 1))]
            for (ds, bucket), (st, n, seg, tok) in seen.items()]
    out.write(format_table(["dataset", "bucket", "steps", "packs", "segments/pack", "fill"], rows,
                           align="llrrrr") + "\n")
    n = sum(r[1] for r in seen.values())
    tok = sum(r[3] for r in seen.values())
    out.write(f"pack {pack.seq_len} x {pack.packs} per batch: {int(n)} packs over {topo.dp_size} DP ranks, fill "
              f"{_fill(tok / max(n * pack.seq_len, 1))} (real tokens / (packs x {pack.seq_len}), padded copies "
              "not counted)\n")


def _fill(x: float) -> str:
    return f"{100 * x:.1f}%"
