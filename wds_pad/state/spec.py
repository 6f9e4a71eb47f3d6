"""The plan's identity: ``PlanSpec``, everything a rank's plan depends on.

Built once in the main process (seed already shared, topology detected), pickled into
DataLoader workers, verified against every saved state: the spec is what a state's
fingerprint is made of and what a resumed loader plans with.

Invariants:
- ``PlanSpec`` holds everything the plan depends on; :meth:`PlanSpec.plan_kwargs` lists
  the plan's arguments once, for the epoch's plan (``plan_epoch``) and the elastic
  remainder (``plan_remainder``) alike, so both plan the same epoch;
- it pickles its indexes loaded from local files as their paths and relocations
  (workers re-map the pages, resolve the same shard URLs, and refuse an index that
  changed) and recomputes the identical plan in every process;
- the same spec on another data-parallel layout is ``dataclasses.replace(spec,
  topology=...)``: a new spec with a plan cache of its own;
- :meth:`PlanSpec.fingerprint_fields` are a state's ``plan`` block, byte for byte as
  every earlier version wrote them: adding a field changes every fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import numpy as np

from ..core.budgets.budget import PACKING, Budget
from ..core.dataset import Dataset
from ..core.local.locality import EXPORT, Locality, ShardMap, shard_map_of
from ..core.planning.plan import Plan, plan_epoch
from ..core.policy import Mode, PadTo, Policy, resolve_policy
from ..core.seed import stable_digest
from ..core.sizing import Count, as_sizing
from ..core.topology import Topology
from ..errors import ConfigError, WdsPadError
from ..index.codec import load_index
from ..index.record import Index
from ..io.urls import is_local
from .schema import fingerprint_of

__all__ = ["PACKING", "PlanSpec", "per_index"]


def per_index(value: Any, n: int, name: str, kind: type[int] | type[float], *, optional: bool = False,
              ) -> tuple[Any, ...]:
    """``value`` as one ``kind`` per index of ``n``: a list, tuple or numpy array of ``n``
    values, in the order of the indexes, or one value for every index; ``optional``: None
    or an empty list is none (``()``). numpy numbers are taken; a bool is not a number.

    Raises:
        ConfigError: not one value per index, or a value that is not a ``kind``.
    """
    if optional and (value is None or (isinstance(value, (list, tuple)) and not value)):
        return ()
    if isinstance(value, (str, bytes, Mapping)):
        raise ConfigError(f"{name} takes one number per index, in the order of the indexes (a list such as "
                          f"[0.7, 0.3] for two), got {type(value).__name__} {value!r:.60}")
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * n
    if len(values) != n:
        raise ConfigError(f"{name} has {len(values)} values for {n} index(es); give one per index")
    numbers = (int, np.integer) if kind is int else (int, float, np.integer, np.floating)
    for v in values:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers):
            raise ConfigError(f"{name} must be {'ints' if kind is int else 'numbers'}, one per index, got {v!r}")
    return tuple(kind(v) for v in values)


@dataclass(frozen=True, eq=False)
class PlanSpec:
    """Everything the plan depends on, plus the indexes that resolve sample ids.

    Built once in the main process (seed already shared, topology detected) and pickled
    into DataLoader workers, where plans are recomputed identically.
    """

    indexes: tuple[Index, ...]
    names: tuple[str, ...]
    topology: Topology
    seed: int
    batch_size: int | Budget
    policy: Policy = Policy.AUTO
    mode: Mode = Mode.EPOCHS
    pad_to: PadTo = PadTo.BATCH
    oversubscribe: bool = False
    repeats: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    locality: Locality = Locality.NONE
    window: int = 8
    accumulation_steps: int = 1
    proportions: tuple[float, ...] = ()  # each dataset's share of an epoch (core/planning/proportion.py); (): none
    mix_by: str = "samples"
    epoch_size: float | None = None
    # not an argument: a replaced spec (another layout) starts with a cache of its own
    _cache: dict[int, Plan] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.indexes)
        if len(self.names) != n:
            raise ConfigError(f"PlanSpec: {len(self.names)} name(s) for {n} index(es); give one per index")
        # empty repeats/weights mean the defaults (0 repeats, weight 1) for every index:
        # zip() over an empty tuple would otherwise silently plan no dataset at all
        for name, default in (("repeats", 0), ("weights", 1.0)):
            values = getattr(self, name) or (default,) * n
            if len(values) != n:
                raise ConfigError(f"PlanSpec.{name} has {len(values)} value(s) for {n} index(es)")
            object.__setattr__(self, name, tuple(values))
        if self.proportions and len(self.proportions) != n:
            raise ConfigError(f"proportions has {len(self.proportions)} value(s) for {n} index(es)")
        seen: dict[tuple[str, tuple[str, ...]], int] = {}
        for k, ix in enumerate(self.indexes if n > 1 else ()):
            j = seen.setdefault(ix.samples_identity, k)
            if j != k:
                raise ConfigError(
                    f"index {self.names[k]!r} ({ix.path or ix.name}) holds the same samples as index "
                    f"{self.names[j]!r} (index {j + 1} and {k + 1} of the list: the same digest and shards): each "
                    "sample would be planned twice per epoch, as two datasets; give each index once (to see "
                    "every sample more than once per epoch: repeats=N)")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"] = {}
        state["indexes"] = tuple(_IndexRef(ix) for ix in self.indexes)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["indexes"] = tuple(ref.get() if isinstance(ref, _IndexRef) else ref for ref in state["indexes"])
        self.__dict__.update(state)

    @property
    def sizing(self) -> Count | Budget:
        """How batches are sized: ``batch_size`` as a sizing (core/sizing.py)."""
        return as_sizing(self.batch_size)

    @property
    def resolved_policy(self) -> Policy:
        return resolve_policy(self.policy, self.mode, self.oversubscribe)

    def datasets(self) -> list[Dataset | ShardMap]:
        """The planned datasets, one per index (with their shard maps for ``locality="shard"``)."""
        costs = self.sizing.needs_costs or (bool(self.proportions) and self.mix_by == "cost")  # planned by cost
        out = [ix.to_dataset(name=n, repeats=r, weight=w, **({"costs": True} if costs else {}))
               for ix, n, r, w in zip(self.indexes, self.names, self.repeats, self.weights)]
        if self.proportions:
            out = [replace(ds, proportion=float(p)) for ds, p in zip(out, self.proportions)]
        if self.locality.dealt:
            return [shard_map_of(ix, ds) for ix, ds in zip(self.indexes, out)]
        return list(out)

    def plan_kwargs(self) -> dict[str, Any]:
        """The plan's arguments besides the datasets, the topology and the epoch: what
        ``plan_epoch`` and ``plan_remainder`` take, listed once."""
        return dict(seed=self.seed, batch_size=self.batch_size, policy=self.policy, mode=self.mode,
                    oversubscribe=self.oversubscribe, pad_to=self.pad_to, locality=self.locality,
                    window=self.window, accumulation_steps=self.accumulation_steps, mix_by=self.mix_by,
                    epoch_size=self.epoch_size)  # without proportions: refused unless the defaults

    def plan(self, epoch: int) -> Plan:
        """This rank's plan for ``epoch`` (cached: the last few epochs only)."""
        plan = self._cache.get(epoch)
        if plan is None:
            plan = plan_epoch(self.datasets(), self.topology, epoch=epoch, warn=not self._cache,
                              **self.plan_kwargs())
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = plan
        return plan

    def fingerprint(self) -> str:
        """A digest of everything that shapes the plan but this rank's own place in it:
        :meth:`fingerprint_fields` (so the data-parallel layout is covered; the rank is
        checked through the topology saved beside it). Equal on every rank of a job."""
        return fingerprint_of(self.fingerprint_fields())

    def fingerprint_fields(self) -> dict[str, Any]:
        """The fingerprint's ingredients, JSON-safe (saved in a state as ``plan``)."""
        dp = int(self.topology.dp_size)
        sizing = self.sizing
        fields = {
            "seed_hash": stable_digest(self.seed, size=8).hex(),
            # a budget: its limit, model and bound, and how batches are packed under it
            "batch_size": sizing.fingerprint(),
            "policy": self.resolved_policy.value,
            "mode": self.mode.value,
            "pad_to": self.pad_to.value,
            "dp_size": dp,
            # under a budget a bucket is padded by strata (one entry per DP rank), then by batches
            "pad_unit": sizing.pad_unit(dp, self.pad_to, self.accumulation_steps),
            "oversubscribe": self.oversubscribe,
            "datasets": [{"name": n, "index_digest": ix.digest, "repeats": r, "weight": float(w)}
                         for ix, n, r, w in zip(self.indexes, self.names, self.repeats, self.weights)],
        }
        if self.locality is not Locality.NONE:  # locality="none" keeps the fingerprints it always had
            fields["locality"] = self.locality.value
            fields["window"] = self.window
            fields["shard_order"] = "fifo"  # a rank's windows first in, first out (core/local/locality.py)
        if self.locality is Locality.NODE:  # how the shards were dealt: to nodes of this many DP ranks
            fields["node_ranks"] = self.topology.node_ranks
            # a node gives from a tail of at least EXPORT shards that holds every bucket's surplus
            fields["export"] = [EXPORT, "surplus"]
        if self.proportions:  # absent without: the fingerprints of earlier versions
            fields["proportions"] = [float(p) for p in self.proportions]
            fields["mix_by"] = self.mix_by
            fields["epoch_size"] = self.epoch_size
        if self.accumulation_steps > 1:  # absent at 1: the fingerprints of earlier versions
            fields["accumulation_steps"] = self.accumulation_steps
        return fields


class _IndexRef:
    """Pickles an Index loaded from a local file as its path and relocation (workers
    re-map the pages and resolve its shard URLs as the main process did)."""

    def __init__(self, index: Index) -> None:
        local = index.path is not None and is_local(index.path)
        self.path = index.path if local else None
        self.relocate = dict(index.relocate)
        self.digest = index.digest
        self.index = None if local else index

    def get(self) -> Index:
        if self.index is not None:
            return self.index
        index = load_index(self.path, verify=False, relocate=self.relocate)  # type: ignore[arg-type]
        if index.digest != self.digest:
            raise WdsPadError(f"index {self.path!r} changed while the job was running; restart the job")
        return index
