"""cli/shufflequality.py: Mosaic Streaming's shuffle-quality measure, on sequences whose
value is computed by hand, against a plain-Python reading of its definition, and on plans:
``none`` shuffles better than ``shard``."""

from __future__ import annotations

import math
import warnings
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wds_pad import Dataset, DroppedBucketWarning, ShardMap, Topology, plan_epoch
from wds_pad.cli.readfigures import figures
from wds_pad.cli.shufflequality import difference_entropy, shuffle_quality


def _h(*probs: float) -> float:
    return -sum(p * math.log2(p) for p in probs)


@pytest.mark.parametrize(("sequence", "bits"), [
    ([], 0.0),
    ([7], 0.0),
    ([0, 1, 2, 3], 0.0),                 # in order: one difference, 1
    ([5, 3, 5, 3], 0.0),                 # |-2| and |2| are one bin
    ([0, 2, 1, 3], _h(2 / 3, 1 / 3)),    # |2|, |1|, |2|
    ([0, 1, 3, 6, 10], 2.0),             # 1, 2, 3, 4: four equal bins
    ([0, 0, 1, 2, 4], 1.5),              # 0, 1, 1, 2: 1/4, 1/2, 1/4
    ([10**12, 0, 10**12], 0.0),          # far apart ids: bins are the differences, not a bincount
])
def test_difference_entropy_by_hand(sequence: list[int], bits: float) -> None:
    assert difference_entropy(np.asarray(sequence, np.int64)) == pytest.approx(bits, abs=1e-12)


def test_shuffle_quality_is_the_harmonic_mean_of_sample_and_shard_entropy() -> None:
    # samples 0, 1, 3, 6, 10: 2 bits; their shards 0, 0, 1, 2, 4: 1.5 bits; 2ab/(a+b) = 6/3.5
    assert shuffle_quality([0, 1, 3, 6, 10], [0, 0, 1, 2, 4]) == pytest.approx(12 / 7, abs=1e-12)
    # samples 0, 2, 1, 3 in shards 0, 1, 0, 0: both entropies 0.918..., their harmonic mean the same
    assert shuffle_quality([0, 2, 1, 3], [0, 1, 0, 0]) == pytest.approx(_h(2 / 3, 1 / 3), abs=1e-12)
    # one shard: the shard entropy is 0, so the quality is 0 however the samples are shuffled
    assert shuffle_quality([4, 0, 3, 1, 2], [0, 0, 0, 0, 0]) == 0.0
    assert shuffle_quality([0, 1, 2], [0, 0, 0]) == 0.0  # both 0: 0, not 0 / 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-(2**40), 2**40), max_size=60))
def test_difference_entropy_is_the_definition(xs: list[int]) -> None:
    """Each distinct |difference| one bin, probability count / (n - 1), entropy in bits."""
    diffs = Counter(abs(b - a) for a, b in zip(xs, xs[1:]))
    expected = -sum(c / (len(xs) - 1) * math.log2(c / (len(xs) - 1)) for c in diffs.values())
    assert difference_entropy(xs) == pytest.approx(expected, abs=1e-9)


def test_none_shuffles_better_than_shard() -> None:
    rng = np.random.default_rng(5)
    n, shards = 20_000, 100
    bucket = rng.integers(0, 4, n)
    shard = np.repeat(np.arange(shards), n // shards)
    sm = ShardMap(Dataset("d", {k: np.flatnonzero(bucket == k) for k in range(4)}), shard)
    lengths, sizes = np.full(n, 1000), np.bincount(shard) * 1000
    quality = {}
    for locality in ("none", "shard"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DroppedBucketWarning)
            plan = plan_epoch(sm, Topology(4, 1), seed=9, batch_size=16, locality=locality, window=4)
        quality[locality] = shuffle_quality(plan.samples, shard[plan.samples])
        assert figures(plan, [shard], [lengths], [sizes], 1 << 20).shuffle_quality == quality[locality]
    assert quality["none"] > quality["shard"] + 1.0, quality
