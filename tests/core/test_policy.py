"""Tests of the planner's rules (wds_pad/core/policy.py): ``auto`` resolution, the padded
length of each policy, the round-robin deal of positions to DP ranks, and the epoch and
planned-size limits."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wds_pad import ConfigError, Dataset, Mode, Policy, Topology, plan_epoch
from wds_pad.core.policy import (MAX_PLANNED_ENTRIES, padded_length, position_rank, rank_position, rank_share,
                                 resolve_policy)


def test_auto_policy_resolution() -> None:
    assert resolve_policy("auto", "epochs", False) is Policy.CYCLIC
    assert resolve_policy("auto", "steps", True) is Policy.CYCLIC
    assert resolve_policy("auto", "steps", False) is Policy.DROP
    assert resolve_policy(Policy.NONE, Mode.STEPS, True) is Policy.NONE
    ds = Dataset("d", {"b": np.arange(10)})
    assert plan_epoch(ds, Topology(4, 0), seed=0, batch_size=2, mode="steps").policy is Policy.DROP
    assert plan_epoch(ds, Topology(4, 0), seed=0, batch_size=2).policy is Policy.CYCLIC


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 10**6), st.integers(1, 10**4), st.sampled_from(list(Policy)[1:]), st.booleans())
def test_padded_length_is_the_policys_multiple_of_the_unit(m: int, unit: int, policy: Policy,
                                                          oversubscribe: bool) -> None:
    length = padded_length(m, unit, policy, oversubscribe)
    if policy is Policy.NONE:
        assert length == m
        return
    assert length % unit == 0
    if m < unit:  # below one unit: dropped, unless cyclic with consent fills one whole unit
        assert length == (unit if policy is Policy.CYCLIC and oversubscribe else 0)
    elif policy is Policy.CYCLIC:
        assert m <= length < m + unit
    else:
        assert m - unit < length <= m


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 500), st.integers(1, 40))
def test_the_round_robin_deal_gives_every_position_to_one_rank(length: int, dp: int) -> None:
    d = np.arange(dp, dtype=np.int64)
    shares = rank_share(length, dp, d)
    assert int(shares.sum()) == length and int(shares.max() - shares.min()) <= 1
    pos = np.concatenate([rank_position(r, np.arange(int(shares[r]), dtype=np.int64), dp) for r in range(dp)])
    assert np.array_equal(np.sort(pos), np.arange(length))  # each position dealt once
    owner, k = position_rank(pos, dp)
    assert np.array_equal(rank_position(owner, k, dp), pos)


def test_max_epoch_is_one_exported_constant() -> None:
    import wds_pad.core.policy as policy_mod

    assert policy_mod.MAX_EPOCH == 2**31 - 1 and "MAX_EPOCH" in policy_mod.__all__
    assert policy_mod.check_epoch(np.int32(5)) == 5


def test_the_padded_size_limit_is_inclusive() -> None:
    from wds_pad.core.policy import check_bucket_size

    check_bucket_size("d", "a", 1, 1, MAX_PLANNED_ENTRIES, 1, MAX_PLANNED_ENTRIES, MAX_PLANNED_ENTRIES, True)
    check_bucket_size("d", "a", MAX_PLANNED_ENTRIES, 1, MAX_PLANNED_ENTRIES, 1, 1, 1, False)
    with pytest.raises(ConfigError, match="padded to"):
        check_bucket_size("d", "a", 3, 1, MAX_PLANNED_ENTRIES + 1, 1, 4, 4, False)


def test_the_pad_unit_is_one_global_step_or_one_entry_per_rank() -> None:
    from wds_pad import PadTo

    assert PadTo.BATCH.unit(4, 8) == 32 and PadTo.RANK.unit(4, 8) == 4
    # the unit the planner pads to: a cyclic bucket is a multiple of it
    plan = plan_epoch(Dataset("d", {"b": np.arange(10)}), Topology(3, 0), seed=1, batch_size=2, pad_to="rank")
    assert plan.stats[0].padded_length % PadTo.RANK.unit(3, 2) == 0 and plan.stats[0].padded_length == 12
