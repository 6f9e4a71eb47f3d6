"""Tests of wds_pad.index.buckets.ratios: ratio spellings, labels and quantisation (through AspectBuckets)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wds_pad.errors import ConfigError
from wds_pad.index.buckets.ratios import parse_ratios
from wds_pad.index.buckets import AspectBuckets


def meta(**fields: object) -> dict[str, bytes]:
    return {"json": json.dumps(fields).encode()}


def test_aspect_ratio_forms_normalise_to_labels() -> None:
    fn = AspectBuckets(ratios=["4:3", (16, 9), 1.5, "0.75", " 2.0 : 1 "])
    assert fn.ratios == ("4:3", "16:9", "1.5", "0.75", "2:1")
    assert fn("k", meta(width=149, height=100)) == "1.5"
    assert AspectBuckets(ratios="1:1,2:1").ratios == ("1:1", "2:1")


@pytest.mark.parametrize(
    ("step", "width", "height", "expected"),
    [(0.25, 1920, 1080, "1.75"), (0.25, 100, 100, "1.00"), (0.1, 126, 100, "1.3"), (1, 10, 100, "1"), (0.5, 1, 9, "0.5")],
)
def test_aspect_step_rounding(step: float, width: int, height: int, expected: str) -> None:
    assert AspectBuckets(step=step)("k", meta(width=width, height=height)) == expected


@settings(max_examples=300, deadline=None)
@given(
    ratios=st.lists(st.floats(0.05, 20.0), min_size=1, max_size=12, unique=True).filter(
        lambda rs: all(abs(math.log(a) - math.log(b)) > 1e-9 for i, a in enumerate(rs) for b in rs[:i])
    ),
    width=st.integers(1, 100_000),
    height=st.integers(1, 100_000),
)
def test_aspect_picks_nearest_in_log_space(ratios: list[float], width: int, height: int) -> None:
    fn = AspectBuckets(ratios=ratios)
    label = fn("k", meta(width=width, height=height))
    chosen = ratios[fn.ratios.index(label)]
    target = math.log(width / height)
    assert all(abs(target - math.log(chosen)) <= abs(target - math.log(r)) for r in ratios)



def test_parse_ratios() -> None:
    assert parse_ratios("1:1, 4:3,3:4,16:9") == ("1:1", "4:3", "3:4", "16:9")
    assert parse_ratios("1,1.333,0.75") == ("1", "1.333", "0.75")
    for bad in ("", "1:1,,2:1", "a:b", "1:-1"):
        with pytest.raises(ConfigError):
            parse_ratios(bad)
