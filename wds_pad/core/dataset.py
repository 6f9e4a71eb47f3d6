"""What the planner plans: the Dataset record, the canonical bucket order, and the input forms.

Pure: a Dataset is built from in-memory ids, never from a file or a filesystem (an
Index turns itself into one through its duck-typed ``to_dataset()``). Invariants:

- a Dataset is frozen and valid once constructed: a non-empty name, ``repeats`` an int
  >= 0, ``weight`` a finite number > 0, and every bucket a sorted, duplicate-free int64
  array, or an ``IdRange`` (a contiguous run of ids, sorted and duplicate-free by
  construction: what an index's bucket-grouped rows give, at O(1) memory); its buckets
  iterate in ``bucket_order``, so the bucket table, and with it the plan, does not
  depend on the order the caller built the mapping in (invariant 4);
- ``bucket_order`` is total and machine-independent over the keys ``encode_key``
  accepts (None, then bools, then numbers by value, strings, bytes, tuples);
- ``as_datasets`` returns a non-empty list of Datasets with unique names, or raises
  a ConfigError that says which forms are accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping

import numpy as np

from ..errors import ConfigError
from .seed import encode_key

__all__ = ["Dataset", "IdRange", "bucket_order", "max_id"]


def bucket_order(key: Hashable) -> tuple[Any, ...]:
    """Canonical, machine-independent order of bucket keys (numbers, then strings, then tuples).

    Raises:
        ConfigError: a key that is not None, bool, int, float, str, bytes or a tuple of them.
    """
    encode_key(key)  # validates the type
    if key is None:
        return (0,)
    if isinstance(key, bool):
        return (1, int(key))
    if isinstance(key, (int, float, np.integer, np.floating)):
        return (2, float(key), encode_key(key))
    if isinstance(key, str):
        return (3, key)
    if isinstance(key, bytes):
        return (4, key)
    return (5, tuple(bucket_order(k) for k in key))  # type: ignore[union-attr]


class IdRange:
    """The sample ids ``start, start + 1, ..., stop - 1`` without holding them.

    It reads like the int64 id array it stands for (``size``, ``len``, indexing with an
    int, a slice or an int array, ``tolist``, ``np.asarray``), so a bucket of 10^8
    samples costs the planner two integers. ``Index.to_dataset()`` gives its buckets
    as IdRanges: an index stores each bucket's rows contiguously.
    """

    __slots__ = ("start", "stop")
    ndim = 1
    dtype = np.dtype(np.int64)

    def __init__(self, start: int, stop: int) -> None:
        if isinstance(start, bool) or isinstance(stop, bool) or not (
                isinstance(start, (int, np.integer)) and isinstance(stop, (int, np.integer))):
            raise ConfigError(f"IdRange bounds must be ints, got {start!r}, {stop!r}")
        if not 0 <= start <= stop:
            raise ConfigError(f"IdRange({start}, {stop}): need 0 <= start <= stop")
        self.start, self.stop = int(start), int(stop)

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def shape(self) -> tuple[int]:
        return (self.size,)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            lo, hi, step = i.indices(self.size)
            if step == 1:
                return IdRange(self.start + lo, self.start + max(lo, hi))
            return np.arange(self.start + lo, self.start + hi, step, dtype=np.int64)
        if isinstance(i, (int, np.integer)) and not isinstance(i, bool):
            if not -self.size <= i < self.size:
                raise IndexError(f"index {i} out of range for {self!r}")
            return np.int64(self.start + int(i) % self.size)
        idx = np.asarray(i)
        if idx.dtype == bool:
            return np.flatnonzero(idx).astype(np.int64) + self.start
        if idx.size and (idx.min() < -self.size or idx.max() >= self.size):
            raise IndexError(f"index out of range for {self!r}")
        return np.where(idx < 0, idx + self.size, idx).astype(np.int64) + self.start

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.arange(self.start, self.stop, dtype=np.int64)
        return out if dtype is None else out.astype(dtype)

    def __iter__(self) -> Any:
        return (np.int64(i) for i in range(self.start, self.stop))

    def tolist(self) -> list[int]:
        return list(range(self.start, self.stop))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IdRange):
            return (self.start, self.stop) == (other.start, other.stop)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((IdRange, self.start, self.stop))

    def __repr__(self) -> str:
        return f"IdRange({self.start}, {self.stop})"


@dataclass(frozen=True)
class Dataset:
    """One dataset of the plan: buckets of sample ids, repeats and an interleave weight.

    Args:
        name: unique name among the planned datasets.
        buckets: bucket key -> sample ids (any order; planned in sorted order), or an
            ``IdRange`` / a ``range`` of step 1 for a contiguous run of ids (kept as
            two integers). Keys are str, int, float or tuples of them.
        repeats: each sample appears 1 + repeats times per epoch.
        weight: rate at which this dataset's steps are drawn relative to the others.
        cost: each sample's cost (tokens, pixels, seconds: a finite number >= 0), indexed
            by sample id; what a :class:`~wds_pad.core.budgets.budget.Budget` batches by. None:
            the dataset cannot be planned under a budget.
        cost_order: bucket key -> the bucket's sample ids in cost order (ties by id), as an
            index stores it; None: sorted here, once per bucket, when a budget asks.
        proportion: the dataset's share of an epoch (core/planning/proportion.py), or None.
    """

    name: str
    buckets: Mapping[Hashable, Any]
    repeats: int = 0
    weight: float = 1.0
    cost: Any = field(default=None, compare=False, repr=False)
    cost_order: Callable[[Hashable], Any] | None = field(default=None, compare=False, repr=False)
    proportion: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"dataset name must be a non-empty str, got {self.name!r}")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 0:
            raise ConfigError(f"dataset {self.name!r}: repeats must be an int >= 0, got {self.repeats!r}")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ConfigError(f"dataset {self.name!r}: weight must be a finite number > 0, got {w!r}")
        p = self.proportion
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or p <= 0):
            raise ConfigError(f"dataset {self.name!r}: proportion must be a finite number > 0 or None, got {p!r}")
        canon: dict[Hashable, np.ndarray] = {}
        for key in sorted(self.buckets, key=bucket_order):
            given = self.buckets[key]
            if isinstance(given, IdRange) or (isinstance(given, range) and given.step == 1 and given.start >= 0):
                canon[key] = given if isinstance(given, IdRange) else IdRange(given.start, max(given.start, given.stop))
                continue
            ids = np.asarray(given)
            if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
                raise ConfigError(
                    f"dataset {self.name!r} bucket {key!r}: sample ids must be a 1-D integer array"
                )
            ids = np.sort(ids.astype(np.int64, copy=False))
            if ids.size > 1 and np.any(ids[1:] == ids[:-1]):
                dup = int(ids[1:][ids[1:] == ids[:-1]][0])
                raise ConfigError(f"dataset {self.name!r} bucket {key!r}: sample id {dup} occurs twice")
            canon[key] = ids
        object.__setattr__(self, "buckets", canon)
        if self.cost is not None:
            self._check_cost(canon)

    def _check_cost(self, canon: Mapping[Hashable, Any]) -> None:
        c = self.cost if hasattr(self.cost, "dtype") and hasattr(self.cost, "shape") else np.asarray(self.cost)
        if c.ndim != 1 or not (np.issubdtype(c.dtype, np.integer) or np.issubdtype(c.dtype, np.floating)):
            raise ConfigError(f"dataset {self.name!r}: cost must be a 1-D array of numbers indexed by sample "
                              f"id, got {type(self.cost).__name__} of shape {getattr(c, 'shape', '?')}")
        top = max((max_id(ids) for ids in canon.values()), default=-1)
        if top >= c.shape[0]:
            raise ConfigError(f"dataset {self.name!r}: cost has {c.shape[0]} entries but the dataset holds "
                              f"sample id {top}; give one cost per sample id")
        if self.cost_order is None and c.size:  # an index checked its costs when it was built
            v = np.asarray(c, dtype=np.float64)
            bad = np.flatnonzero(~np.isfinite(v) | (v < 0))
            if bad.size:
                raise ConfigError(f"dataset {self.name!r}: the cost of sample {int(bad[0])} is {v[bad[0]]!r}; "
                                  "costs must be finite numbers >= 0")
        object.__setattr__(self, "cost", c)

    def require_costs(self) -> None:
        """A ConfigError naming the dataset and the fix when it has no costs: what a sizing
        that ``needs_costs`` (a Budget, a Pack) asks of every dataset."""
        if self.cost is None:
            raise ConfigError(f"dataset {self.name!r} has no costs, so it cannot be planned under a budget: "
                              "index it with --cost (build_index(..., cost=...)), or pass cost= to Dataset")

    def sorted_by_cost(self, key: Hashable) -> Any:
        """Bucket ``key``'s sample ids in cost order (ties by id): the index's order, or
        sorted once here (O(n log n), cached).

        Raises:
            ConfigError: the dataset has no costs (:meth:`require_costs`).
        """
        self.require_costs()
        if self.cost_order is not None:
            return self.cost_order(key)
        cache = self.__dict__.setdefault("_by_cost", {})
        if key not in cache:
            ids = np.asarray(self.buckets[key], dtype=np.int64)
            cache[key] = ids[np.argsort(np.asarray(self.cost[ids], dtype=np.float64), kind="stable")]
        return cache[key]


def max_id(ids: Any) -> int:
    """The largest sample id of a bucket (sorted ids or an IdRange), -1 when empty."""
    if isinstance(ids, IdRange):
        return ids.stop - 1
    return int(ids[-1]) if len(ids) else -1


def as_datasets(source: Any) -> list[Dataset]:
    items = list(source) if isinstance(source, (list, tuple)) else [source]
    out: list[Dataset] = []
    for item in items:
        if isinstance(item, Dataset):
            out.append(item)
        elif hasattr(item, "to_dataset"):  # an Index (duck-typed: the planner imports no I/O)
            out.append(item.to_dataset())
        elif isinstance(item, Mapping):
            out.append(Dataset(name=f"dataset{len(out)}", buckets=item))
        else:
            raise ConfigError(
                f"cannot plan {type(item).__name__}: pass a Dataset, an Index or a "
                "mapping of bucket key -> sample ids"
            )
    if not out:
        raise ConfigError("nothing to plan: no datasets given")
    names = [d.name for d in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"dataset names must be unique, got {names}; pass name=... to each")
    return out
