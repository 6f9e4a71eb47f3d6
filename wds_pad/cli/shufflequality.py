"""Shuffle quality: how scattered consecutive samples of an epoch are, by Mosaic Streaming's measure.

Mosaic Streaming rates a shuffle by entropy (mosaicml/streaming,
``simulation/core/shuffle_quality.py``: ``get_entropy`` and ``get_entropy_shuffle_quality``,
the measure behind its shuffle-quality comparisons of ``streaming/base/shuffle/``):

- the differences between consecutive elements of a sequence are taken in absolute value;
- each distinct absolute difference is one bin (their counts are a ``bincount`` of the
  differences with the empty bins removed), its probability its count over ``n - 1``;
- the entropy is Shannon's in bits: ``-sum(p * log2(p))``;
- the quality is the harmonic mean ``2 a b / (a + b)`` of the entropy ``a`` of the
  sample indices and the entropy ``b`` of their shard indices.

A sequence in order (every difference 1) scores 0, and so does one that reads shard
after shard (every shard difference 0 but at the boundaries): the harmonic mean is low
when either the samples or the shards come in a predictable stride. Here the sequence is
a rank's epoch as the plan yields it (padded copies included: they are samples it reads;
Mosaic drops its padding slots, which hold no sample).

Invariants:
- pure numpy; O(n log n) time and O(n) memory in the sequence's length, never in the
  range of the ids (the bins are the differences that occur, counted by sorting them,
  which gives the same counts as Mosaic's ``bincount`` without its empty bins);
- fewer than two elements, or one distinct difference, is entropy 0; the quality is 0
  where either entropy is 0 (Mosaic's formula divides 0 by 0 where both are).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["difference_entropy", "shuffle_quality"]


def difference_entropy(sequence: Any) -> float:
    """Shannon entropy, in bits, of the absolute differences between consecutive elements.

    Args:
        sequence: 1-D integers (sample or shard indices, in the order they are read).

    Returns:
        ``-sum(p * log2(p))`` over the distinct ``|x[i + 1] - x[i]|``, ``p`` each one's
        count over ``len(sequence) - 1``; 0.0 for fewer than two elements.
    """
    x = np.asarray(sequence, dtype=np.int64)
    if x.size < 2:
        return 0.0
    _, counts = np.unique(np.abs(np.diff(x)), return_counts=True)
    p = counts / (x.size - 1)
    return float(-(p * np.log2(p)).sum()) + 0.0  # + 0.0: -0.0 for one bin reads as 0.0


def shuffle_quality(samples: Any, shards: Any) -> float:
    """Mosaic Streaming's shuffle quality of an epoch read in this order.

    Args:
        samples: the sample index of every element read, in order (1-D integers).
        shards: the shard index of each of them.

    Returns:
        The harmonic mean of :func:`difference_entropy` of ``samples`` and of ``shards``,
        in bits; 0.0 where either is 0.
    """
    a, b = difference_entropy(samples), difference_entropy(shards)
    return 2 * a * b / (a + b) if a > 0 and b > 0 else 0.0
