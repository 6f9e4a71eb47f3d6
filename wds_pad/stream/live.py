"""Open iterators of a dataset in this process, so that a restore never meets a live one.

Invariants:
- ``_live`` counts the iterators of an object (and of a loader over it) that have started
  and not yet finished or been closed, in this process; a copy (``compose``, the pickle a
  DataLoader worker receives) starts with none;
- :meth:`OpenIterators._refuse_while_open` raises a StateError while one is open: that
  iterator would go on from its own position and undo the restored one, and the next
  ``state_dict()`` would report a mix;
- :func:`refuse_resplitting` raises a ConfigError when the iteration is driven by
  accelerate's DataLoader wrappers (``accelerator.prepare`` of a torch DataLoader over
  our dataset), which would dispatch rank 0's batches or re-batch each rank's stream.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, Iterator

from ..errors import ConfigError, StateError

__all__ = ["OpenIterators", "refuse_resplitting"]

#: The module of accelerate's DataLoader wrappers (DataLoaderShard, DataLoaderDispatcher,
#: IterableDatasetShard): on the stack of an iteration they drive.
_ACCELERATE = "accelerate.data_loader"


def refuse_resplitting(what: str) -> None:
    """Raise a ConfigError if accelerate's DataLoader wrappers drive this iteration.

    ``accelerator.prepare(DataLoader(dataset))`` wraps the loader: by default rank 0
    iterates and dispatches slices of its batches to every rank; with
    ``dispatch_batches=False`` each rank's stream is re-batched and split across the
    processes. Either breaks the plan, which already holds this rank's own batches. The
    wrappers' frames are on the stack of the iteration (in a forked DataLoader worker too,
    which inherits them), so one walk up the stack at the start of an iteration sees them.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == _ACCELERATE:
            code = frame.f_code
            where = getattr(code, "co_qualname", code.co_name)
            effect = ("send slices of rank 0's batches to every rank" if "Dispatcher" in where else
                      "re-batch this rank's batches and split them across the processes")
            raise ConfigError(
                f"{what} is iterated by accelerate ({where}): accelerator.prepare() wrapped a torch "
                f"DataLoader over it and would {effect}, though each rank's plan already holds its own "
                "batches. Wrap the dataset in wds_pad.Loader(dataset, num_workers=...) (prepare() returns "
                "a Loader unchanged) or leave the loader out of accelerator.prepare(); no "
                "DataLoaderConfiguration makes a prepared DataLoader of it exact (see docs/distributed.md, "
                "'Hugging Face Accelerate')")
        frame = frame.f_back  # type: ignore[assignment]


class OpenIterators:
    """Mixin of the resumable datasets: counts their open iterators."""

    _live = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_live": 0}

    def _counted(self, items: Iterable[Any]) -> Iterator[Any]:
        """``items``, counted as an open iterator of this object until it ends or is closed."""
        self._live += 1
        try:
            yield from items
        finally:
            self._live -= 1

    def _refuse_while_open(self, what: str) -> None:
        if self._live:
            raise StateError(
                f"{what}.load_state_dict: an iterator of this loader is still open in this process; "
                "it would go on from its own position and undo the restored one. Load the state "
                "before iterating, or finish or close the open iterator first (leave its for loop, "
                "or call .close() on the iterator you kept)")
