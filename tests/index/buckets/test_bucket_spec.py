"""Tests of wds_pad.index.buckets.spec: the --bucket-by spellings and their options."""

from __future__ import annotations

import pytest

from wds_pad.errors import ConfigError
from wds_pad.index.buckets.spec import parse_bucket_by
from wds_pad.index.buckets import AspectBuckets, ImageBuckets, JsonField, SingleBucket


def test_parse_bucket_by_accepted(tmp_path) -> None:
    mapping = tmp_path / "m.tsv"
    mapping.write_text("a\tx\n")
    assert parse_bucket_by("none") == SingleBucket()
    assert parse_bucket_by("aspect") == AspectBuckets()
    assert parse_bucket_by(" aspect:w, h ", ratios="1:1,4:3") == AspectBuckets("w", "h", ratios=("1:1", "4:3"))
    assert parse_bucket_by("aspect", step=0.25) == AspectBuckets(step=0.25)
    assert parse_bucket_by("json:meta.lang") == JsonField("meta.lang")
    assert parse_bucket_by("json:n", boundaries="128, 256,512") == JsonField("n", boundaries=(128, 256, 512))
    assert parse_bucket_by("json:n", boundaries="0.5,1e3").boundaries == (0.5, 1000.0)
    assert parse_bucket_by("IMAGE", ratios="1,1.5") == ImageBuckets(ratios=("1", "1.5"))
    assert parse_bucket_by(f"map:{mapping}")("a", {}) == "x"
    assert parse_bucket_by(f"map:{mapping.as_uri()}")("a", {}) == "x"


@pytest.mark.parametrize(
    ("spec", "options", "needle"),
    [
        ("aspects", {}, "accepted forms: none | aspect"),
        ("", {}, "accepted forms"),
        ("json", {}, "accepted forms"),
        ("json:", {}, "accepted forms"),
        ("map:", {}, "accepted forms"),
        ("none:x", {}, "accepted forms"),
        ("image:png", {}, "accepted forms"),
        ("aspect:w", {}, "accepted forms"),
        ("aspect:w,h,d", {}, "accepted forms"),
        ("none", {"ratios": "1:1"}, "--ratios/--step apply only"),
        ("json:n", {"step": 0.1}, "--ratios/--step apply only"),
        ("aspect", {"boundaries": "1,2"}, "--boundaries applies only"),
        ("json:n", {"boundaries": "1,x"}, "--boundaries '1,x'"),
        ("json:n", {"boundaries": "2,1"}, "strictly increasing"),
        ("aspect", {"ratios": "1:1,,2:1"}, "comma-separated"),
        ("aspect", {"ratios": "1:1", "step": 0.5}, "either ratios or step"),
    ],
)
def test_parse_bucket_by_rejected(spec: str, options: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as err:
        parse_bucket_by(spec, **options)
    assert "\n" not in str(err.value)
