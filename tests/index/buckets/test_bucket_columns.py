"""Tests of wds_pad.index.buckets.columns: AspectBuckets.many equals one call per sample."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from wds_pad.index.buckets import AspectBuckets

_doc_value = st.one_of(st.integers(-3, 4000), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                       st.none(), st.text(max_size=3), st.just(10**400), st.just(2**60))


@settings(max_examples=200, deadline=None)
@given(docs=st.lists(st.one_of(
    st.fixed_dictionaries({"width": _doc_value, "height": _doc_value}),
    st.fixed_dictionaries({"meta": st.fixed_dictionaries({"w": _doc_value, "h": _doc_value})}),
    st.dictionaries(st.sampled_from(["width", "height", "meta.w", "meta.h", "x"]), _doc_value, max_size=4),
    st.lists(st.integers(), max_size=2)), max_size=12),
    raw=st.lists(st.sampled_from([None, b"", b"{", b' {"width": 4, "height": 3} ', b"\xff\xfe{}",
                                  b'{"width": 4, "height": 3} x', b'{"width": 4e400, "height": 1}']), max_size=3),
    fields=st.sampled_from([("width", "height"), ("meta.w", "meta.h")]),
    step=st.none() | st.sampled_from([0.25, 0.1]))
@example(docs=[{"width": 10842130985062.0, "height": 2.4124542225372354e-295}], raw=[],
         fields=("width", "height"), step=0.25)  # a ratio past the float maximum once divided by the step
@example(docs=[{"width": 43368523940248.0, "height": 2.4124542225372354e-295}, {"width": 5e-324, "height": 7}],
         raw=[], fields=("width", "height"), step=None)  # ratios that overflow to inf and underflow to 0
def test_aspect_many_equals_one_call_per_sample(docs, raw, fields, step) -> None:
    """AspectBuckets.many (the indexer's batch path) gives what __call__ gives, sample by
    sample: the same bucket, or an exception of the same type and message."""
    import json as _json

    fn = AspectBuckets(fields[0], fields[1], step=step)
    payloads = [_json.dumps(d).encode() for d in docs] + raw
    keys = [f"k{i}" for i in range(len(payloads))]
    got = fn.many(keys, {"json": payloads})
    for key, payload, result in zip(keys, payloads, got):
        try:
            want = fn(key, {} if payload is None else {"json": payload})
        except Exception as exc:  # noqa: BLE001
            assert type(result) is type(exc) and str(result) == str(exc)
        else:
            assert result == want


_good_number = st.one_of(st.integers(1, 5000), st.floats(0.5, 1e5))


@settings(max_examples=200, deadline=None)
@given(docs=st.lists(st.fixed_dictionaries({"width": _good_number, "height": _good_number}), min_size=1, max_size=10),
       odd=st.sampled_from([None, True, 0, -1.5, float("inf"), "7", [3], 10**400, 1e-320, 1e300]),
       where=st.integers(0, 9), field=st.sampled_from(["width", "height"]),
       tail=st.sampled_from([b"", b" ", b"\n", b" x", b"{}"]), step=st.none() | st.just(0.25))
def test_aspect_many_batch_path_equals_one_call_per_sample(docs, odd, where, field, tail, step) -> None:
    """Columns of plain documents take many()'s whole-column path; one odd value (or
    trailing bytes) anywhere must still give exactly the per-sample results."""
    import json as _json

    fn = AspectBuckets(step=step)
    docs = list(docs)
    if odd is not None:
        docs[where % len(docs)] = {**docs[where % len(docs)], field: odd}
    payloads = [_json.dumps(d).encode() for d in docs]
    payloads[-1] += tail
    keys = [f"k{i}" for i in range(len(payloads))]
    for key, payload, result in zip(keys, payloads, fn.many(keys, {"json": payloads})):
        try:
            want = fn(key, {"json": payload})
        except Exception as exc:  # noqa: BLE001
            assert type(result) is type(exc) and str(result) == str(exc)
        else:
            assert result == want
