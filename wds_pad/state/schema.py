"""Loader state: the schema, its constants, the fingerprint, structural checks.

A state is small, JSON-safe and versioned (docs/resume.md describes every field)::

    {"format": "wds_pad.state", "version": 2, "kind": "bucketed" | "shards",
     "mode": "epochs" | "steps", "epoch": 3, "index": 120, "batches_in_epoch": 606,
     "topology": {"world_size": 8, "rank": 5, "dp_size": 4, "dp_rank": 2,
                  "cp_size": 2, "cp_rank": 1},
     "fingerprint": "<hex>", "plan": {<the fingerprint's ingredients>},
     "elastic": {"segments": [[8, 120, "<hex>"]]}  # non-empty only in an epoch resumed on another
                                                   # layout: earlier layouts, how far, the rest's digest
     "worker": {"id": 1, "num_workers": 2},  # only in a DataLoader worker's own state
     "per_rank": {"rank5": {<this same state, without per_rank>}}}

``per_rank`` holds the state again under its rank's key (every rank's, when gathered), so
a checkpoint that keeps one copy of a key every rank has (torch.distributed.checkpoint
deduplicates non-tensor values across ranks) still gives each rank its own entry.

Invariants:
- :func:`check_schema` type-checks every field verification reads, naming the field;
- ``per_rank`` maps ``"rank<r>"`` to a state of rank r without ``per_rank`` (checked
  when :func:`wds_pad.state.verify.verify_state` selects it);
- the fingerprint is the digest of the ``plan`` block (:func:`fingerprint_of`), which
  holds everything that shapes this rank's plan except its own rank: seed, datasets,
  batch size, policy, and the data-parallel layout (``dp_size``, ``pad_unit``).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from ..core.policy import MAX_EPOCH
from ..core.elastic.remainder import Segment
from ..core.seed import json_digest
from ..errors import StateError

__all__ = ["MAX_INDEX", "PER_RANK", "READABLE_VERSIONS", "STATE_FORMAT", "STATE_VERSION", "check_schema",
           "elastic_fingerprint", "elastic_segments", "fingerprint_of", "flatten", "is_count", "keyed_by_rank",
           "rank_key"]

STATE_FORMAT = "wds_pad.state"
STATE_VERSION = 2
#: Versions this wds_pad reads. Version 1's fingerprint did not cover the data-parallel
#: layout, so a version-1 state is accepted only with its topology block.
READABLE_VERSIONS = (2,)
TOPOLOGY_FIELDS = ("world_size", "rank", "dp_size", "dp_rank", "cp_size", "cp_rank")
KINDS = ("bucketed", "shards")
MODES = ("epochs", "steps")
#: Plan fields that describe the data-parallel layout: they differ, by design, on an
#: elastic resume (allow_elastic=True), which then plans the rest of the epoch on the new layout.
LAYOUT_FIELDS = ("dp_size", "pad_unit", "node_ranks")
#: Largest batch index or batch count a state may hold (far beyond any real epoch).
MAX_INDEX = 2**53
STATE_FILE_FORMAT = "wds_pad.state_file"
#: The field that holds the state again under its rank's key (see the module docstring).
PER_RANK = "per_rank"


def rank_key(rank: int) -> str:
    """The key of rank ``rank``'s entry in ``per_rank``: ``"rank5"``."""
    return f"rank{int(rank)}"


