"""Tests of wds_pad.stream.collate: the one rule for what a batch is."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from webdataset.filters import default_collation_fn

from wds_pad.errors import ConfigError
from wds_pad.stream.collate import collate_batch, collate_columns, run_collation


def _sample(key: str, **members: object) -> dict[str, object]:
    return {"__key__": key, "__url__": "shard-000000.tar", **members}


def test_dicts_stay_a_list_tuples_become_columns() -> None:
    dicts = [_sample("a", jpg=b"x"), _sample("b", png=b"y")]
    assert collate_batch(dicts) == dicts
    cols = collate_batch([(1, "a"), (2, "b")])
    assert isinstance(cols, tuple) and cols[0].tolist() == [1, 2] and cols[1] == ["a", "b"]
    assert collate_batch([torch.zeros(2), torch.ones(3)])[1].shape == (3,)  # other samples: a list


def test_columns_equal_webdataset_where_it_succeeds() -> None:
    samples = [_sample(k, json={"label": i}, cls=i, t=torch.full((2,), i)) for i, k in enumerate("abc")]
    ours, theirs = collate_columns(samples), default_collation_fn(samples)
    assert set(ours) == set(theirs) and ours["cls"].tolist() == theirs["cls"].tolist()
    assert torch.equal(ours["t"], theirs["t"]) and ours["json"] == theirs["json"]
    assert run_collation(default_collation_fn, samples)["__key__"] == ["a", "b", "c"]


def test_meta_keys_on_some_samples_only_are_none_for_the_others() -> None:
    samples = [_sample("a", cls=1), {**_sample("b", cls=2), "__substitute_for__": "x"}]
    with pytest.raises(AssertionError):
        default_collation_fn(samples)  # what webdataset does with a substituted sample
    assert collate_columns(samples)["__substitute_for__"] == [None, "x"]


@pytest.mark.parametrize("samples, match", [
    ([_sample("a", jpg=1), _sample("b", png=2)], r"sample 'b' of 'shard-000000.tar' has members \['png'\] .*"
                                                  r"rename\(image='jpg;png'\)"),
    ([_sample("a", txt=1, cls=1), _sample("b", cls=2)], r"sample 'b' .*Give every sample 'txt'"),
    ([(1, 2), (1,)], r"sample #1 of the batch has 1 fields where sample #0 of the batch has 2"),
    ([(np.zeros(2),), (np.zeros(3),)], r"field 0 has shape \(3,\) but sample #0 .* has \(2,\)"),
    ([(torch.zeros(2),), (None,)], r"field 0 has shape none \(a NoneType\)"),
    ([1, 2], r"needs dict or tuple samples, got int"),
])
def test_mismatches_are_config_errors_naming_the_sample(samples, match) -> None:
    with pytest.raises(ConfigError, match=match):
        collate_columns(samples)


def test_a_collation_fn_of_ones_own_is_called_as_is() -> None:
    assert run_collation(len, [1, 2, 3]) == 3
    assert run_collation(list, [_sample("a", jpg=1), _sample("b", png=2)])[1]["png"] == 2
