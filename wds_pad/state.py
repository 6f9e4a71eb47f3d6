"""Loader state: the schema, its verification, elastic remapping, atomic per-rank files.

A state is small, JSON-safe and versioned (docs/resume.md describes every field)::

    {"format": "wds_pad.state", "version": 2, "kind": "bucketed" | "shards",
     "mode": "epochs" | "steps", "epoch": 3, "index": 120, "batches_in_epoch": 606,
     "topology": {"world_size": 8, "rank": 5, "dp_size": 4, "dp_rank": 2,
                  "cp_size": 2, "cp_rank": 1},
     "fingerprint": "<hex>", "plan": {<the fingerprint's ingredients>},
     "elastic": {"segments": [[8, 120]]}     # only in an epoch resumed on another layout
     "worker": {"id": 1, "num_workers": 2}}  # only in a DataLoader worker's own state

Invariants:
- :func:`verify_state` checks the whole state before anything is restored and raises
  with every differing field listed as saved and as now; every field it reads is
  type-checked first;
- the fingerprint is the digest of the ``plan`` block, which holds everything that
  shapes this rank's plan except its own rank: seed, datasets, batch size, policy, and
  the data-parallel layout (``dp_size``, ``pad_unit``). So a state from another layout
  is refused with or without its ``topology`` block, and an edited ``plan`` block no
  longer matches its fingerprint;
- a distributed run refuses a state without topology; a version-1 state (whose
  fingerprint did not cover the layout) is only accepted with its topology block;
- an elastic resume is exact or refused: :func:`elastic_view` removes from the new
  layout's epoch exactly the windows the earlier layouts consumed, and refuses (naming
  the bucket) when a consumed prefix is not a whole number of the new global steps;
- state files are written atomically (temp file + fsync + rename), one per rank, the
  rank in the file name, with a checksum over the state and ``saved_by_rank``; loading
  rank r's file on another rank is refused; a wrong kind of path is a StateError.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ._atomic import atomic_write
from ._elastic import ElasticView, elastic_view
from .errors import StateError, StateMismatchError, TopologyMismatchError
from .plan import MAX_EPOCH, Plan, plan_epoch
from .topology import Topology

__all__ = [
    "STATE_VERSION",
    "ElasticView",
    "Resume",
    "elastic_view",
    "epoch_length",
    "fingerprint_of",
    "load_state_file",
    "make_state",
    "restore",
    "save_state_file",
    "state_path",
    "verify_state",
]

STATE_FORMAT = "wds_pad.state"
STATE_VERSION = 2
#: Versions this wds_pad reads. Version 1's fingerprint did not cover the data-parallel
#: layout, so a version-1 state is accepted only with its topology block.
READABLE_VERSIONS = (1, 2)
TOPOLOGY_FIELDS = ("world_size", "rank", "dp_size", "dp_rank", "cp_size", "cp_rank")
KINDS = ("bucketed", "shards")
MODES = ("epochs", "steps")
#: Plan fields that describe the data-parallel layout: they differ, by design, on an
#: elastic resume (allow_elastic=True), which then checks the position maps exactly.
LAYOUT_FIELDS = ("dp_size", "pad_unit")
#: Largest batch index or batch count a state may hold (far beyond any real epoch).
MAX_INDEX = 2**53
STATE_FILE_FORMAT = "wds_pad.state_file"


def fingerprint_of(fields: Mapping[str, Any]) -> str:
    """The fingerprint of a plan: a stable digest of its JSON-safe ``fields``.

    A state carries both, so :func:`verify_state` can check that its ``plan`` block is
    the one its fingerprint was made from, and then name each differing field.
    """
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _table(rows: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{name}: saved {saved!r}, now {now!r}" for name, saved, now in rows)


def _is_count(v: Any, minimum: int = 0) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and v >= minimum


def check_schema(state: Any) -> dict[str, Any]:
    """Structural checks of every field verification reads; raises StateError naming it."""
    if not isinstance(state, Mapping):
        raise StateError(f"a loader state must be a dict, got {type(state).__name__}")
    if state.get("format") != STATE_FORMAT:
        raise StateError(f"not a wds_pad loader state (format {state.get('format')!r}); "
                         "pass the dict returned by state_dict()")
    version = state.get("version")
    if not _is_count(version):
        raise StateError(f"loader state field 'version' must be an int, got {type(version).__name__} "
                         f"{version!r}; pass the dict returned by state_dict() unchanged")
    if version not in READABLE_VERSIONS:
        raise StateError(f"loader state version {version!r} is not supported (this wds_pad reads "
                         f"versions {', '.join(map(str, READABLE_VERSIONS))}); resume with the wds_pad "
                         "that saved it, or start the epoch afresh")
    for name, limit in (("epoch", MAX_EPOCH), ("index", MAX_INDEX)):
        value = state.get(name)
        if not _is_count(value) or value > limit:
            raise StateError(f"loader state field {name!r} must be an int in [0, {limit}], got {value!r}; "
                             "pass the dict returned by state_dict() unchanged")
    n = state.get("batches_in_epoch")
    if n is not None and (not _is_count(n) or n > MAX_INDEX):
        raise StateError(f"loader state field 'batches_in_epoch' must be an int in [0, {MAX_INDEX}], got {n!r}")
    for name, allowed in (("kind", KINDS), ("mode", MODES)):
        if state.get(name) not in allowed:
            raise StateError(f"loader state field {name!r} must be one of {', '.join(allowed)}, "
                             f"got {state.get(name)!r}")
    fp = state.get("fingerprint")
    if not isinstance(fp, str) or len(fp) != 32 or any(c not in "0123456789abcdef" for c in fp):
        raise StateError(f"loader state field 'fingerprint' must be 32 hex digits, got {fp!r}")
    plan = state.get("plan")
    if plan is None and version >= 2:
        raise StateError("loader state field 'plan' is missing: it is what the fingerprint is made of; "
                         "pass the dict returned by state_dict() unchanged")
    if plan is not None and not isinstance(plan, Mapping):
        raise StateError(f"loader state field 'plan' must be a dict, got {type(plan).__name__}")
    if version >= 2 and not _is_count(plan.get("dp_size"), 1):  # type: ignore[union-attr]
        raise StateError(f"loader state field 'plan.dp_size' must be an int >= 1, got "
                         f"{plan.get('dp_size')!r}; pass the dict returned by state_dict() unchanged")  # type: ignore[union-attr]
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
                 plan_fields: Mapping[str, Any], allow_elastic: bool = False,
                 legacy_fingerprint: str | None = None) -> dict[str, Any]:
    """Verify a saved state against the current loader; return it if it may be restored.

    Args:
        state: the saved state dict.
        kind, mode: the current loader's kind ("bucketed" / "shards") and mode.
        topology: the current topology.
        fingerprint: the current plan fingerprint (``fingerprint_of(plan_fields)``).
        plan_fields: the current fingerprint's ingredients (to name what differs).
        allow_elastic: accept another data-parallel layout (the caller then checks
            that the saved position maps exactly onto the new one).
        legacy_fingerprint: the current plan's fingerprint as version 1 computed it
            (None: version-1 states are refused).

    Raises:
        StateError: corrupt / unknown-version state, or a ``plan`` block that does not
            match its fingerprint (edited).
        TopologyMismatchError: another world size, rank, dp or cp layout (in the
            topology block or in the plan's layout fields), or no topology in a
            distributed run or in a version-1 state.
        StateMismatchError: another plan (fingerprint), mode or loader kind.
    """
    state = check_schema(state)
    version = state["version"]
    rows: list[tuple[str, Any, Any]] = []
    for name, now in (("kind", kind), ("mode", mode)):
        if state[name] != now:
            rows.append((name, state[name], now))
    saved_topo = state.get("topology")
    now_topo = topology.to_dict()
    if saved_topo is None:
        if version == 1:
            raise TopologyMismatchError(
                "this state has no topology and is of version 1, whose fingerprint does not cover the "
                "data-parallel layout, so it cannot be verified against this job's layout; restore the "
                "state's 'topology' block, or start the epoch afresh (set_epoch)")
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
                        "on another data-parallel layout where the position maps exactly")
                raise TopologyMismatchError(f"loader state is from another topology: {_table(topo_rows)}; {hint}")
    saved_plan = state.get("plan") or {}
    if version >= 2:
        try:
            made = fingerprint_of(saved_plan)
        except (TypeError, ValueError):
            made = None
        if made != state["fingerprint"]:
            raise StateError(
                "loader state field 'plan' does not match the state's fingerprint: the state was "
                "edited or damaged; pass the dict returned by state_dict() unchanged, or start afresh")
        now_fp = fingerprint
    else:
        now_fp = legacy_fingerprint
        if now_fp is None:
            raise StateError(f"loader state version 1 of kind {state['kind']!r} is not supported; "
                             "start the epoch afresh")
    layout_keys = {f"plan.{k}" for k in LAYOUT_FIELDS}
    if state["fingerprint"] != now_fp:
        saved = _flatten(saved_plan, "plan")
        now_fields = _flatten(plan_fields, "plan")
        keys = sorted(set(saved) | set(now_fields))
        if version == 1:  # its plan block had no layout fields of its own; the topology covers them
            keys = [k for k in keys if k in saved and k not in layout_keys]
        diff = [(k, saved.get(k), now_fields.get(k)) for k in keys if saved.get(k) != now_fields.get(k)]
        layout_rows = [r for r in diff if r[0] in layout_keys]
        other_rows = [r for r in diff if r[0] not in layout_keys]
        if layout_rows and not allow_elastic and not other_rows and not rows:
            raise TopologyMismatchError(
                f"loader state was saved on another data-parallel layout: {_table(layout_rows)}; "
                "restart with the saved topology, or pass allow_elastic=True to resume on another "
                "data-parallel layout where the position maps exactly")
        rows.extend(other_rows + ([] if allow_elastic else layout_rows))
        if not diff:
            rows.append(("fingerprint", state["fingerprint"], now_fp))
    if rows:
        raise StateMismatchError(
            f"loader state belongs to another plan: {_table(rows)}; resume with the same "
            "index, seed, batch size, padding policy, mode, datasets and data-parallel layout, "
            "or start afresh"
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
                         allow_elastic=allow_elastic, legacy_fingerprint=spec.legacy_fingerprint())
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


def _checksum(state: Mapping[str, Any], saved_by_rank: Any = None, legacy: bool = False) -> str:
    # version 1 files covered only the state; now saved_by_rank is covered too
    doc: Any = state if legacy else {"saved_by_rank": saved_by_rank, "state": state}
    return hashlib.blake2b(json.dumps(doc, sort_keys=True).encode(), digest_size=16).hexdigest()


def _check_rank(rank: Any, what: str) -> int:
    if not _is_count(rank):
        raise StateError(f"{what} must be an int >= 0 (a rank), got {type(rank).__name__} {rank!r}")
    return int(rank)


def save_state_file(state: Mapping[str, Any], directory: str, rank: int, prefix: str = "loader") -> str:
    """Write ``state`` atomically (temp file, fsync, rename) to this rank's file.

    Args:
        state: a JSON-safe state, e.g. ``loader.state_dict()``.
        directory: the checkpoint directory (created if missing).
        rank: this process's rank (part of the file name and checked on load).
        prefix: file name prefix.

    Returns:
        The path written.

    Raises:
        StateError: ``state`` is not JSON-safe, ``rank`` is not a rank, ``directory`` is a
            file (or under one), or this rank's file name is taken by a directory; nothing
            already saved is changed.
    """
    rank = _check_rank(rank, "save_state_file: rank")
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise StateError(f"save_state_file: directory must be a non-empty path, got {directory!r}")
    directory = os.fspath(directory)
    path = state_path(directory, rank, prefix)
    try:
        data = json.dumps({"format": STATE_FILE_FORMAT, "saved_by_rank": rank,
                           "checksum": _checksum(dict(state), rank), "state": dict(state)},
                          sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise StateError(f"state for {path!r} is not JSON-safe: {exc}") from exc
    if os.path.isdir(path):
        raise StateError(f"cannot save the loader state to {path!r}: a directory has that name; "
                         "remove it or save into another checkpoint directory")
    try:
        os.makedirs(directory, exist_ok=True)
        atomic_write(path, [data], tmp_prefix=f".{prefix}-rank{rank:05d}.")
    except (FileExistsError, NotADirectoryError) as exc:
        raise StateError(f"cannot save the loader state into {directory!r}: it (or a parent) is a file, "
                         "not a directory; choose another checkpoint directory") from exc
    except IsADirectoryError as exc:
        raise StateError(f"cannot save the loader state to {path!r}: a directory has that name; "
                         "remove it or save into another checkpoint directory") from exc
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.EEXIST):
            raise StateError(f"cannot save the loader state into {directory!r}: a parent is a file, not "
                             "a directory; choose another checkpoint directory") from exc
        raise StateError(f"cannot save the loader state to {path!r}: {exc.strerror or exc}; check the "
                         "checkpoint directory (permissions, free space)") from exc
    return path


def load_state_file(path: str, rank: int) -> dict[str, Any]:
    """Read a state file written by :func:`save_state_file` for ``rank``.

    Raises:
        StateError: missing, unreadable, truncated or corrupt file, a directory, or a
            checksum that does not cover the content (edited).
        TopologyMismatchError: the file was saved by another rank.
    """
    rank = _check_rank(rank, "load_state_file: rank")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise StateError(f"state file {path!r} does not exist; check the checkpoint directory "
                         "or start afresh") from None
    except IsADirectoryError:
        raise StateError(f"state file {path!r} is a directory; pass the file of this rank, "
                         f"e.g. {state_path(str(path), rank)!r}") from None
    except OSError as exc:
        raise StateError(f"state file {path!r} cannot be read ({exc.strerror or exc}); check the path "
                         "and its permissions") from exc
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise StateError(f"state file {path!r} is corrupt or truncated ({len(raw)} bytes: {exc}); "
                         "resume from an earlier checkpoint") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("state"), dict) or "saved_by_rank" not in doc:
        raise StateError(f"state file {path!r} is not a wds_pad state file (expected keys "
                         "saved_by_rank, checksum, state)")
    legacy = "format" not in doc
    if not legacy and doc["format"] != STATE_FILE_FORMAT:
        raise StateError(f"state file {path!r} is not a wds_pad state file (format {doc['format']!r})")
    if doc.get("checksum") != _checksum(doc["state"], doc["saved_by_rank"], legacy=legacy):
        raise StateError(f"state file {path!r} is corrupt: its checksum does not match its "
                         "content; resume from an earlier checkpoint")
    saved_by = doc["saved_by_rank"]
    if not _is_count(saved_by):
        raise StateError(f"state file {path!r}: field 'saved_by_rank' must be an int >= 0, got {saved_by!r}")
    if saved_by != rank:
        raise TopologyMismatchError(
            f"state file {path!r} was saved by rank {saved_by}, this is rank {rank}; "
            f"load {os.path.basename(state_path('', rank))} instead"
        )
    return check_schema(doc["state"])
