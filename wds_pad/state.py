"""Loader state: the schema, its verification, elastic remapping, atomic per-rank files.

A state is small, JSON-safe and versioned (docs/resume.md describes every field)::

    {"format": "wds_pad.state", "version": 1, "kind": "bucketed" | "shards",
     "mode": "epochs" | "steps", "epoch": 3, "index": 120, "batches_in_epoch": 606,
     "topology": {"world_size": 8, "rank": 5, "dp_size": 4, "dp_rank": 2,
                  "cp_size": 2, "cp_rank": 1},
     "fingerprint": "<hex>", "plan": {<the fingerprint's ingredients>},
     "elastic": {"segments": [[8, 120]]}     # only in an epoch resumed on another layout
     "worker": {"id": 1, "num_workers": 2}}  # only in a DataLoader worker's own state

Invariants:
- :func:`verify_state` checks the whole state before anything is restored and raises
  with every differing field listed as saved and as now;
- a distributed run refuses a state without topology (an older format);
- an elastic resume is exact or refused: :func:`elastic_view` removes from the new
  layout's epoch exactly the windows the earlier layouts consumed, and refuses (naming
  the bucket) when a consumed prefix is not a whole number of the new global steps;
- state files are written atomically (temp file + fsync + rename), one per rank, the
  rank in the file name, with a checksum; loading rank r's file on another rank is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ._atomic import atomic_write
from ._elastic import ElasticView, elastic_view
from .errors import StateError, StateMismatchError, TopologyMismatchError
from .plan import Plan, plan_epoch
from .topology import Topology

__all__ = [
    "STATE_VERSION",
    "ElasticView",
    "Resume",
    "elastic_view",
    "epoch_length",
    "load_state_file",
    "make_state",
    "restore",
    "save_state_file",
    "state_path",
    "verify_state",
]

STATE_FORMAT = "wds_pad.state"
STATE_VERSION = 1
TOPOLOGY_FIELDS = ("world_size", "rank", "dp_size", "dp_rank", "cp_size", "cp_rank")


def _table(rows: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{name}: saved {saved!r}, now {now!r}" for name, saved, now in rows)


def _is_count(v: Any, minimum: int = 0) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and v >= minimum


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
        if not _is_count(state.get(name)):
            raise StateError(f"loader state field {name!r} must be an int >= 0, got {state.get(name)!r}")
    if state.get("batches_in_epoch") is not None and not _is_count(state["batches_in_epoch"]):
        raise StateError(f"loader state field 'batches_in_epoch' must be an int >= 0, "
                         f"got {state['batches_in_epoch']!r}")
    for name in ("kind", "mode", "fingerprint"):
        if not isinstance(state.get(name), str):
            raise StateError(f"loader state field {name!r} is missing or not a string")
    topo = state.get("topology")
    if topo is not None and (not isinstance(topo, Mapping) or
                             not all(_is_count(topo.get(k)) for k in TOPOLOGY_FIELDS)):
        raise StateError(f"loader state field 'topology' must map {', '.join(TOPOLOGY_FIELDS)} "
                         f"to ints >= 0, got {topo!r}")
    elastic_segments(state)
    worker = state.get("worker")
    if worker is not None and (not isinstance(worker, Mapping) or not _is_count(worker.get("id"))
                               or not _is_count(worker.get("num_workers"), 1)):
        raise StateError(f"loader state field 'worker' must be {{'id': int, 'num_workers': int}}, got {worker!r}")
    return dict(state)


def elastic_segments(state: Mapping[str, Any]) -> tuple[tuple[int, int], ...]:
    """The ``(dp_size, steps)`` layouts that consumed the saved epoch before this one."""
    elastic = state.get("elastic")
    if elastic is None:
        return ()
    segments = elastic.get("segments") if isinstance(elastic, Mapping) else None
    if not isinstance(segments, list) or not all(
            isinstance(s, (list, tuple)) and len(s) == 2 and _is_count(s[0], 1) and _is_count(s[1])
            for s in segments):
        raise StateError(f"loader state field 'elastic' must be {{'segments': [[dp_size, steps], ...]}}, "
                         f"got {elastic!r}")
    return tuple((int(d), int(s)) for d, s in segments)


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    """``{"datasets": [{"repeats": 1}]}`` -> ``{"plan.datasets[0].repeats": 1}``: one row per field."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}"))
        return out
    if isinstance(value, (list, tuple)) and any(isinstance(v, Mapping) for v in value):
        out = {f"{prefix}.count": len(value)}
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


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
                f"(world_size {topology.world_size}, rank {topology.rank}); it cannot be verified. "
                "Start the epoch afresh, or re-save the state with this wds_pad in the original job"
            )
    else:
        topo_rows = [(f"topology.{k}", saved_topo.get(k), now_topo[k]) for k in TOPOLOGY_FIELDS
                     if saved_topo.get(k) != now_topo[k]]
        if topo_rows:
            layout_same = all(saved_topo.get(k) == now_topo[k] for k in ("dp_size", "cp_size", "world_size"))
            if not allow_elastic or layout_same:
                hint = ("load the state file saved by this rank (save_state_file / load_state_file "
                        "name it by rank)" if layout_same else
                        "restart with the saved topology, or pass allow_elastic=True to resume "
                        "on another data-parallel layout where the position maps exactly")
                raise TopologyMismatchError(f"loader state is from another topology: {_table(topo_rows)}; {hint}")
    if state["fingerprint"] != fingerprint:
        saved = _flatten(state.get("plan") or {}, "plan")
        now_fields = _flatten(plan_fields, "plan")
        diff = [(k, saved.get(k), now_fields.get(k)) for k in sorted(set(saved) | set(now_fields))
                if saved.get(k) != now_fields.get(k) and not (allow_elastic and k == "plan.pad_unit")]
        rows.extend(diff or [("fingerprint", state["fingerprint"], fingerprint)])
    if rows:
        raise StateMismatchError(
            f"loader state belongs to another plan: {_table(rows)}; resume with the same "
            "index, seed, batch size, padding policy, mode and datasets, or start afresh"
        )
    return state


