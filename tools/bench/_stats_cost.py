"""What the always-on data-time counters (wds_pad.stream.stats) cost per batch, for
tools/bench/stream.py: the counters' own code, as the stream runs it, around items that
cost nothing, less the same items without it; the fastest of ``repeat`` runs of each.

* one process (:func:`counter_ns_per_batch`): the loop's timing layer
  (``Clock.waited``, which counts the making too) around batches, against the same
  batches without the layer; with ``timed_collation``, each batch's maker times its
  collation (two clock reads), as ``BatchMaker`` does for a collation that does more
  than list the samples (the default on sample dicts only lists them: not timed);
* a Loader with workers (:func:`loader_ns_per_batch`): in the main process, the same
  timing layer and the receiving layer (``Clock.received``) around messages of ``run``
  batches, each unpickled with its ``WorkerNote``; in a worker, the make timing
  (``Clock.made``) and the note (``Clock.noted``), each message pickled with it, as
  DataLoader pickles it; against the same messages pickled and unpickled bare.

A remote read adds one wait timing per request (not per sample), against a request's
network time."""

from __future__ import annotations

import pickle
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Iterator

from wds_pad.io.options import ReadStats
from wds_pad.stream.stats import COLLATE, Clock
from wds_pad.stream.transport import PackedRun


def _items(n: int) -> Iterator[int]:
    yield from range(n)


def _marked(n: int, stamps: list[int]) -> Iterator[int]:
    """Batches whose (empty) collation is timed, as ``BatchMaker._collated`` times it."""
    now = time.perf_counter_ns
    for i in range(n):
        began = now()
        stamps[COLLATE] += now() - began
        yield i


def _best(bare: Callable[[], Any], counted: Callable[[], Any], per: int, repeat: int) -> float:
    """The fastest counted run less the fastest bare one, per item: each fastest run is the
    least disturbed (the fastest difference of two runs would favour a slow bare one)."""
    now, fastest = time.perf_counter_ns, {bare: float("inf"), counted: float("inf")}
    for _ in range(repeat):
        for fn in fastest:  # in turn, so a load spike hits both
            began = now()
            fn()
            fastest[fn] = min(fastest[fn], now() - began)
    return max(0.0, (fastest[counted] - fastest[bare]) / per)


def counter_ns_per_batch(timed_collation: bool = False, n: int = 50_000, repeat: int = 20) -> float:
    """Nanoseconds the counters add to one batch in one process."""

    def bare() -> None:
        for _ in _items(n):
            pass

    def counted() -> None:
        clock = Clock()
        for _ in clock.waited(_marked(n, clock.acc) if timed_collation else _items(n), making=True):
            pass

    return _best(bare, counted, n, repeat)


def _messages(n: int, run: int) -> Iterator[PackedRun]:
    for i in range(0, n, run):
        yield PackedRun(range(i, min(n, i + run)))


def _main_loop(received: Iterator[Any]) -> Iterator[Any]:
    """The Loader's loop over messages (Loader._received): each batch of each run."""
    for item in received:
        yield from item


def loader_ns_per_batch(run: int, n: int = 50_000, repeat: int = 20) -> tuple[float, float]:
    """Nanoseconds the counters add to one batch under a Loader whose workers send ``run``
    batches a message: ``(main process, worker)``."""
    dumps, loads = ForkingPickler.dumps, pickle.loads

    def worker_bare() -> list[bytes]:
        return [bytes(dumps(m)) for m in _messages(n, run)]

    def worker_counted() -> list[bytes]:
        clock = Clock()
        clock.start_reader(ReadStats())
        return [bytes(dumps(m)) for m in clock.noted(clock.made(_messages(n, run)))]

    plain, noted = worker_bare(), worker_counted()

    def main_bare() -> None:
        for _ in _main_loop(loads(m) for m in plain):
            pass

    def main_counted() -> None:
        clock = Clock()
        for _ in clock.waited(_main_loop(clock.received(loads(m) for m in noted)), making=False):
            pass

    return _best(main_bare, main_counted, n, repeat), _best(worker_bare, worker_counted, n, repeat)
