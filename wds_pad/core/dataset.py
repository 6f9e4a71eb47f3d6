"""What the planner plans: the Dataset record, the canonical bucket order, and the input forms.

Pure: a Dataset is built from in-memory ids, never from a file or a filesystem (an
Index turns itself into one through its duck-typed ``to_dataset()``). Invariants:

- a Dataset is frozen and valid once constructed: a non-empty name, ``repeats`` an int
  >= 0, ``weight`` a finite number > 0, and every bucket a sorted, duplicate-free int64
  array; its buckets iterate in ``bucket_order``, so the bucket table, and with it the
  plan, does not depend on the order the caller built the mapping in (invariant 4);
- ``bucket_order`` is total and machine-independent over the keys ``encode_key``
  accepts (None, then bools, then numbers by value, strings, bytes, tuples);
- ``_as_datasets`` returns a non-empty list of Datasets with unique names, or raises
  a ConfigError that says which forms are accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Hashable, Mapping

import numpy as np

from ..errors import ConfigError
from .seed import encode_key

__all__ = ["Dataset", "bucket_order"]


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


@dataclass(frozen=True)
class Dataset:
    """One dataset of the plan: buckets of sample ids, repeats and an interleave weight.

    Args:
        name: unique name among the planned datasets.
        buckets: bucket key -> sample ids (any order; planned in sorted order).
            Keys are str, int, float or tuples of them.
        repeats: each sample appears 1 + repeats times per epoch.
        weight: rate at which this dataset's steps are drawn relative to the others.
    """

    name: str
    buckets: Mapping[Hashable, Any]
    repeats: int = 0
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"dataset name must be a non-empty str, got {self.name!r}")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 0:
            raise ConfigError(f"dataset {self.name!r}: repeats must be an int >= 0, got {self.repeats!r}")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ConfigError(f"dataset {self.name!r}: weight must be a finite number > 0, got {w!r}")
        canon: dict[Hashable, np.ndarray] = {}
        for key in sorted(self.buckets, key=bucket_order):
            ids = np.asarray(self.buckets[key])
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


def _as_datasets(source: Any) -> list[Dataset]:
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
