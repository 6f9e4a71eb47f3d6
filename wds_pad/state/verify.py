"""Verifying a saved state against the current loader, and where it resumes.

Invariants:
- :func:`verify_state` checks the whole state before anything is restored and raises
  with every differing field listed as saved and as now;
- a state from another data-parallel layout is refused with or without its ``topology``
  block (the layout is in the fingerprinted ``plan``), and an edited ``plan`` block no
  longer matches its fingerprint;
- a distributed run refuses a state without topology; a version-1 state (whose
  fingerprint did not cover the layout) is only accepted with its topology block;
- an elastic resume is exact or refused: :func:`elastic_view` plans what the earlier
  layouts left of the epoch (core/elastic/remainder.py), every entry not yet trained on exactly
  once; with policy none it needs every old DP rank's position (``per_rank``) and
  refuses naming the dp_ranks whose entries are missing; a saved remainder fingerprint
  that differs from the recomputed one is refused;
- a state that holds this rank's entry under ``per_rank`` while its top level is another
  rank's (what torch.distributed.checkpoint's deduplication gives back) resumes from that
  entry; an entry whose layout or plan is not the top level's (a load template left in
  place) is never used; a refusal of another rank's state says which entries it holds
  and how to save one per rank;
- :func:`restore` is pure: it says where to resume (a pinned Cursor) and mutates nothing.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from ..core.policy import check_flag
from ..core.topology import Topology
from ..errors import StateError, StateMismatchError, TopologyMismatchError
from .cursor import Cursor, epoch_length
from .elastic import ElasticView, Segment, elastic_view
from .schema import (
    LAYOUT_FIELDS,
    MAX_INDEX,
    PER_RANK,
    STATE_FORMAT,
    STATE_VERSION,
    TOPOLOGY_FIELDS,
    flatten,
    mismatch_table,
    check_schema,
    elastic_fingerprint,
    elastic_segments,
    fingerprint_of,
    keyed_by_rank,
    rank_key,
)
from .spec import PlanSpec

__all__ = ["make_state", "restore", "verify_state"]


def _same_job(entry: Mapping[str, Any], state: Mapping[str, Any]) -> bool:
    """``entry`` was saved by a rank of the job that saved ``state`` (same layout and plan)."""
    a, b = entry.get("topology"), state.get("topology")
    return (isinstance(a, Mapping) and isinstance(b, Mapping)
            and all(a.get(k) == b.get(k) for k in ("world_size", "dp_size", "cp_size"))
            and all(entry.get(k) == state.get(k) for k in ("format", "version", "kind", "mode", "fingerprint")))


#: Fields that differ between the ranks of one job: a DCP load mixes them from several
#: ranks into the top level. Every other field is the same on every rank.
_RANK_FIELDS = ("topology.rank", "topology.dp_rank", "topology.cp_rank")
#: ... and where ranks' positions differ too: uneven plans (policy none), the shard path.
_POSITION_FIELDS = ("index", "batches_in_epoch", "num_workers", "next_worker", "done", "workers")


def _unexpected_differences(entry: Mapping[str, Any], state: Mapping[str, Any]) -> list[str]:
    """Fields where the top level differs from this rank's entry though the ranks of one job
    agree on them (empty: the top level is what torch.distributed.checkpoint gives back)."""
    varying = set(_RANK_FIELDS)
    plan = state.get("plan")
    if state.get("kind") == "shards" or (isinstance(plan, Mapping) and plan.get("policy") == "none"):
        varying.update(_POSITION_FIELDS)
    a = flatten({k: v for k, v in entry.items() if k != PER_RANK}, "")
    b = flatten({k: v for k, v in state.items() if k != PER_RANK}, "")

    def varies(leaf: str) -> bool:
        return any(leaf == f or leaf.startswith((f + ".", f + "[")) for f in varying)
    return sorted(k[1:] for k in set(a) | set(b) if a.get(k) != b.get(k) and not varies(k[1:]))


#: Added to the refusal of another rank's state of this layout: the usual cause and the fixes.
ONE_COPY_HINT = (
    " A checkpoint that keeps one copy of the loader state for the whole job (Lightning, Fabric.save, "
    "accelerate's register_for_checkpointing) gives every rank the saving rank's state: build the "
    "Loader with gather_state=True, or save one state per rank (save_state_file(state, directory, "
    "rank)).")


def _own_entry(state: dict[str, Any], topology: Topology) -> tuple[dict[str, Any], str]:
    """The state to verify on this rank, and what to add to a topology refusal."""
    per, topo = state.get(PER_RANK), state.get("topology")
    if not isinstance(topo, Mapping):
        return state, ""
    key = rank_key(topology.rank)
    entry = per.get(key) if per is not None else None
    usable = isinstance(entry, Mapping) and _same_job(entry, state)
    odd = _unexpected_differences(entry, state) if usable else []  # type: ignore[arg-type]
    if usable and not odd:
        return check_schema({k: v for k, v in entry.items() if k != PER_RANK}), ""  # type: ignore[union-attr]
    if topo.get("rank") == topology.rank:
        return state, ""  # this rank's own state (edited, if it differs from its entry): verified as it is
    if odd:
        return state, (
            f" The top level differs from this rank's entry {PER_RANK}.{key} in {', '.join(odd[:6])}, where "
            "the ranks of one job agree: the state was edited, or the ranks were saved at different "
            "batches (save on every rank at the same step); pass the state_dict() unchanged.")
    now = topology.to_dict()
    same_layout = all(topo.get(k) == now[k] for k in ("world_size", "dp_size", "cp_size"))
    if per is None:
        return state, ONE_COPY_HINT if same_layout else ""
    held = sorted(per, key=lambda k: int(k[4:]))
    shown = ", ".join(held[:8]) + (", ..." if len(held) > 8 else "")
    hint = (f" The state's field {PER_RANK!r} has no entry of this rank ({key!r}) saved with it "
            f"(it holds {shown}).")
    if same_layout:
        return state, hint + ONE_COPY_HINT
    return state, hint + (
        f" With torch.distributed.checkpoint, the DCP key '<your key>.{PER_RANK}.{key}' is missing "
        "because the checkpoint was saved on another topology: restart with the saved topology, or load "
        "with dcp.load(..., planner=DefaultLoadPlanner(allow_partial_load=True)) into a state_dict() "
        "and pass it to load_state_dict(state, allow_elastic=True) to resume the rest of the epoch "
        "on this layout.")


def verify_state(state: Any, *, kind: str, mode: str, topology: Topology, fingerprint: str,
                 plan_fields: Mapping[str, Any], allow_elastic: bool = False) -> dict[str, Any]:
    """Verify a saved state against the current loader; return the state to restore.

    A state whose top level is another rank's but which holds this rank's entry under
    ``per_rank`` (torch.distributed.checkpoint keeps one copy of the top level) is
    verified and returned as that entry.

    Args:
        state: the saved state dict.
        kind, mode: the current loader's kind ("bucketed" / "shards") and mode.
        topology: the current topology.
        fingerprint: the current plan fingerprint (``fingerprint_of(plan_fields)``).
        plan_fields: the current fingerprint's ingredients (to name what differs).
        allow_elastic: accept another data-parallel layout (the caller then plans
            the rest of the epoch on the new one, core/elastic/remainder.py).

    Raises:
        StateError: corrupt / unknown-version state, or a ``plan`` block that does not
            match its fingerprint (edited).
        TopologyMismatchError: another world size, rank, dp or cp layout (in the
            topology block or in the plan's layout fields), or no topology in a
            distributed run.
        StateMismatchError: another plan (fingerprint), mode or loader kind.
        ConfigError: ``allow_elastic`` is not a bool.
    """
    allow_elastic = check_flag("load_state_dict: allow_elastic", allow_elastic)
    state, hint = _own_entry(check_schema(state), topology)
    try:
        return _verify(state, kind=kind, mode=mode, topology=topology, fingerprint=fingerprint,
                       plan_fields=plan_fields, allow_elastic=allow_elastic)
    except TopologyMismatchError as exc:
        if not hint:
            raise
        raise TopologyMismatchError(f"{exc}.{hint}" if not str(exc).endswith(".") else f"{exc}{hint}") from exc


def _verify(state: dict[str, Any], *, kind: str, mode: str, topology: Topology, fingerprint: str,
            plan_fields: Mapping[str, Any], allow_elastic: bool) -> dict[str, Any]:
    rows: list[tuple[str, Any, Any]] = []
    for name, now in (("kind", kind), ("mode", mode)):
        if state[name] != now:
            rows.append((name, state[name], now))
    saved_topo = state.get("topology")
    now_topo = topology.to_dict()
    if saved_topo is None:
        if topology.world_size > 1:
            raise TopologyMismatchError(
                f"this state has no topology and this is a distributed run "
                f"(world_size {topology.world_size}, rank {topology.rank}); it cannot be verified. "
                "Pass the state_dict() of this rank unchanged (save_state_file / load_state_file "
                "keep it whole), or start the epoch afresh"
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
                        "the rest of the epoch on this data-parallel layout")
                raise TopologyMismatchError(f"loader state is from another topology: {mismatch_table(topo_rows)}; {hint}")
    saved_plan = state.get("plan") or {}
    try:
        made = fingerprint_of(saved_plan)
    except (TypeError, ValueError):
        made = None
    if made != state["fingerprint"]:
        raise StateError(
            "loader state field 'plan' does not match the state's fingerprint: the state was "
            "edited or damaged; pass the dict returned by state_dict() unchanged, or start afresh")
    now_fp = fingerprint
    layout_keys = {f"plan.{k}" for k in LAYOUT_FIELDS}
    if state["fingerprint"] != now_fp:
        saved = flatten(saved_plan, "plan")
        now_fields = flatten(plan_fields, "plan")
        keys = sorted(set(saved) | set(now_fields))
        diff = [(k, saved.get(k), now_fields.get(k)) for k in keys if saved.get(k) != now_fields.get(k)]
        layout_rows = [r for r in diff if r[0] in layout_keys]
        other_rows = [r for r in diff if r[0] not in layout_keys]
        if layout_rows and not allow_elastic and not other_rows and not rows:
            raise TopologyMismatchError(
                f"loader state was saved on another data-parallel layout: {mismatch_table(layout_rows)}; "
                "restart with the saved topology, or pass allow_elastic=True to resume the rest of "
                "the epoch on this data-parallel layout")
        rows.extend(other_rows + ([] if allow_elastic else layout_rows))
        if not diff:
            rows.append(("fingerprint", state["fingerprint"], now_fp))
    if rows:
        raise StateMismatchError(
            f"loader state belongs to another plan: {mismatch_table(rows)}; resume with the same "
            "index, seed, batch size, padding policy, mode, datasets and data-parallel layout, "
            "or start afresh"
        )
    return state


def make_state(spec: PlanSpec, cursor: Cursor, *, kind: str = "bucketed") -> dict[str, Any]:
    """The JSON-safe state of a loader over ``spec`` at ``cursor`` (its epoch, index, the
    elastic view it is in and, in a DataLoader worker's own state, the worker)."""
    epoch, view, worker = cursor.epoch, cursor.view, cursor.worker
    state: dict[str, Any] = {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "kind": kind,
        "mode": spec.mode.value,
        "epoch": int(epoch),
        "index": int(cursor.index),
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
    return keyed_by_rank(state, spec.topology.rank)


def restore(spec: PlanSpec, state: Mapping[str, Any], *, allow_elastic: bool = False,
            worker: tuple[int, int] | None = None, kind: str = "bucketed") -> Cursor:
    """Verify ``state`` against ``spec`` (a PlanSpec) and say where to resume; pure.

    Args:
        spec: the current PlanSpec.
        state: a saved state.
        allow_elastic: accept another DP layout and resume the rest of the epoch on it.
        worker: ``(id, num_workers)`` when called inside a DataLoader worker.
        kind: the loader kind.

    Returns:
        A pinned Cursor: the next iteration starts exactly there (even at the end of an
        epoch, where it then yields nothing), with the elastic view of a resumed epoch
        and, for a DataLoader worker's own state, the worker.

    Raises:
        StateError, StateMismatchError, TopologyMismatchError: refused, with the reason.
    """
    raw = state
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
    saved_topo = state.get("topology")
    if saved_topo is None:  # a single process (verify_state refuses it elsewhere): the plan's layout
        saved_topo = {**now.to_dict(), "dp_size": state["plan"]["dp_size"], "dp_rank": 0}
    lockstep = spec.resolved_policy.value != "none"  # every DP rank has a batch at every step
    saved_nodes = int(state["plan"].get("node_ranks", 0) or 0)  # locality="node": DP ranks per node
    same_nodes = saved_nodes == int(spec.fingerprint_fields().get("node_ranks", 0) or 0)
    if saved_topo["dp_size"] == now.dp_size and same_nodes and (lockstep or saved_topo["dp_rank"] == now.dp_rank):
        view = _view(spec, epoch, segments, state) if segments else None
        n = epoch_length(spec, epoch, view)
        if index > n:
            raise StateMismatchError(f"loader state position {index} is past the end of epoch {epoch} "
                                     f"({n} batches on this rank); the state does not belong to this plan")
        return Cursor(epoch, index, view, saved_w, pinned=True)
    # another data-parallel layout, accepted by verify_state because allow_elastic=True
    saved_n = state.get("batches_in_epoch")
    if saved_w is not None:
        raise TopologyMismatchError("allow_elastic: a DataLoader worker's own state cannot be remapped "
                                    "onto another layout; save and load the Loader's state_dict()")
    old = int(saved_topo["dp_size"])
    if lockstep:
        if saved_n is not None and index >= saved_n:  # the epoch was finished
            return _finished(spec, epoch)
        if index == 0 and not segments:
            return Cursor(epoch, 0, pinned=True)
        segment = Segment(old, steps=index, node_ranks=saved_nodes)
    else:
        positions = _positions(raw, state, old, epoch)
        if all(p >= n for p, n in positions.values()):
            return _finished(spec, epoch)
        if not any(p for p, _ in positions.values()) and not segments:
            return Cursor(epoch, 0, pinned=True)
        segment = Segment(old, positions=tuple(positions[d][0] for d in range(old)), node_ranks=saved_nodes)
    if segments:
        _view(spec, epoch, segments, state, now=Segment(old, steps=0, node_ranks=saved_nodes).topology())
    return Cursor(epoch, 0, elastic_view(spec, epoch, segments + (segment,)), pinned=True)


def _finished(spec: PlanSpec, epoch: int) -> Cursor:
    if spec.mode.value == "epochs":
        return Cursor(epoch, len(spec.plan(epoch)), pinned=True)
    return Cursor(epoch + 1, 0, pinned=True)


def _view(spec: PlanSpec, epoch: int, segments: tuple[Segment, ...], state: Mapping[str, Any],
          now: Topology | None = None) -> ElasticView:
    """The view the state was saved in, checked against its saved fingerprint."""
    saved = elastic_fingerprint(state)
    if not saved:
        raise StateMismatchError(
            "loader state field 'elastic.segments' holds no fingerprint: it was saved inside an epoch "
            "resumed elastically by an earlier wds_pad, whose remainder was planned differently; resume "
            "from the epoch's end (or start) or with the wds_pad that saved it")
    # the remainder as planned on the saved layout (its rank 0: every rank's fingerprint is the same)
    at = spec if now is None else replace(spec, topology=now)
    view = elastic_view(at, epoch, segments)
    if view.fingerprint != saved:
        raise StateMismatchError(
            f"loader state field elastic.segments[-1][2] (the fingerprint): saved {saved!r}, now "
            f"{view.fingerprint!r}: the rest of epoch {epoch} after the layouts "
            f"{[s.to_json()[:2] for s in segments]} is planned differently "
            "here (the state was edited, or saved by another wds_pad); resume from an epoch boundary")
    return view


def _positions(raw: Mapping[str, Any], state: Mapping[str, Any], dp: int, epoch: int) -> dict[int, tuple[int, int]]:
    """(index, batches_in_epoch) of every dp_rank of the saved layout, from the state's
    ``per_rank`` entries (policy none: ranks' positions differ).

    Raises:
        TopologyMismatchError: naming the dp_ranks with no entry, and how to save them.
    """
    found: dict[int, tuple[int, int]] = {}
    per = raw.get(PER_RANK) if isinstance(raw, Mapping) else None
    candidates = [state] + (list(per.values()) if isinstance(per, Mapping) else [])
    for entry in candidates:
        topo = entry.get("topology") if isinstance(entry, Mapping) else None
        if (not isinstance(topo, Mapping) or not _same_job(entry, state) or entry.get("epoch") != epoch
                or entry.get("elastic") != state.get("elastic")):
            continue
        d = topo.get("dp_rank")
        if isinstance(d, int) and 0 <= d < dp and d not in found:
            n = entry.get("batches_in_epoch")
            found[d] = (int(entry["index"]), int(n) if isinstance(n, int) else MAX_INDEX)
    missing = [d for d in range(dp) if d not in found]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        raise TopologyMismatchError(
            f"allow_elastic: the state was saved mid-epoch (epoch {epoch}) with padding policy 'none', "
            f"where each DP rank is at its own position, and it holds no entry of dp_rank {shown} of the "
            f"saved dp_size {dp} under {PER_RANK!r}; pass a state with every rank's entry (Loader(..., "
            "gather_state=True), or merge the ranks' states' per_rank entries), resume on the saved "
            "layout, or from an epoch boundary")
    return found
