"""The shard-level path's state (``kind="shards"``): its plan block, assembly and parsing.

A ``ShardStream`` state has the fields every state has (state/schema.py) and, instead of
a batch index in a plan, each DataLoader worker's place in its shards::

    {..., "kind": "shards", "mode": "epochs", "epoch": 2, "index": <samples yielded>,
     "plan": {"order": "split_by_node/1", "seed_hash": "<hex>", "shards": "<hex>",
              "num_shards": 40, "samples": 12000, "dp_size": 4},
     "num_workers": 2, "next_worker": 1, "done": false,
     "workers": [{"shard": 3, "offset": 51200, "yielded": 310}, ...]}

Invariants:
- the ``plan`` block covers the deal's order (``ORDER``), the seed, the shard table (URL,
  size, stamp and samples of every shard, in index order) and dp_size; the fingerprint
  is its digest (:func:`~wds_pad.state.schema.fingerprint_of`), computed exactly as
  before, so every saved state of this version keeps verifying;
- ``index`` is the samples the rank yielded (over its workers), ``workers`` one
  position per worker, ``next_worker`` the worker the DataLoader's round-robin asks next;
- a malformed ``workers`` / ``num_workers`` / ``next_worker`` block is a StateError that
  names the fields; nothing is restored from a state that fails any check.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..core.seed import json_digest, stable_digest
from ..core.topology import Topology
from ..errors import StateError
from .cursor import Cursor, ShardProgress, WorkerPosition
from .schema import STATE_FORMAT, STATE_VERSION, keyed_by_rank
from .verify import verify_state

__all__ = ["ORDER", "make_shard_state", "restore_shards", "shard_plan_fields", "shard_progress"]

ORDER = "split_by_node/1"  # bump when core's deal_shards or worker_plan change their order


def shard_plan_fields(seed: int, shards: Sequence[Sequence[Any]], samples: int, dp_size: int) -> dict[str, Any]:
    """The ``plan`` block of a shard-stream state.

    Args:
        seed: the shared seed.
        shards: ``[url, size, stamp, samples]`` of every shard, in index order.
        samples: the samples of every shard.
        dp_size: DP ranks the shards are dealt to.
    """
    fields: dict[str, Any] = {"order": ORDER, "seed_hash": stable_digest(seed, size=8).hex(),
                              "shards": json_digest(list(shards), sort_keys=False),
                              "num_shards": len(shards), "samples": samples,
                              "dp_size": int(dp_size)}  # the shards are dealt to dp_size ranks
    return fields


def make_shard_state(cursor: Cursor, topology: Topology, fingerprint: str,
                     fields: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-safe state of a shard stream at ``cursor`` (its epoch and shard progress)."""
    p = cursor.shards
    state = {"format": STATE_FORMAT, "version": STATE_VERSION, "kind": "shards", "mode": "epochs",
             "epoch": cursor.epoch, "index": p.yielded,
             "topology": topology.to_dict(), "fingerprint": fingerprint,
             "plan": dict(fields), "num_workers": len(p.positions), "next_worker": p.next_worker,
             "done": p.done, "workers": [{"shard": q.shard, "offset": q.offset, "yielded": q.yielded}
                                         for q in p.positions]}
    # this rank's own entry too, so torch.distributed.checkpoint gives each rank its own
    return keyed_by_rank(state, topology.rank)


def shard_progress(state: Mapping[str, Any]) -> ShardProgress:
    """The worker positions, the next worker and ``done`` of a shard-stream state.

    Raises:
        StateError: the fields are inconsistent or malformed.
    """
    workers, n, nxt = state.get("workers"), state.get("num_workers"), state.get("next_worker")
    if not isinstance(workers, list) or n != len(workers) or not isinstance(nxt, int) or not 0 <= nxt < max(n, 1):
        raise StateError("shard-stream state fields 'workers', 'num_workers' and 'next_worker' are "
                         f"inconsistent ({n!r} workers, {len(workers) if isinstance(workers, list) else workers!r} "
                         f"positions, next {nxt!r}); pass the dict returned by state_dict()")
    try:
        positions = tuple(WorkerPosition(w["shard"], w["offset"], w["yielded"]) for w in workers)
    except (KeyError, TypeError) as exc:
        raise StateError(f"shard-stream state field 'workers' is malformed: {exc!r}") from exc
    return ShardProgress(positions, nxt, bool(state.get("done")))


def restore_shards(state: Mapping[str, Any], *, topology: Topology, fingerprint: str,
                   fields: Mapping[str, Any]) -> Cursor:
    """Verify a shard-stream state (kind, topology, fingerprint, every field) and say where
    it resumes: a pinned Cursor with its shard progress; pure.

    Raises:
        StateError, TopologyMismatchError, StateMismatchError: refused, with the reason.
    """
    verified = verify_state(state, kind="shards", mode="epochs", topology=topology, fingerprint=fingerprint,
                            plan_fields=fields)
    shard_progress(state)  # the top level is sound too, also when the rank resumes from its per_rank entry
    return Cursor(verified["epoch"], shards=shard_progress(verified), pinned=True)
