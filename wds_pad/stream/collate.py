"""What a batch is: the one collation rule of the bucketed path.

The plan decides which samples form a batch; a collation function decides what the batch
*is*. Unless the user passes one, :func:`collate_batch` does, and it looks only at the
samples, never at which transforms ran (adding ``.decode("pil")`` does not change a
batch's type):

- dict samples (what ``fetch`` yields, and what ``.decode`` / ``.map`` keep) -> the list
  of sample dicts, in plan order;
- tuple (or list) samples (``.to_tuple(...)``) -> a tuple of columns, collated as
  webdataset's ``default_collation_fn`` does (numbers -> a numpy array, tensors and
  arrays of one shape -> stacked, anything else -> a list);
- anything else -> the list of samples.

:func:`collate_columns` is webdataset's ``default_collation_fn`` (what ``.batched()``
asks for: dicts become one dict of columns) without its bare assertions: samples whose
members, field counts or tensor shapes differ raise a :class:`ConfigError` that names
the sample, its members and the option that fixes it. Passing webdataset's own
``default_collation_fn`` anywhere in wds_pad gets this checked version.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
from webdataset.filters import TorchTensor, combine_values, default_collation_fn

from ..errors import ConfigError

__all__ = ["collate_batch", "collate_columns", "lists_only", "run_collation", "where_samples"]

Where = Callable[[int], str]
_IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff", "ppm", "pgm", "pbm"})


def collate_batch(samples: Sequence[Any]) -> Any:
    """The default collation: a list of sample dicts, or a tuple of columns for tuple samples.

    Args:
        samples: one plan batch, after the per-sample transforms.

    Returns:
        ``list(samples)`` for dict (or other non-tuple) samples; for tuple or list
        samples a tuple of columns, as webdataset's ``default_collation_fn`` makes.

    Raises:
        ConfigError: tuple samples with different numbers of fields, or a column of
            tensors or arrays of different shapes.
    """
    return _collate_batch(samples, _describe(samples))


def collate_columns(samples: Sequence[Any]) -> Any:
    """webdataset's ``default_collation_fn`` with checks instead of assertions.

    Dict samples become one dict of columns (``__``-keys that only some samples carry,
    such as ``__substitute_for__``, are None for the others); tuple samples a tuple of
    columns.

    Raises:
        ConfigError: samples with different members (e.g. one ``jpg``, another ``png``)
            or field counts, or a column of tensors or arrays of different shapes; the
            message names the sample, its members and the fix.
    """
    return _collate_columns(samples, _describe(samples))


def lists_only(fn: Callable[[list[Any]], Any] | None, transformed: bool) -> bool:
    """Whether collating with ``fn`` only lists the samples: ``list``, or the default on the
    sample dicts of a stream without per-sample stages (``transformed`` False)."""
    return fn is list or (not transformed and (fn is None or fn is collate_batch))


def run_collation(fn: Callable[[list[Any]], Any] | None, samples: list[Any],
                  where: Where | None = None) -> Any:
    """Collate one plan batch with ``fn`` (None: :func:`collate_batch`).

    ``where(i)`` describes sample ``i`` of the batch for error messages (its key and
    shard, which tuple samples no longer carry). webdataset's ``default_collation_fn``
    is replaced by :func:`collate_columns`, which makes the same batch or says why not.
    """
    where = where or _describe(samples)
    if fn is None or fn is collate_batch:
        return _collate_batch(samples, where)
    if fn is default_collation_fn or fn is collate_columns:
        return _collate_columns(samples, where)
    return fn(samples)


def _describe(samples: Sequence[Any]) -> Where:
    def where(i: int) -> str:
        s = samples[i]
        if isinstance(s, dict) and "__key__" in s:
            url = f" of {s['__url__']!r}" if "__url__" in s else ""
            return f"sample {s['__key__']!r}{url}"
        return f"sample #{i} of the batch"

    return where


def _collate_batch(samples: Sequence[Any], where: Where) -> Any:
    if samples and isinstance(samples[0], (tuple, list)):
        return _collate_columns(samples, where)
    return list(samples)


def _collate_columns(samples: Sequence[Any], where: Where) -> Any:
    if not samples:
        return []
    first = samples[0]
    if isinstance(first, dict):
        return _dict_columns(samples, where)
    if not isinstance(first, (tuple, list)):
        raise ConfigError(
            f"{where(0)}: collating a batch into columns needs dict or tuple samples, got "
            f"{type(first).__name__}; return a dict or a tuple from .map(), or pass "
            "collation_fn=None (a list of samples) or a collation_fn of your own")
    for i, s in enumerate(samples):
        if not isinstance(s, (tuple, list)) or len(s) != len(first):
            got = f"{len(s)} fields" if isinstance(s, (tuple, list)) else f"a {type(s).__name__}"
            raise ConfigError(
                f"{where(i)} has {got} where {where(0)} has {len(first)}: the samples of one batch "
                "must have the same fields to be collated into columns; make every sample the same "
                "tuple (.to_tuple('jpg;png', 'json') picks the first member present), or pass "
                "collation_fn=None for a list of samples")
    columns = [_column([s[c] for s in samples], f"field {c}", where) for c in range(len(first))]
    return tuple(columns)


def _dict_columns(samples: Sequence[Any], where: Where) -> dict[str, Any]:
    members = _members(samples[0])
    keys = set(samples[0])
    for i, s in enumerate(samples):
        if not isinstance(s, dict):
            raise ConfigError(f"{where(i)} is a {type(s).__name__} where {where(0)} is a dict: "
                              "the samples of one batch must have one type to be collated")
        if _members(s) != members:
            raise ConfigError(_members_message(samples, i, where))
        keys.update(s)
    # meta keys such as __substitute_for__ are on some samples only: None for the others
    ordered = list(samples[0]) + sorted(k for k in keys if k not in samples[0])
    return {k: _column([s.get(k) for s in samples], f"member {k!r}", where) for k in ordered}


def _members(sample: dict[str, Any]) -> frozenset[str]:
    return frozenset(k for k in sample if not (isinstance(k, str) and k.startswith("__")))


def _members_message(samples: Sequence[Any], i: int, where: Where) -> str:
    mine, theirs = _members(samples[i]), _members(samples[0])
    differ = sorted(mine ^ theirs)
    alternatives = ";".join(differ)
    if len(differ) > 1 and all(m in _IMAGE_EXTS for m in differ):
        fix = (f"Fold the alternatives into one member first: .rename(image={alternatives!r}) "
               f"(or .to_tuple({alternatives!r}, ...))")
    elif len(differ) > 1:
        fix = (f"Fold the alternatives into one member first: .rename(FIELD={alternatives!r}) "
               "(or pick fields with .to_tuple())")
    else:
        fix = f"Give every sample {differ[0]!r} or drop it in .map() (or pick fields with .to_tuple())"
    return (f"{where(i)} has members {sorted(mine)} but {where(0)} in the same batch has "
            f"{sorted(theirs)}: collating dicts into columns needs the same members in every "
            f"sample. {fix}, or pass collation_fn=None for a list of sample dicts")


def _column(values: list[Any], name: str, where: Where) -> Any:
    if isinstance(values[0], (np.ndarray, TorchTensor)):  # what combine_values stacks
        shapes = [getattr(v, "shape", None) for v in values]
        for i, shape in enumerate(shapes):
            if shape != shapes[0]:
                got = tuple(shape) if shape is not None else f"none (a {type(values[i]).__name__})"
                raise ConfigError(
                    f"{where(i)}: {name} has shape {got} but "
                    f"{where(0)} in the same batch has {tuple(shapes[0])}: tensors are stacked only "
                    "if every sample of the batch has the same shape; resize each sample to its "
                    "bucket's shape in .map() (the bucket key is in '__bucket__'), or pass "
                    "collation_fn=None (a list) or a collation_fn of your own")
    return combine_values(values)


def where_samples(refs: Sequence[Any]) -> Where:
    """Names sample ``i`` of a batch by the key and shard it was fetched as."""
    return lambda i: f"sample {refs[i]['__key__']!r} of {refs[i]['__url__']!r}"