def keyed_by_rank(state: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """``state`` with its own entry under ``per_rank``: ``{**state, "per_rank": {"rank5": state}}``.

    torch.distributed.checkpoint keeps one copy of a key that every rank saves (so each rank
    would load the same rank's position); the entry's keys (``per_rank.rank5.index``)
    are this rank's own, so each rank loads its own.
    """
    own = {k: v for k, v in state.items() if k != PER_RANK}
    # a deep copy: DCP loads into the state_dict() in place, and a nested dict shared by
    # the top level and the entry would take the top level's (another rank's) values
    return {**own, PER_RANK: {rank_key(rank): copy.deepcopy(own)}}


def fingerprint_of(fields: Mapping[str, Any]) -> str:
    """The fingerprint of a plan: a stable digest of its JSON-safe ``fields``.

    A state carries both, so :func:`verify_state` can check that its ``plan`` block is
    the one its fingerprint was made from, and then name each differing field.
    """
    return json_digest(fields, compact=True, allow_nan=False)


def mismatch_table(rows: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{name}: saved {saved!r}, now {now!r}" for name, saved, now in rows)


def is_count(v: Any, minimum: int = 0) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and v >= minimum


def check_schema(state: Any) -> dict[str, Any]:
    """Structural checks of every field verification reads; raises StateError naming it."""
    if not isinstance(state, Mapping):
        raise StateError(f"a loader state must be a dict, got {type(state).__name__}")
    if state.get("format") != STATE_FORMAT:
        raise StateError(f"not a wds_pad loader state (format {state.get('format')!r}); "
                         "pass the dict returned by state_dict()")
    version = state.get("version")
    if not is_count(version):
        raise StateError(f"loader state field 'version' must be an int, got {type(version).__name__} "
                         f"{version!r}; pass the dict returned by state_dict() unchanged")
    if version not in READABLE_VERSIONS:
        made = "an earlier wds_pad 0.1" if version < STATE_VERSION else "a newer wds_pad"
        raise StateError(f"loader state version {version!r} is not supported: it was written by {made}; this wds_pad reads version "
                         f"{STATE_VERSION}: start the epoch afresh (set_epoch), or resume with the wds_pad "
                         "that saved it")
    for name, limit in (("epoch", MAX_EPOCH), ("index", MAX_INDEX)):
        value = state.get(name)
        if not is_count(value) or value > limit:
            raise StateError(f"loader state field {name!r} must be an int in [0, {limit}], got {value!r}; "
                             "pass the dict returned by state_dict() unchanged")
    n = state.get("batches_in_epoch")
    if n is not None and (not is_count(n) or n > MAX_INDEX):
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
    if version >= 2 and not is_count(plan.get("dp_size"), 1):  # type: ignore[union-attr]
        raise StateError(f"loader state field 'plan.dp_size' must be an int >= 1, got "
                         f"{plan.get('dp_size')!r}; pass the dict returned by state_dict() unchanged")  # type: ignore[union-attr]
    topo = state.get("topology")
    if topo is not None and (not isinstance(topo, Mapping) or
                             not all(is_count(topo.get(k)) for k in TOPOLOGY_FIELDS)):
        raise StateError(f"loader state field 'topology' must map {', '.join(TOPOLOGY_FIELDS)} "
                         f"to ints >= 0, got {topo!r}")
    elastic_segments(state)
    worker = state.get("worker")
    if worker is not None and (not isinstance(worker, Mapping) or not is_count(worker.get("id"))
                               or not is_count(worker.get("num_workers"), 1)):
        raise StateError(f"loader state field 'worker' must be {{'id': int, 'num_workers': int}}, got {worker!r}")
    per = state.get(PER_RANK)
    if per is not None and (not isinstance(per, Mapping) or not all(
            isinstance(k, str) and k.startswith("rank") and k[4:].isdigit() and isinstance(v, Mapping)
            for k, v in per.items())):
        raise StateError(f"loader state field {PER_RANK!r} must map 'rank<r>' to a state dict, got "
                         f"{type(per).__name__} with keys {list(per)[:4] if isinstance(per, Mapping) else per!r}; "
                         "pass the dict returned by state_dict() unchanged")
    return dict(state)


def elastic_segments(state: Mapping[str, Any]) -> tuple[Segment, ...]:
    """The layouts that consumed the saved epoch before the one that saved it, in order:
    ``[dp_size, steps]`` (lockstep) or ``[dp_size, [batch index of each dp_rank]]``
    (policy none), each followed by the fingerprint of the remainder it left (states saved
    before it was recorded have none)."""
    elastic = state.get("elastic")
    if elastic is None:
        return ()
    segments = elastic.get("segments") if isinstance(elastic, Mapping) else None

    def ok(s: Any) -> bool:
        if not (isinstance(s, (list, tuple)) and len(s) in (2, 3, 4) and is_count(s[0], 1)):
            return False
        if len(s) >= 3 and not isinstance(s[2], str):
            return False
        if len(s) == 4 and not is_count(s[3], 1):
            return False
        if isinstance(s[1], list):
            return len(s[1]) == s[0] and all(is_count(i) and i <= MAX_INDEX for i in s[1])
        return is_count(s[1]) and s[1] <= MAX_INDEX
    if not isinstance(segments, list) or not all(ok(s) for s in segments):
        raise StateError(f"loader state field 'elastic' must be {{'segments': [[dp_size, steps or "
                         f"[index per dp_rank], fingerprint(, DP ranks per node)], ...]}}, got {elastic!r}")
    return tuple(
        Segment(int(s[0]), **({"steps": int(s[1])} if not isinstance(s[1], list)
                              else {"positions": tuple(int(i) for i in s[1])}),
                fingerprint=s[2] if len(s) >= 3 else "", node_ranks=int(s[3]) if len(s) == 4 else 0)
        for s in segments)


def elastic_fingerprint(state: Mapping[str, Any]) -> str:
    """The saved remainder's fingerprint: the last segment's ("" if none is recorded)."""
    segments = elastic_segments(state)
    return segments[-1].fingerprint if segments else ""


def flatten(value: Any, prefix: str) -> dict[str, Any]:
    """``{"datasets": [{"repeats": 1}]}`` -> ``{"plan.datasets[0].repeats": 1}``: one row per field."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}"))
        return out
    if isinstance(value, (list, tuple)) and any(isinstance(v, Mapping) for v in value):
        out = {f"{prefix}.count": len(value)}
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: value}
