"""Proportions: each dataset's share of an epoch, counted in samples or in cost.

``Dataset(..., proportion=p)`` fixes the dataset's share of the epoch (the proportions of
the planned datasets are normalised to sum to 1); weights keep their meaning, the order
of the mix. The epoch holds ``epoch_size`` samples (``mix_by="samples"``) or that much
cost (``mix_by="cost"``: the datasets' per-sample costs, tokens or pixels, as a Budget
reads them); by default the datasets' own total. Per dataset, for each epoch:

- **more than its share**: a subset, a window of a keyed cycle over all its samples that
  is fixed across epochs (derived from (seed, dataset)); epoch e takes the window that
  follows epoch e - 1's, so every sample is used before any is used twice, and each
  epoch draws another subset;
- **less than its share**: each bucket is extended cyclically to its share of the
  dataset's target (its shuffled order repeated from the front, as the padding rule
  does), the extra entries marked as copies (``pad``).

Without proportions nothing changes: the datasets are planned as given (a plan is byte
identical to one planned without this module). Pure: numpy over the dataset's ids, no I/O.

Invariants (hypothesis properties in tests/core/test_proportion.py):
- each dataset's share of the planned epoch is its proportion within 1%, plus the copies
  the pad rule adds afterwards (fewer than one global step a bucket);
- over consecutive epochs a subsampled dataset uses each sample once before any twice;
- either every planned dataset has a proportion or none has: a ConfigError names it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from ...errors import ConfigError
from ..dataset import Dataset
from ..seed import derive_rng

__all__ = ["MIX_BY", "Mix", "check_mix", "extended", "mix"]

MIX_BY = ("samples", "cost")

#: (dataset index, bucket key) -> the bucket's target entries (an extended bucket)
Targets = dict[tuple[int, Hashable], int]


@dataclasses.dataclass(frozen=True)
class Mix:
    """The datasets an epoch plans (subsets where a dataset has more than its share) and
    the target entries of each extended bucket (None: no proportions)."""

    datasets: list[Dataset]
    targets: Targets | None


def check_mix(mix_by: Any, epoch_size: Any) -> tuple[str, float | None]:
    """``mix_by`` and ``epoch_size`` validated.

    Raises:
        ConfigError: ``mix_by`` not in MIX_BY, ``epoch_size`` not a number > 0.
    """
    if mix_by not in MIX_BY:
        raise ConfigError(f"mix_by must be one of {', '.join(MIX_BY)} (--mix-by), got {mix_by!r}")
    if epoch_size is None:
        return mix_by, None
    if isinstance(epoch_size, bool) or not isinstance(epoch_size, (int, float, np.integer, np.floating)) \
            or not np.isfinite(epoch_size) or epoch_size <= 0:
        raise ConfigError(f"epoch_size must be a number > 0 (--epoch-size), got {epoch_size!r}")
    return mix_by, float(epoch_size)


def mix(dss: Sequence[Dataset], seed: int, epoch: int, mix_by: str = "samples",
        epoch_size: float | None = None) -> Mix:
    """What epoch ``epoch`` plans of ``dss`` under their proportions (see the module doc).

    Raises:
        ConfigError: some datasets have a proportion and others not; ``epoch_size`` or
            ``mix_by="cost"`` without proportions; a dataset with a proportion and
            repeats; ``mix_by="cost"`` and a dataset without costs.
    """
    mix_by, epoch_size = check_mix(mix_by, epoch_size)
    given = [ds.proportion is not None for ds in dss]
    if not any(given):
        if epoch_size is not None or mix_by != "samples":
            raise ConfigError("epoch_size (--epoch-size) and mix_by (--mix-by) size an epoch by proportions: "
                              "give every dataset a proportion (--proportions P1,P2,...), or leave them out")
        return Mix(list(dss), None)
    if not all(given):
        missing = [ds.name for ds, g in zip(dss, given) if not g]
        raise ConfigError(f"datasets {missing} have no proportion while others do: give every dataset one "
                          "(Dataset(proportion=...), --proportions P1,P2,...) or none")
    for ds in dss:
        if ds.repeats:
            raise ConfigError(f"dataset {ds.name!r} has repeats={ds.repeats} and a proportion: its proportion "
                              "sets how often its samples appear, so leave repeats at 0")
    share = np.asarray([float(ds.proportion) for ds in dss])  # type: ignore[arg-type]
    share /= share.sum()
    rows = [_rows(ds, mix_by) for ds in dss]
    total = float(sum(float(w.sum()) for _, _, w in rows))
    size = total if epoch_size is None else epoch_size
    out: list[Dataset] = []
    targets: Targets = {}
    for di, (ds, (ids, bucket, w), p) in enumerate(zip(dss, rows, share)):
        want, have = p * size, float(w.sum())
        if have <= 0 or want >= have:  # extended: each bucket to its part of the target
            factor = want / have if have > 0 else 1.0
            for key, b in ds.buckets.items():
                targets[(di, key)] = int(round(len(b) * factor))
            out.append(ds)
        else:
            out.append(_window(ds, ids, bucket, w, seed, epoch, want))
    return Mix(out, targets)


def _rows(ds: Dataset, mix_by: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(every sample id, its bucket's number, its weight: 1 or its cost), bucket after bucket."""
    parts = [np.asarray(b, np.int64) for b in ds.buckets.values()]
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    bucket = np.repeat(np.arange(len(parts)), [p.size for p in parts])
    if mix_by == "samples":
        return ids, bucket, np.ones(ids.size)
    if ds.cost is None:
        raise ConfigError(f"dataset {ds.name!r} has no costs, so it cannot be mixed by cost (--mix-by cost): "
                          "index it with --cost (build_index(..., cost=...)), or pass cost= to Dataset")
    return ids, bucket, np.asarray(ds.cost[ids], np.float64)


