"""Proportions on the streaming path: the shares streamed, the saved state records them, and
a resume that changes them (or the number of ranks) is refused before anything moves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wds_pad.cli.synth import make_image_shards
from wds_pad.core.topology import Topology
from wds_pad.errors import ConfigError, StateMismatchError
from wds_pad.index.build import build_index
from wds_pad.index.codec import load_index
from wds_pad.index.record import Index
from wds_pad.stream.dataset import BucketedWebDataset

pytestmark = [pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning")]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> list[Index]:
    d: Path = tmp_path_factory.mktemp("shards")
    out = []
    for name, samples, seed in (("big", 240, 1), ("small", 60, 2)):
        paths = make_image_shards(d / name, samples=samples, shards=2, seed=seed)
        built = build_index(paths, "aspect:width,height", output=str(d / f"{name}.wdsidx"), cost="image:pixels")
        out.append(load_index(built.path))  # type: ignore[arg-type]
    return out


def _ds(pair: list[Index], proportions: Any, topology: Topology = Topology(1, 0), **kw: Any) -> BucketedWebDataset:
    return BucketedWebDataset(pair, batch_size=2, seed=4, topology=topology, oversubscribe=True,
                              proportions=proportions, names=["big", "small"], **kw)


@pytest.mark.parametrize("mix_by", ["samples", "cost"])
def test_the_streamed_epoch_holds_each_index_in_its_proportion(pair: list[Index], mix_by: str) -> None:
    ds = _ds(pair, [1, 1], mix_by=mix_by)
    got = {"big": 0.0, "small": 0.0}
    cost = {"big": pair[0].cost, "small": pair[1].cost}
    for batch in ds:
        for s in batch:
            got[s["__dataset__"]] += float(cost[s["__dataset__"]][s["__index__"]]) if mix_by == "cost" else 1
    assert abs(got["big"] / sum(got.values()) - 0.5) <= 0.05  # 60 samples against a pad unit of 2: coarse


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.floats(0.1, 10), min_size=2, max_size=2), st.lists(st.floats(0.1, 10), min_size=2, max_size=2),
       st.sampled_from(["samples", "cost"]))
def test_a_resume_that_changes_the_proportions_is_refused(pair: list[Index], saved: list[float], now: list[float],
                                                          mix_by: str) -> None:
    ds = _ds(pair, saved, mix_by=mix_by)
    next(iter(ds))
    state = ds.state_dict()
    assert state["plan"]["proportions"] == saved and state["plan"]["mix_by"] == mix_by
    other = _ds(pair, now, mix_by=mix_by)
    before = other.state_dict()
    if now == saved:
        other.load_state_dict(state)
        assert other.state_dict()["index"] == 1
        return
    with pytest.raises(StateMismatchError, match="plan.proportions"):
        other.load_state_dict(state)
    assert other.state_dict() == before  # refused before anything moved


def test_without_proportions_the_state_has_no_proportions_and_elastic_is_refused_with_them(
        pair: list[Index]) -> None:
    plain = _ds(pair, None)
    assert "proportions" not in plain.state_dict()["plan"]
    with pytest.raises(StateMismatchError):
        plain.load_state_dict(_ds(pair, [1, 1]).state_dict())
    ds = _ds(pair, [2, 1])
    next(iter(ds))
    two = _ds(pair, [2, 1], topology=Topology(2, 0))
    with pytest.raises(ConfigError, match="resumes on the layout it was saved on"):
        two.load_state_dict(ds.state_dict(), allow_elastic=True)
    assert np.isfinite(pair[0].cost).all()


@pytest.mark.parametrize("kw", [dict(epoch_size=100), dict(mix_by="cost")])
def test_epoch_size_or_mix_by_without_proportions_is_refused_as_plan_epoch_refuses_it(
        pair: list[Index], kw: dict[str, Any]) -> None:
    """They size an epoch by proportions: without any they would be ignored in silence."""
    with pytest.raises(ConfigError, match=r"epoch_size \(--epoch-size\) and mix_by \(--mix-by\) size an epoch"):
        _ds(pair, None, **kw)


@pytest.mark.parametrize("kw,match", [(dict(epoch_size=-1), "epoch_size must be a number > 0"),
                                      (dict(mix_by="tokens"), "mix_by must be one of samples, cost")])
def test_a_wrong_epoch_size_or_mix_by_is_refused_with_or_without_proportions(
        pair: list[Index], kw: dict[str, Any], match: str) -> None:
    for proportions in (None, [2, 1]):
        with pytest.raises(ConfigError, match=match):
            _ds(pair, proportions, **kw)


@pytest.mark.parametrize("bad,match", [
    ({"big": 2, "small": 1}, r"one number per index, in the order of the indexes .*got dict"),
    ("21", r"one number per index.*got str"),
    ([2, "1"], r"proportions must be numbers, one per index, got '1'"),
    ([2, None], r"proportions must be numbers, one per index, got None"),
    ([True, 1], r"proportions must be numbers, one per index, got True"),
    ([2], r"proportions has 1 values for 2 index\(es\)"),
])
def test_proportions_that_are_not_one_number_per_index_are_refused_naming_them(
        pair: list[Index], bad: Any, match: str) -> None:
    """A dict by name, a string, or a value that is not a number was a raw ValueError or
    TypeError from float() (or a dict's keys taken for the values)."""
    with pytest.raises(ConfigError, match=match):
        _ds(pair, bad)


def test_proportions_as_numpy_values_plan_as_the_same_list(pair: list[Index]) -> None:
    given = _ds(pair, [2, 1])
    for same in (np.array([2.0, 1.0]), (np.int64(2), np.float32(1.0)), [2.0, 1]):
        ds = _ds(pair, same)
        assert ds.spec.proportions == (2.0, 1.0)
        assert ds.state_dict() == given.state_dict()  # the same plan and fingerprint
        assert [b.samples.tolist() for b in ds.plan(0)] == [b.samples.tolist() for b in given.plan(0)]


def test_weights_and_repeats_as_numpy_values_plan_as_the_same_lists(pair: list[Index]) -> None:
    """A numpy array of weights or repeats was refused ("must be float values, got array(...)")."""
    def ds(**kw: Any) -> BucketedWebDataset:
        return BucketedWebDataset(pair, batch_size=2, seed=4, topology=Topology(1, 0), oversubscribe=True,
                                  names=["big", "small"], **kw)

    given = ds(weights=[2.0, 1.0], repeats=[0, 1])
    same = ds(weights=np.array([2.0, 1.0]), repeats=np.array([0, 1]))
    assert same.spec.weights == (2.0, 1.0) and same.spec.repeats == (0, 1)
    assert type(same.spec.repeats[1]) is int  # a saved state holds plain numbers
    assert same.state_dict() == given.state_dict()
    assert [b.samples.tolist() for b in same.plan(0)] == [b.samples.tolist() for b in given.plan(0)]
    with pytest.raises(ConfigError, match=r"repeats must be ints, one per index, got 1.5"):
        ds(repeats=[0, 1.5])
