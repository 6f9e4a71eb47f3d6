"""The member work of a chunk of plan batches (stream/batchread.py prepares it): per
sample and per member, what reading a batch through the index's member table takes.

Invariants:
- a batch's work is its slices of its chunk's lists and arrays (``Work``), or ``EXACT``
  for a batch ``fetch``'s exact path reads;
- per-member lists only the per-sample path reads are made when it first does.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ..index.record import Index
from ..tar.names import SIZE, token_list

__all__ = ["EXACT", "Chunk", "Work", "tables"]

_TABLES: weakref.WeakKeyDictionary[Index, tuple[Any, ...]] = weakref.WeakKeyDictionary()


def tables(ix: Index) -> tuple[Any, ...]:
    """Per index, once: its URLs and the sections the fast path reads."""
    t = _TABLES.get(ix)
    if t is None:
        a = ix.arrays
        t = _TABLES[ix] = (ix.urls, a["shard"], a["offset"], a["length"], a["key_offsets"], a["keys"],
                           a["member_start"], a["member_ext"], a["member_size"], ix.exts)
    return t


@dataclass
class Chunk:
    """The member work of a chunk of plan batches, per sample as lists, per member as arrays
    (see :meth:`BatchReader.prepare`); a batch's work is its slices of them. The per-member
    lists only the per-sample path reads (header offsets, sizes, name and size tokens,
    ``tar.names``) are made when it first does: a batch read into one buffer checks its
    headers on the arrays."""

    urls: list[str]
    offsets: list[int]
    lengths: list[int]
    counts: list[int]
    keys: list[str]
    ids: list[int]
    pads: list[bool]
    exts: list[str]
    arrays: tuple[Any, ...] = ()  # per sample lengths, counts; per member header offsets,
    # sizes, name rows, whether each name fits, size rows

    @cached_property
    def heads(self) -> list[int]:  # member header offsets in their sample
        return self.arrays[2].tolist() if self.arrays else []

    @cached_property
    def sizes(self) -> list[int]:
        return self.arrays[3].tolist() if self.arrays else []

    @cached_property
    def ntoks(self) -> list[bytes | tuple[()]]:  # each member's name token (tar.names)
        return token_list(self.arrays[4], self.arrays[5]) if self.arrays else []

    @cached_property
    def stoks(self) -> list[bytes]:  # ... and size token
        return self.arrays[6].view("V12").ravel().tolist() if self.arrays else []

    @cached_property
    def fields(self) -> tuple[np.ndarray, np.ndarray]:
        """Per member its name and size fields as one uint8 row, and where in its header
        each column lies: what a batch read into one buffer compares in one pass."""
        rows, srows = self.arrays[4], self.arrays[6]
        return (np.concatenate([rows, srows], axis=1),
                np.concatenate([np.arange(rows.shape[1]), SIZE + np.arange(12)]))


#: One batch's work: its chunk, its samples [lo, hi) and members [mlo, mhi) there, and its
#: bytes; ``EXACT`` for a batch the exact path reads.
Work = tuple[Chunk, int, int, int, int, int]
EXACT: Any = ()
