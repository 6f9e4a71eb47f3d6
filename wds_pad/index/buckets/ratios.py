"""Aspect-ratio candidates, their spellings, and the bucket label of a ratio.

Shared by :class:`~wds_pad.index.buckets.AspectBuckets`, :class:`~wds_pad.index.buckets.ImageBuckets`
and the column fast path (:mod:`.columns`).

Invariants:
    * A candidate's label is canonical: ``"w:h"`` with integral parts printed without a
      decimal point (``(16, 9)``, ``"16:9"`` and ``" 16.0 : 9 "`` all give ``"16:9"``),
      or the number itself (``1.333`` gives ``"1.333"``).
    * :func:`quantize` is pure and deterministic: the candidate nearest in log space,
      the first listed on ties; with ``step``, the ratio rounded to a multiple of
      ``step`` (never below one step) printed with the step's decimals.
    * Candidates are validated once, at construction: empty lists, non-positive ratios,
      two spellings of one ratio, and ``ratios`` together with ``step`` raise
      :class:`ConfigError` naming the item.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence
from decimal import Decimal

from ...errors import ConfigError

__all__ = ["DEFAULT_RATIOS", "RatioLike", "parse_ratios"]

RatioLike = str | float | int | tuple[float, float]


def format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


#: Default candidates of :class:`AspectBuckets` / :class:`ImageBuckets` (w:h).
DEFAULT_RATIOS: tuple[str, ...] = (
    "1:1", "5:4", "4:5", "4:3", "3:4", "3:2", "2:3", "16:9", "9:16", "2:1", "1:2", "21:9", "9:21",
)


def _positive(text: object, item: object) -> float:
    try:
        value = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(text, bool) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"ratio {item!r} is not a positive ratio; write it as '4:3', '1.333' or (4, 3)")
    return value


def _ratio_entry(item: RatioLike) -> tuple[str, float]:
    """Return (canonical label, value) of one ratio."""
    if isinstance(item, str) and ":" in item:
        w_text, _, h_text = item.partition(":")
        width, height = _positive(w_text.strip(), item), _positive(h_text.strip(), item)
        return f"{format_number(width)}:{format_number(height)}", width / height
    if isinstance(item, (tuple, list)):
        if len(item) != 2:
            raise ConfigError(f"ratio {item!r} must be a (width, height) pair")
        width, height = _positive(item[0], item), _positive(item[1], item)
        return f"{format_number(width)}:{format_number(height)}", width / height
    value = _positive(item.strip() if isinstance(item, str) else item, item)
    return format_number(value), value


def parse_ratios(text: str) -> tuple[str, ...]:
    """Parse a CLI ratio list such as ``"1:1,4:3,3:4,16:9"`` or ``"1,1.333,0.75"``.

    Raises:
        ConfigError: An item is empty or not a positive ratio.
    """
    items = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part for part in items):
        raise ConfigError(
            f"--ratios {text!r}: write a comma-separated list such as '1:1,4:3,3:4,16:9' or '1,1.333'"
        )
    return tuple(_ratio_entry(part)[0] for part in items)


def normalize_ratios(
    ratios: Sequence[RatioLike] | str | None, step: float | None, owner: str
) -> tuple[tuple[str, ...] | None, tuple[float, ...]]:
    """Validate ``ratios`` / ``step``; return (labels or None, log values)."""
    if ratios is not None and step is not None:
        raise ConfigError(f"{owner}: give either ratios or step, not both")
    if step is not None:
        numeric = isinstance(step, (int, float)) and not isinstance(step, bool)
        if not (numeric and math.isfinite(step) and step > 0):
            raise ConfigError(f"{owner}: step must be a positive number such as 0.25, got {step!r}")
        return None, ()
    if isinstance(ratios, str):
        ratios = parse_ratios(ratios)
    entries = [_ratio_entry(item) for item in (DEFAULT_RATIOS if ratios is None else ratios)]
    if not entries:
        raise ConfigError(f"{owner}: ratios is empty; give at least one ratio such as '1:1'")
    logs = tuple(math.log(value) for _, value in entries)
    for i, a in enumerate(logs):
        for j in range(i):
            if abs(a - logs[j]) < 1e-12:
                raise ConfigError(
                    f"{owner}: ratios {entries[j][0]!r} and {entries[i][0]!r} are the same ratio; drop one"
                )
    return tuple(label for label, _ in entries), logs


def quantize(
    ratio: float, labels: tuple[str, ...] | None, logs: tuple[float, ...], step: float | None
) -> str:
    """Bucket label of ``ratio``: nearest candidate in log space (first on ties), or rounded to ``step``."""
    if step is not None:
        decimals = _decimals(step)
        return f"{max(1, round(ratio / step)) * step:.{decimals}f}"
    target = math.log(ratio)
    order, sorted_logs = _sorted_logs(logs)
    # the nearest candidate is a neighbour of target's place in the sorted logs; among
    # equally near ones the first listed wins, as min(range(...)) would pick
    j = bisect.bisect_left(sorted_logs, target)
    best = min((abs(target - sorted_logs[c]), order[c]) for c in (j - 1, j) if 0 <= c < len(order))[1]
    return (labels or ())[best]


@functools.lru_cache(maxsize=64)
def _sorted_logs(logs: tuple[float, ...]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    order = tuple(sorted(range(len(logs)), key=lambda i: (logs[i], i)))
    return order, tuple(logs[i] for i in order)


@functools.lru_cache(maxsize=64)
def _decimals(step: float) -> int:
    return max(0, -int(Decimal(repr(float(step))).normalize().as_tuple().exponent))
