"""The keyed permutation behind every bucket shuffle: a bijection, identical in numpy and Python."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from wds_pad.core.permute import ROUNDS, permute, permute_one, round_keys


def _keys(key: int, size: int) -> np.ndarray:
    return np.repeat(np.asarray(round_keys(key), dtype=np.uint64)[:, None], size, axis=1)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 3000), key=st.integers(0, 2**64 - 1))
def test_is_a_bijection_and_matches_the_scalar_reference(n: int, key: int) -> None:
    x = np.arange(n, dtype=np.int64)
    y = permute(x, np.full(n, n, dtype=np.int64), _keys(key, n))
    assert sorted(y.tolist()) == list(range(n))
    sample = range(0, n, max(1, n // 50))
    assert [permute_one(i, n, key) for i in sample] == [int(y[i]) for i in sample]


def test_elements_with_different_domains_and_keys_in_one_call() -> None:
    sizes, keys = [5, 1, 1000, 2**20 + 3], [7, 8, 9, 2**63 + 11]
    x = np.concatenate([np.arange(0, n, max(1, n // 97)) for n in sizes])
    n_e = np.concatenate([np.full(len(range(0, n, max(1, n // 97))), n) for n in sizes])
    k_e = np.concatenate([_keys(k, len(range(0, n, max(1, n // 97)))) for n, k in zip(sizes, keys)], axis=1)
    got = permute(x, n_e, k_e).tolist()
    key_of = {n: k for n, k in zip(sizes, keys)}
    assert got == [permute_one(int(i), int(n), key_of[int(n)]) for i, n in zip(x, n_e)]


def test_keys_give_different_orders_and_positions_look_uniform() -> None:
    n, trials = 16, 4000
    counts = np.zeros((n, n), dtype=np.int64)  # counts[i, j]: element i landed at j
    orders = set()
    for key in range(trials):
        y = permute(np.arange(n), np.full(n, n), _keys(key, n))
        counts[np.arange(n), y] += 1
        orders.add(tuple(y.tolist()))
    assert len(orders) > trials * 0.99  # nearly every key gives its own order
    expected = trials / n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 225 degrees of freedom: a fair shuffle stays far below 350; a biased one does not
    assert chi2 < 350, chi2
    assert ROUNDS >= 4
