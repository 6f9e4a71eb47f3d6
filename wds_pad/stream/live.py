"""Open iterators of a dataset in this process, so that a restore never meets a live one.

Invariants:
- ``_live`` counts the iterators of an object (and of a loader over it) that have started
  and not yet finished or been closed, in this process; a copy (``compose``, the pickle a
  DataLoader worker receives) starts with none;
- :meth:`OpenIterators._refuse_while_open` raises a StateError while one is open: that
  iterator would go on from its own position and undo the restored one, and the next
  ``state_dict()`` would report a mix.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from ..errors import StateError

__all__ = ["OpenIterators"]


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
