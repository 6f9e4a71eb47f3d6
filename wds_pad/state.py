"""Loader state: the schema, its verification, and atomic per-rank state files.

A state is small, JSON-safe and versioned::

    {"format": "wds_pad.state", "version": 1, "kind": "bucketed" | "shards",
     "mode": "epochs" | "steps", "epoch": 3, "index": 120, "batches_in_epoch": 606,
     "topology": {"world_size": 8, "rank": 5, "dp_size": 4, "dp_rank": 2,
                  "cp_size": 2, "cp_rank": 1},
     "fingerprint": "<hex>", "plan": {<the fingerprint's ingredients>}}

Invariants:
- :func:`verify_state` checks the whole state before anything is restored and raises
  with every differing field listed as saved and as now;
- a distributed run refuses a state without topology (an older format);
- state files are written atomically (temp file + fsync + rename), one per rank, the
  rank in the file name; loading rank r's file on another rank is refused.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Mapping

from .errors import StateError, StateMismatchError, TopologyMismatchError
from .topology import Topology

__all__ = [
    "STATE_VERSION",
    "load_state_file",
    "save_state_file",
    "state_path",
    "verify_state",
]

STATE_FORMAT = "wds_pad.state"
STATE_VERSION = 1
TOPOLOGY_FIELDS = ("world_size", "rank", "dp_size", "dp_rank", "cp_size", "cp_rank")


def _table(rows: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{name}: saved {saved!r}, now {now!r}" for name, saved, now in rows)


def check_schema(state: Any) -> dict[str, Any]:
    """Structural checks; raises StateError naming the bad field."""
    if not isinstance(state, Mapping):
        raise StateError(f"a loader state must be a dict, got {type(state).__name__}")
    if state.get("format") != STATE_FORMAT:
        raise StateError(f"not a wds_pad loader state (format {state.get('format')!r}); "
                         "pass the dict returned by state_dict()")
    version = state.get("version")
    if version != STATE_VERSION:
        raise StateError(f"loader state version {version!r} is not supported (this wds_pad "
                         f"reads version {STATE_VERSION}); save it again with this version")
    for name in ("epoch", "index"):
        v = state.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise StateError(f"loader state field {name!r} must be an int >= 0, got {v!r}")
    for name in ("kind", "mode", "fingerprint"):
        if not isinstance(state.get(name), str):
            raise StateError(f"loader state field {name!r} is missing or not a string")
    return dict(state)


def verify_state(state: Any, *, kind: str, mode: str, topology: Topology, fingerprint: str,
                 plan_fields: Mapping[str, Any], allow_elastic: bool = False) -> dict[str, Any]:
    """Verify a saved state against the current loader; return it if it may be restored.

    Args:
        state: the saved state dict.
        kind, mode: the current loader's kind ("bucketed" / "shards") and mode.
        topology: the current topology.
        fingerprint: the current plan fingerprint.
        plan_fields: the current fingerprint's ingredients (to name what differs).
        allow_elastic: accept another data-parallel layout (the caller then checks
            that the saved position maps exactly onto the new one).

    Raises:
        StateError: corrupt / unknown-version state.
        TopologyMismatchError: another world size, rank, dp or cp layout, or no topology
            in a distributed run.
        StateMismatchError: another plan (fingerprint), mode or loader kind.
    """
    state = check_schema(state)
    rows: list[tuple[str, Any, Any]] = []
    for name, now in (("kind", kind), ("mode", mode)):
        if state[name] != now:
            rows.append((name, state[name], now))
    saved_topo = state.get("topology")
    now_topo = topology.to_dict()
    if saved_topo is None:
        if topology.world_size > 1:
            raise TopologyMismatchError(
                f"this state has no topology (an older format) and this is a distributed run "
                f"(world_size {topology.world_size}); it cannot be verified. Start the epoch "
                "afresh, or re-save the state with this wds_pad in the original job"
            )
    elif not isinstance(saved_topo, Mapping):
        raise StateError(f"loader state field 'topology' must be a dict, got {type(saved_topo).__name__}")
    else:
        topo_rows = [(f"topology.{k}", saved_topo.get(k), now_topo[k]) for k in TOPOLOGY_FIELDS
                     if saved_topo.get(k) != now_topo[k]]
        if topo_rows:
            layout_same = all(saved_topo.get(k) == now_topo[k] for k in ("dp_size", "cp_size", "world_size"))
            if not allow_elastic or layout_same:
                hint = ("load the state file saved by this rank" if layout_same else
                        "restart with the saved topology, or pass allow_elastic=True to resume "
                        "on another data-parallel layout where the position maps exactly")
                raise TopologyMismatchError(f"loader state is from another topology: {_table(topo_rows)}; {hint}")
    if state["fingerprint"] != fingerprint:
        saved_fields = state.get("plan") or {}
        diff = [(f"plan.{k}", saved_fields.get(k), v) for k, v in plan_fields.items()
                if saved_fields.get(k) != v and not (allow_elastic and k == "pad_unit")]
        if diff or not allow_elastic:
            rows.extend(diff or [("fingerprint", state["fingerprint"], fingerprint)])
    if rows:
        raise StateMismatchError(
            f"loader state belongs to another plan: {_table(rows)}; resume with the same "
            "index, seed, batch size, padding policy and datasets, or start afresh"
        )
    return state


def state_path(directory: str, rank: int, prefix: str = "loader") -> str:
    """``DIRECTORY/<prefix>-rank00005.json``: one file per rank, the rank in the name."""
    return os.path.join(directory, f"{prefix}-rank{rank:05d}.json")


def save_state_file(state: Mapping[str, Any], directory: str, rank: int, prefix: str = "loader") -> str:
    """Write ``state`` atomically to this rank's file; returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = state_path(directory, rank, prefix)
    data = json.dumps({"saved_by_rank": rank, "state": dict(state)}, sort_keys=True).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{prefix}-rank{rank:05d}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def load_state_file(path: str, rank: int) -> dict[str, Any]:
    """Read a state file written by :func:`save_state_file` for ``rank``.

    Raises:
        StateError: missing, truncated or corrupt file.
        TopologyMismatchError: the file was saved by another rank.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise StateError(f"state file {path!r} does not exist") from None
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise StateError(f"state file {path!r} is corrupt or truncated ({len(raw)} bytes: {exc}); "
                         "resume from an earlier checkpoint") from exc
    if not isinstance(doc, dict) or "state" not in doc or "saved_by_rank" not in doc:
        raise StateError(f"state file {path!r} is not a wds_pad state file")
    if doc["saved_by_rank"] != rank:
        raise TopologyMismatchError(
            f"state file {path!r} was saved by rank {doc['saved_by_rank']}, this is rank {rank}; "
            f"load {os.path.basename(state_path('', rank))} instead"
        )
    return check_schema(doc["state"])