# -- making and restoring states of a planned loader ------------------------------------------
@dataclass(frozen=True)
class Resume:
    """Where a verified state resumes: ``(epoch, index)`` in the epoch's view, the elastic
    view of that epoch (or None) and the DataLoader worker the position belongs to."""

    epoch: int
    index: int
    view: ElasticView | None = None
    worker: tuple[int, int] | None = None


def epoch_length(spec: Any, epoch: int, view: ElasticView | None) -> int:
    """Batches of ``epoch`` on this rank, in the elastic view if it covers that epoch."""
    return int(view.keep.size) if view is not None and view.epoch == epoch else len(spec.plan(epoch))


def make_state(spec: Any, epoch: int, index: int, *, kind: str = "bucketed",
               view: ElasticView | None = None, worker: tuple[int, int] | None = None) -> dict[str, Any]:
    """The JSON-safe state of a loader over ``spec`` (a PlanSpec) at ``(epoch, index)``."""
    state: dict[str, Any] = {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "kind": kind,
        "mode": spec.mode.value,
        "epoch": int(epoch),
        "index": int(index),
        "batches_in_epoch": epoch_length(spec, epoch, view),
        "topology": spec.topology.to_dict(),
        "fingerprint": spec.fingerprint(),
        "plan": spec.fingerprint_fields(),
        # always present, so the key structure is fixed (torch.distributed.checkpoint loads
        # into the current state_dict() as a template and drops keys the template lacks)
        "elastic": view.to_json() if view is not None and view.epoch == epoch else {"segments": []},
    }
    if worker is not None:
        state["worker"] = {"id": worker[0], "num_workers": worker[1]}
    return state


def _plan_on(spec: Any, epoch: int) -> Callable[[int], Plan]:
    datasets = spec.datasets()

    def plan_for(dp_size: int) -> Plan:
        return plan_epoch(datasets, Topology(world_size=dp_size, rank=0), seed=spec.seed, epoch=epoch,
                          batch_size=spec.batch_size, policy=spec.policy, mode=spec.mode,
                          oversubscribe=spec.oversubscribe, pad_to=spec.pad_to, warn=False)
    return plan_for


