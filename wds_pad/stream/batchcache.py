"""Plan batches computed a chunk at a time, for one stream: a DataLoader worker's share of
the plan, or all of it.

Invariants:
- ``BatchCache.get(plan, j)`` is ``plan[j]``, computed with the batches of the chunk it
  belongs to (``Plan.batches``: one pass of the permutation for all their entries; a
  batch alone pays numpy's fixed cost per operation); a chunk starting at a run's first
  batch holds only batches this stream takes (every ``step``-th run of ``run``
  consecutive batches), at least ``CHUNK`` batches and ``CHUNK_SAMPLES`` samples' worth;
  a miss anywhere computes a chunk from there, so ``get`` is right for any ``j``;
- with a reader, each chunk's member work is prepared with it, and work prepared for
  another chunk or plan is dropped (it would never be read).
"""

from __future__ import annotations

from typing import Any

from ..core.planning.plan import Batch
from .batchread import BatchReader

__all__ = ["BatchCache", "CHUNK", "CHUNK_SAMPLES", "chunk_batches"]

CHUNK = 32  # plan batches computed together (Plan.batches), at least
CHUNK_SAMPLES = 4096  # ... and at least this many samples' worth (batch 1: 4096 batches)


def chunk_batches(batch_size: int) -> int:
    """How many plan batches to compute together: at least ``CHUNK``, and enough for
    ``CHUNK_SAMPLES`` samples (a small batch pays numpy's fixed costs once per chunk)."""
    return max(CHUNK, CHUNK_SAMPLES // max(1, int(batch_size)))


class BatchCache:
    """Plan batches computed a chunk at a time (``Plan.batches``), for one stream that takes
    runs of ``run`` consecutive batches every ``step`` runs (a DataLoader worker's share,
    ``PlannedSource``); with a ``reader``, each chunk's member work is prepared with it
    (:meth:`BatchReader.prepare`)."""

    def __init__(self, step: int = 1, reader: BatchReader | None = None, run: int = 1) -> None:
        self.step = step
        self.run = max(1, run)
        self.reader = reader
        self._plan: Any = None
        self._batches: dict[int, Batch] = {}

    def get(self, plan: Any, j: int) -> Batch:
        if plan is not self._plan or j not in self._batches:
            chunked = getattr(plan, "batches", None)
            if chunked is None:  # a plan without chunked evaluation: one batch at a time
                return plan[j]  # type: ignore[no-any-return]
            self._plan = plan
            n, run = chunk_batches(getattr(plan, "batch_size", 1)), self.run
            stride, rounds = self.step * run, max(1, n // run)
            if run == 1:
                got = chunked(j, j + n * self.step, self.step)
            elif self.step <= run:  # one pass over every stream's runs, this one's kept: a
                # permutation pass costs numpy's fixed costs, several times those of its entries
                got = [b for b in chunked(j, j + rounds * stride) if (b.index - j) // run % self.step == 0]
            else:  # each place in a run strided on its own: this stream's batches only
                got = [b for o in range(run) for b in chunked(j + o, j + o + rounds * stride, stride)]
            self._batches = {b.index: b for b in got}
            if self.reader is not None:
                self.reader._work.clear()  # a plan's other chunk, or another plan: never read now
                self.reader.prepare(got)
        return self._batches.pop(j)
