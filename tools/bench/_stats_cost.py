"""What the always-on data-time counters (wds_pad.stream.stats) cost per batch, for
tools/bench/stream.py: in one process, the loop's wait timing (one ``Clock.timed``
wrapper, which counts the making too) and a collation's two clock reads, around items that cost nothing, minus the
same items through a bare generator; best of ``repeat``. A remote read adds one
wait timing per request (not per sample), against a request's network time."""

from __future__ import annotations

import time
from typing import Iterator

from wds_pad.stream.stats import Clock


def _items(n: int) -> Iterator[int]:
    yield from range(n)


def counter_ns_per_batch(n: int = 200_000, repeat: int = 5) -> float:
    """Nanoseconds the counters add to one batch in one process."""
    clock, now = Clock(), time.perf_counter_ns
    best = float("inf")
    for _ in range(repeat):
        began = now()
        for _ in _items(n):
            pass
        bare = now() - began
        began = now()
        for _ in clock.timed(_items(n), "wait_ns", count=True, also="make_ns"):
            clock.collate(now())
        counted = now() - began
        best = min(best, (counted - bare) / n)
    return max(0.0, best)
