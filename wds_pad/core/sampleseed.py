"""A seed per planned sample: what an augmentation draws its randomness from.

Every entry of a plan carries a 64-bit seed derived from (seed, epoch, dataset, sample
id, copy number), never from the rank, the worker, the step or the resume point, so a
seeded random crop replays exactly after a resume, on any number of ranks.

The **copy number** tells the appearances of one sample in one epoch apart: for an entry
at global position p of a bucket of n samples in the keyed global order it is ``p // n``
(its pass, ``0 .. repeats``, for the bucket's own entries; ``repeats + 1`` and up for the
padded copies that extend it cyclically). Entry orders that do not expose positions (the
shard-local orders) number a sample's own entries 0 and its padded copies 1; a budget's
strata number each entry by its pass, plus ``PADDED`` for a padded copy.

Invariants (hypothesis properties in tests/core/test_sampleseed.py):
- pure and vectorised: ``sample_seeds`` is numpy uint64 arithmetic (a splitmix64 mix of
  the fields, keyed by a stable hash of (seed, epoch, dataset)), identical on every
  machine and under any PYTHONHASHSEED;
- the same (seed, epoch, dataset, sample, copy) give the same seed on every layout;
  another epoch, dataset, sample or copy gives another one (a 64-bit mix: distinct but
  for collisions of probability 2**-64 per pair).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .permute import mix64
from .seed import derive_seed

__all__ = ["PADDED", "mix_seeds", "sample_rng", "sample_seeds", "seed_bases", "seeded_entries"]

#: added to a padded copy's pass by the entry orders that number passes, not positions (budgets)
PADDED = 1 << 32

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_COPY = np.uint64(0xD6E8FEB86659FD93)


def sample_seeds(seed: int, epoch: int, dataset: str, samples: Any, copies: Any) -> np.ndarray:
    """The uint64 seed of each (sample id, copy number) of ``dataset`` in ``epoch``.

    Args:
        seed: the plan's shared seed.
        epoch: the epoch.
        dataset: the dataset's name.
        samples: int sample ids (any shape).
        copies: int copy numbers, broadcastable to ``samples``.

    Returns:
        uint64 seeds, the shape of ``samples``.
    """
    return mix_seeds(seed_bases(seed, epoch, [dataset])[0], samples, copies)


def seed_bases(seed: int, epoch: int, datasets: Sequence[str]) -> np.ndarray:
    """The uint64 key of each dataset's sample seeds in ``epoch``: a stable hash, O(datasets)."""
    return np.asarray([derive_seed(seed, epoch, name, "sample-seed") for name in datasets], np.uint64)


def mix_seeds(base: Any, samples: Any, copies: Any) -> np.ndarray:
    """The seeds of ``samples`` / ``copies`` under key(s) ``base`` (broadcast): two splitmix64 rounds."""
    b = np.asarray(base, np.uint64)
    s = np.asarray(samples, np.int64).astype(np.uint64)
    c = np.asarray(copies, np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        return mix64(mix64(b + (s + np.uint64(1)) * _GOLDEN) ^ ((c + np.uint64(1)) * _COPY))


def sample_rng(sample: Mapping[str, Any] | int) -> np.random.Generator:
    """A numpy Generator seeded by a streamed sample's ``__seed__`` (or a seed itself).

    Raises:
        KeyError: a sample dict without ``__seed__`` (one not streamed by wds_pad).
    """
    value = sample if isinstance(sample, (int, np.integer)) else sample["__seed__"]
    return np.random.Generator(np.random.PCG64(int(value)))


def seeded_entries(buckets: Any, b: np.ndarray, k: np.ndarray,
                   bases: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(samples, pad, seeds) of entries ``k`` of kept buckets ``b`` of a plan's ``buckets``;
    ``bases`` per kept bucket its dataset's key (:func:`seed_bases`), None for no seeds.
    An entry's copy number comes from the entry order when it numbers copies, else from
    ``pad`` (0 for the real entry, 1 for a copy)."""
    order = buckets.order
    if hasattr(order, "numbered"):
        samples, pad, copies = order.numbered(b, k)
    else:
        samples, pad = buckets.entries(b, k)
        copies = order.copies(b, k) if hasattr(order, "copies") else None
    if bases is None:
        return samples, pad, None
    copies = pad.astype(np.int64) if copies is None else copies
    return samples, pad, mix_seeds(bases[b], samples, copies)