def _window(ds: Dataset, ids: np.ndarray, bucket: np.ndarray, w: np.ndarray, seed: int, epoch: int,
            want: float) -> Dataset:
    """Epoch ``epoch``'s subset of ``ds``: the samples of the cycle (a keyed order of all
    of them, the same every epoch) between the cumulative weights ``epoch * want`` and
    ``(epoch + 1) * want``, so that consecutive epochs take consecutive windows."""
    n = ids.size
    perm = derive_rng(seed, ds.name, "proportion").permutation(n)
    cum = np.cumsum(w[perm])
    whole = float(cum[-1])

    def at(x: float) -> int:  # positions of the cycle whose weight ends at or before x
        cycles = int(x // whole)
        return cycles * n + int(np.searchsorted(cum, x - cycles * whole + 1e-9 * whole, side="right"))

    lo, hi = at(epoch * want), at((epoch + 1) * want)
    take = perm[np.arange(lo, hi, dtype=np.int64) % n]
    keys = list(ds.buckets)
    chosen = {keys[j]: np.sort(ids[take[bucket[take] == j]]) for j in range(len(keys))}
    return dataclasses.replace(ds, buckets=chosen, cost_order=None)


def extended(measure: Callable[..., Any], targets: Targets, names: Sequence[str]) -> Callable[..., Any]:
    """``measure`` with each extended bucket measured at its target length: the entries past
    its own are copies (the cyclic extension of its shuffled order, marked ``pad``)."""
    by_name = {(names[di], key): t for (di, key), t in targets.items()}

    def measure_extended(ds: Dataset, key: Hashable, ids: Any, n: int, passes: int) -> Any:
        t = by_name.get((ds.name, key))
        if t is None or t <= n * passes:
            return measure(ds, key, ids, n, passes)
        got = measure(ds, key, ids, t, 1)
        return dataclasses.replace(got, real=min(n * passes, got.length), truncated=max(n * passes - got.length, 0))
    return measure_extended
