"""The batch-column fast path of :class:`~wds_pad.index.buckets.AspectBuckets`.

The indexer hands a bucket function that has ``many`` a whole shard's column of
``.json`` members at once; :class:`AspectColumns` (mixed into ``AspectBuckets``) parses
the column with json's C scanner and quantises the ratios in numpy, about three times
faster than one ``__call__`` per sample (measured by ``tools/bench/index.py``).

Invariants:
    * ``many(keys, columns)[i]`` is exactly what ``self(keys[i], data_i)`` gives: the same
      bucket, or an exception of the same type and message (a property test checks it).
    * Only plain samples take the column path: one JSON object and nothing after it,
      with top-level positive finite numeric fields whose ratio neither underflows to 0
      nor overflows. Every other sample goes through ``__call__``, with its messages.
    * The column path runs per-column steps in C (``map`` over C functions): no Python
      frame per sample. Change it only with the benchmark run before and after.
"""

from __future__ import annotations

import itertools
import json.scanner
import math
import operator
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .ratios import RatioLike, quantize

_json_scan = json.scanner.make_scanner(json.JSONDecoder())  # one value at an offset: (value, end)
_NUMBER = frozenset((int, float))  # JSON numbers (bool is not one)
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


class AspectColumns:
    """``many`` for :class:`~wds_pad.index.buckets.AspectBuckets`, whose fields these are."""

    member: str
    width_field: str
    height_field: str
    ratios: Sequence[RatioLike] | str | None
    step: float | None
    _logs: tuple[float, ...]

    if TYPE_CHECKING:
        def __call__(self, key: str, data: Mapping[str, bytes]) -> str: ...

    def many(self, keys: Sequence[str], columns: Mapping[str, Sequence[bytes | None]]) -> list[Any]:
        """``self(key, data)`` for many samples at once: the bucket, or the exception
        it raises, for each key. ``columns[ext][i]`` is sample ``i``'s member ``ext``
        (``None``: it has none). The same results as one call per sample, about three
        times faster: plain documents are parsed by json's C scanner and ratios
        quantised in numpy; anything else takes the per-sample path, with its messages."""
        n = len(keys)
        out: list[Any] = [None] * n
        member, wf, hf = self.member, self.width_field, self.height_field
        column = columns.get(member) or [None] * n
        fast, ratios = self._many_plain(column) if "." not in wf and "." not in hf else ([], [])
        for i in sorted(set(range(n)).difference(fast)) if len(fast) < n else ():
            try:  # the per-sample path, with its messages
                out[i] = self(keys[i], {} if column[i] is None else {member: column[i]})
            except Exception as exc:  # noqa: BLE001 - returned, as the indexer's contract says
                out[i] = exc
        if fast and self.step is not None:
            for i, r in zip(fast, ratios):
                try:  # a ratio near the float maximum overflows when divided by the step
                    out[i] = quantize(r, None, (), self.step)
                except Exception as exc:  # noqa: BLE001 - returned, as from __call__
                    out[i] = exc
        elif fast:  # the nearest candidate in log space, the first listed on ties, as quantize
            logs = np.fromiter(map(math.log, ratios), dtype=np.float64, count=len(ratios))
            nearest = np.abs(logs[:, None] - np.asarray(self._logs)[None, :]).argmin(1)
            labels = self.ratios or ()
            if len(fast) == n:  # every sample plain: the labels in order
                return [labels[j] for j in nearest.tolist()]  # type: ignore[index]
            for i, j in zip(fast, nearest.tolist()):
                out[i] = labels[j]  # type: ignore[index]
        return out

    def _many_plain(self, column: Sequence[bytes | None]) -> tuple[list[int], list[float]]:
        """(indices, ratios) of the samples whose member is one JSON object with top-level
        positive finite numbers for both fields; the rest take the per-sample path.

        Whole-column steps in C first (decode, scan, field lookups, type sets); any
        exception sends every sample through the per-sample loop below instead."""
        scan, wf, hf = _json_scan, self.width_field, self.height_field
        try:  # map() with C functions: no Python frame per sample
            texts = list(map(bytes.decode, column))  # type: ignore[arg-type]
            parsed = list(map(scan, texts, itertools.repeat(0)))
            if list(map(_SECOND, parsed)) == list(map(len, texts)):  # nothing after the object
                docs = list(map(_FIRST, parsed))
                ws = list(map(operator.itemgetter(wf), docs))
                hs = list(map(operator.itemgetter(hf), docs))
                if set(map(type, ws)) <= _NUMBER and set(map(type, hs)) <= _NUMBER:
                    w, h = np.array(ws, np.float64), np.array(hs, np.float64)
                    with np.errstate(all="ignore"):
                        r = w / h
                    # positive finite fields, and a ratio that neither underflows to 0 nor
                    # overflows: __call__ says what happens to the others
                    good = (w > 0) & (h > 0) & (w < math.inf) & (h < math.inf) & (r > 0) & (r < math.inf)
                    return np.flatnonzero(good).tolist(), r[good].tolist()
        except Exception:  # noqa: BLE001 - one sample is unusual: look at each below
            pass
        fast: list[int] = []
        ratios: list[float] = []
        inf = math.inf
        for i, raw in enumerate(column):
            try:
                t = raw.decode("utf-8")  # type: ignore[union-attr]
                doc, end = scan(t, 0)
                w, h = doc[wf], doc[hf]
                if end == len(t) and type(w) in _NUMBER and type(h) in _NUMBER and 0 < w < inf and 0 < h < inf:
                    r = float(w) / float(h)
                    if 0 < r < inf:
                        ratios.append(r)
                        fast.append(i)
            except Exception:  # noqa: BLE001 - the per-sample path says what is wrong
                pass
        return fast, ratios
