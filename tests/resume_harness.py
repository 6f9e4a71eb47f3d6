"""A shared resume harness for stateful iterables (torchdata.nodes style).

For any object with ``state_dict()`` / ``load_state_dict()`` that a ``drive`` function
turns into a stream, :func:`check_resume` stops the stream after k items, saves the
state (through a JSON round trip, as a checkpoint would), resumes a *fresh* object from
it and asserts that the rest of the stream equals the uninterrupted stream's remainder,
item for item. :func:`check_start_mid_boundary` runs it at the start, mid-epoch and on
both sides of every epoch boundary.

Usage::

    check_start_mid_boundary(lambda: BucketedWebDataset(...), drive=epochs_driver(2),
                             key=batch_key, boundaries=[len_epoch0])
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Callable, Iterable, Iterator, Sequence

Make = Callable[[], Any]
Drive = Callable[[Any], Iterator[Any]]


def epochs_driver(last_epoch: int) -> Drive:
    """Iterate an epochs-mode loader from its position to the end of ``last_epoch``."""

    def drive(obj: Any) -> Iterator[Any]:
        while True:
            yield from obj
            if obj.epoch >= last_epoch:
                return
            obj.set_epoch(obj.epoch + 1)

    return drive


def take(drive: Drive, obj: Any, n: int | None, key: Callable[[Any], Any]) -> list[Any]:
    """The keys of the first ``n`` items (all if None) that ``drive(obj)`` yields."""
    it = drive(obj)
    items = it if n is None else itertools.islice(it, n)
    out = [key(x) for x in items]
    if hasattr(it, "close"):
        it.close()
    return out


def check_resume(make: Make, stop: int, *, drive: Drive = iter, key: Callable[[Any], Any] = lambda x: x,
                 total: int | None = None, reference: Sequence[Any] | None = None,
                 load: Callable[[Any, dict[str, Any]], None] | None = None,
                 roundtrip: bool = True) -> dict[str, Any]:
    """Stop after ``stop`` items, save, resume a fresh object; the rest must match.

    Args:
        make: builds a fresh stateful iterable, identically configured each time.
        stop: items consumed before saving.
        drive: turns the object into its stream (``iter``; or ``epochs_driver(e)``).
        key: what to compare of each item (e.g. sample keys and pad flags).
        total: stream length to compare (required for endless streams).
        reference: the uninterrupted stream's keys, if already computed.
        load: how to load a state (default ``obj.load_state_dict(state)``).
        roundtrip: pass the state through JSON (off for states that are not JSON-safe,
            such as torchdata's StatefulDataLoader's, which has int keys).

    Returns:
        The saved state.
    """
    ref = list(reference) if reference is not None else take(drive, make(), total, key)
    assert 0 <= stop <= len(ref), f"stop {stop} is outside the stream of {len(ref)} items"
    first = make()
    it = drive(first)
    head = [key(x) for x in itertools.islice(it, stop)]
    state = first.state_dict()
    if roundtrip:  # a checkpoint holds JSON-safe data
        state = json.loads(json.dumps(state))
    assert head == ref[:stop], "the first run diverged before the stop"
    assert first.state_dict() == first.state_dict(), "state_dict() must not change the object"
    if hasattr(it, "close"):
        it.close()
    resumed = make()
    (load or (lambda o, s: o.load_state_dict(s)))(resumed, state)
    rest = take(drive, resumed, None if total is None else total - stop, key)
    assert rest == ref[stop:], (
        f"after resuming at item {stop}: {len(rest)} items, expected {len(ref) - stop}; "
        f"first difference at {next((i for i, (a, b) in enumerate(zip(rest, ref[stop:])) if a != b), min(len(rest), len(ref) - stop))}"
    )
    return state


def check_start_mid_boundary(make: Make, *, drive: Drive = iter, key: Callable[[Any], Any] = lambda x: x,
                             boundaries: Iterable[int] = (), total: int | None = None) -> list[int]:
    """Run :func:`check_resume` at the start, mid-stream, around each boundary and the end.

    Returns:
        The stop points checked.
    """
    ref = take(drive, make(), total, key)
    n = len(ref)
    stops = {0, n // 2, n}
    for b in boundaries:
        stops |= {s for s in (b - 1, b, b + 1) if 0 <= s <= n}
    for stop in sorted(stops):
        check_resume(make, stop, drive=drive, key=key, total=total, reference=ref)
    return sorted(stops)