def restore(spec: Any, state: Mapping[str, Any], *, allow_elastic: bool = False,
            worker: tuple[int, int] | None = None, kind: str = "bucketed") -> Resume:
    """Verify ``state`` against ``spec`` (a PlanSpec) and say where to resume; pure.

    Args:
        spec: the current PlanSpec.
        state: a saved state.
        allow_elastic: accept another DP layout where the position maps exactly.
        worker: ``(id, num_workers)`` when called inside a DataLoader worker.
        kind: the loader kind.

    Raises:
        StateError, StateMismatchError, TopologyMismatchError: refused, with the reason.
    """
    state = verify_state(state, kind=kind, mode=spec.mode.value, topology=spec.topology,
                         fingerprint=spec.fingerprint(), plan_fields=spec.fingerprint_fields(),
                         allow_elastic=allow_elastic)
    epoch, index, segments = state["epoch"], state["index"], elastic_segments(state)
    saved_worker = state.get("worker")
    saved_w = (saved_worker["id"], saved_worker["num_workers"]) if saved_worker else None
    if saved_w is not None and saved_w != worker:
        where = "the main process" if worker is None else f"DataLoader worker {worker[0]} of {worker[1]}"
        raise StateMismatchError(
            f"loader state field worker: saved {saved_worker!r} (a DataLoader worker's own position, "
            f"as torchdata's StatefulDataLoader keeps it), now {where}; resume through the same "
            "StatefulDataLoader with the same num_workers, or save the Loader's state_dict() instead")
    now = spec.topology
    saved_topo = state.get("topology") or now.to_dict()
    lockstep = spec.resolved_policy.value != "none"  # every DP rank has a batch at every step
    if saved_topo["dp_size"] == now.dp_size and (lockstep or saved_topo["dp_rank"] == now.dp_rank):
        view = elastic_view(_plan_on(spec, epoch), epoch, segments, spec.plan(epoch)) if segments else None
        n = epoch_length(spec, epoch, view)
        if index > n:
            raise StateMismatchError(f"loader state position {index} is past the end of epoch {epoch} "
                                     f"({n} batches on this rank); the state does not belong to this plan")
        return Resume(epoch, index, view, saved_w)
    # another data-parallel layout, accepted by verify_state because allow_elastic=True
    saved_n = state.get("batches_in_epoch")
    if saved_w is not None:
        raise TopologyMismatchError("allow_elastic: a DataLoader worker's own state cannot be remapped "
                                    "onto another layout; save and load the Loader's state_dict()")
    if saved_n is not None and index >= saved_n:  # the epoch was finished
        if spec.mode.value == "epochs":
            return Resume(epoch, len(spec.plan(epoch)))
        return Resume(epoch + 1, 0)
    if index == 0 and not segments:
        return Resume(epoch, 0)
    if not lockstep:
        raise TopologyMismatchError(
            f"allow_elastic: the state was saved mid-epoch (epoch {epoch}, batch {index}) with padding "
            "policy 'none', where ranks have unequal batch counts, so one rank's position does not "
            "give the job's; resume on the saved layout, or from an epoch boundary")
    segments = segments + ((int(saved_topo["dp_size"]), index),)
    return Resume(epoch, 0, elastic_view(_plan_on(spec, epoch), epoch, segments, spec.plan(epoch)))


# -- per-rank state files -------------------------------------------------------------------
def state_path(directory: str, rank: int, prefix: str = "loader") -> str:
    """``DIRECTORY/<prefix>-rank00005.json``: one file per rank, the rank in the name."""
    return os.path.join(directory, f"{prefix}-rank{rank:05d}.json")


def _checksum(state: Mapping[str, Any]) -> str:
    return hashlib.blake2b(json.dumps(state, sort_keys=True).encode(), digest_size=16).hexdigest()


def save_state_file(state: Mapping[str, Any], directory: str, rank: int, prefix: str = "loader") -> str:
    """Write ``state`` atomically (temp file, fsync, rename) to this rank's file.

    Args:
        state: a JSON-safe state, e.g. ``loader.state_dict()``.
        directory: the checkpoint directory (created if missing).
        rank: this process's rank (part of the file name and checked on load).
        prefix: file name prefix.

    Returns:
        The path written.
    """
    os.makedirs(directory, exist_ok=True)
    path = state_path(directory, rank, prefix)
    try:
        data = json.dumps({"saved_by_rank": rank, "checksum": _checksum(state), "state": dict(state)},
                          sort_keys=True).encode()
    except (TypeError, ValueError) as exc:
        raise StateError(f"state for {path!r} is not JSON-safe: {exc}") from exc
    atomic_write(path, [data], tmp_prefix=f".{prefix}-rank{rank:05d}.")
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
        raise StateError(f"state file {path!r} does not exist; check the checkpoint directory "
                         "or start afresh") from None
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise StateError(f"state file {path!r} is corrupt or truncated ({len(raw)} bytes: {exc}); "
                         "resume from an earlier checkpoint") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("state"), dict) or "saved_by_rank" not in doc:
        raise StateError(f"state file {path!r} is not a wds_pad state file (expected keys "
                         "saved_by_rank, checksum, state)")
    if doc.get("checksum") != _checksum(doc["state"]):
        raise StateError(f"state file {path!r} is corrupt: its checksum does not match its "
                         "content; resume from an earlier checkpoint")
    if doc["saved_by_rank"] != rank:
        raise TopologyMismatchError(
            f"state file {path!r} was saved by rank {doc['saved_by_rank']}, this is rank {rank}; "
            f"load {os.path.basename(state_path('', rank))} instead"
        )
    return check_schema(doc["state"])
