"""Tests of wds_pad.index.buckets.protocol: every built-in is a BucketFn, keys are checked."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from wds_pad.errors import BucketError
from wds_pad.index.buckets import (
    AspectBuckets,
    BucketFn,
    CallableBuckets,
    ImageBuckets,
    JsonField,
    MappingBuckets,
    SingleBucket,
    check_bucket_key,
    wrap_callable,
)


def lang_of(key: str, data: dict[str, bytes]) -> str | None:
    return json.loads(data["json"]).get("lang")


def test_builtins_follow_the_protocol(tmp_path) -> None:
    fns = [SingleBucket(), AspectBuckets(), AspectBuckets(step=0.1), JsonField("n", boundaries=(1, 2)),
           ImageBuckets(), MappingBuckets({"a": 1}), wrap_callable(lang_of)]
    for fn in fns:
        assert isinstance(fn, BucketFn)
        assert isinstance(fn.members, tuple) and (fn.head_bytes is None or fn.head_bytes > 0)
        desc = fn.describe()
        assert json.loads(json.dumps(desc)) == desc and isinstance(desc["kind"], str)
        assert pickle.loads(pickle.dumps(fn)) == fn
    assert SingleBucket()("any", {}) == "all"
    assert isinstance(wrap_callable(lang_of), CallableBuckets)


def test_frozen() -> None:
    with pytest.raises(AttributeError):
        AspectBuckets().step = 0.5  # type: ignore[misc]


def test_check_bucket_key() -> None:
    assert check_bucket_key("a", "k") == "a" and check_bucket_key(None, "k") is None
    assert check_bucket_key(np.uint8(3), "k") == 3
    with pytest.raises(BucketError, match="sample 'k': bucket key nan is not finite"):
        check_bucket_key(float("nan"), "k")
