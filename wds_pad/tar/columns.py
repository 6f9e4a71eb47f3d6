"""The lean path's rows: :class:`ScanRows`, a shard's samples as columns, and
:class:`Accumulator`, the rows as they are found.

Both paths of the indexer's scan add to a shard's :class:`Accumulator`: the lean path's
batch checks (:func:`.settle.settle_many`) many rows at a time, the general parser
(:mod:`.members`) one :class:`~.members.ScannedSample` at a time where it takes over;
:meth:`Accumulator.rows` then gives the shard's :class:`ScanRows`.

Invariants:
    * Rows keep archive order, whichever path found them (:meth:`Accumulator.flush`
      closes a run of the general parser's samples before the lean path adds more).
    * The member table records every sample: each member's extension, payload size and
      payload offset from the sample's first byte, whatever headers lie before it.
    * An extension table holds at most 64 extensions: one more is :func:`too_many_exts`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection

import numpy as np

from ..errors import ShardError, TarFormatError
from .members import ScannedSample

__all__ = ["Accumulator", "ScanRows", "too_many_exts"]


@dataclass
class ScanRows:
    """The samples of one shard, as columns.

    Attributes:
        url: The shard, for messages.
        offset: Byte offset of each sample's first header (int64).
        length: Bytes up to the end of its last member's padded payload (int64).
        keys: Each sample's webdataset ``__key__``.
        exts: The extension table: bit ``i`` of a mask means ``exts[i]``.
        mask: Each sample's member extensions as a bit mask (uint64).
        data: For each wanted extension, each sample's payload (its first ``head_bytes``
            when that is set), or ``None`` where the sample has no such member.
        fault: With ``on_error="skip"``: why the scan stopped early, else ``None``.
        member_count: Each sample's members in the member table (int64; 0: its headers
            are not all plain, streaming parses them), or ``None``: no member table.
        member_ext: Each recorded member's extension, a bit number of ``exts`` (uint8),
            samples back to back, members in archive order.
        member_size: Each recorded member's payload size (int64).
        member_offset: Each recorded member's payload offset from its sample's first
            byte (int64): whatever headers lie before it (pax, GNU long names, ustar
            prefixes, skipped metadata members), the payload starts there.
    """

    url: str
    offset: np.ndarray
    length: np.ndarray
    keys: list[str]
    exts: list[str]
    mask: np.ndarray
    data: dict[str, list[bytes | None]]
    fault: TarFormatError | None = None
    member_count: np.ndarray | None = None
    member_ext: np.ndarray | None = None
    member_size: np.ndarray | None = None
    member_offset: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def sample_data(self, i: int) -> dict[str, bytes]:
        """Sample ``i``'s wanted payloads as ``{ext: bytes}`` (what scan_tar's ``data`` holds)."""
        return {e: col[i] for e, col in self.data.items() if col[i] is not None}  # type: ignore[misc]

    def sample_exts(self, i: int) -> tuple[str, ...]:
        """Sample ``i``'s extensions, in table order."""
        m = int(self.mask[i])
        return tuple(e for b, e in enumerate(self.exts) if m >> b & 1)


def too_many_exts(url: str, exts: Collection[str]) -> ShardError:
    """The error for a shard whose members have more extensions than an index records."""
    names = sorted(set(exts))
    shown = ", ".join(map(repr, names[:10])) + (f", ... ({len(names) - 10} more)" if len(names) > 10 else "")
    return ShardError(
        f"{url}: more than 64 distinct member extensions ({shown}); an index records at most 64 "
        "per dataset: give the members fewer distinct suffixes, or index with on_error='skip' "
        "(--on-error skip) to leave this shard out"
    )


@dataclass
class Accumulator:
    """Rows as they are found, in archive order."""

    want: frozenset[str]
    offset: list[np.ndarray] = field(default_factory=list)
    length: list[np.ndarray] = field(default_factory=list)
    mask: list[np.ndarray] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    data: dict[str, list[bytes | None]] = field(default_factory=dict)
    samples: int = 0
    report: Callable[[int], None] | None = None  # told of samples found, as they are
    reported: int = 0
    tail_offset: list[int] = field(default_factory=list)  # the general parser's samples
    tail_length: list[int] = field(default_factory=list)
    tail_mask: list[int] = field(default_factory=list)
    bits: dict[str, int] = field(default_factory=dict)
    url: str = ""  # the shard, for messages
    mcount: list[np.ndarray] = field(default_factory=list)  # the member table, in chunks
    mext: list[np.ndarray] = field(default_factory=list)
    msize: list[np.ndarray] = field(default_factory=list)
    moffset: list[np.ndarray] = field(default_factory=list)
    tail_mcount: list[int] = field(default_factory=list)
    tail_mext: list[int] = field(default_factory=list)
    tail_msize: list[int] = field(default_factory=list)
    tail_moffset: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.data = {e: [] for e in sorted(self.want)}

    def bit(self, ext: str) -> int:
        b = self.bits.get(ext)
        if b is None:
            if len(self.bits) == 64:
                raise too_many_exts(self.url, [*self.bits, ext])
            b = self.bits[ext] = len(self.bits)
        return b

    def add(self, s: ScannedSample) -> None:
        """One sample from the general parser (which only ever follows the lean path)."""
        self.tail_offset.append(s.offset)
        self.tail_length.append(s.length)
        bits = 0
        for m in s.members:
            bits |= 1 << self.bit(m.ext)
        self.tail_mask.append(bits)
        # the member table records every sample: each member's payload offset from the
        # sample's first byte, so any header layout before it (pax, GNU long names,
        # ustar prefixes, skipped metadata members) is read without parsing
        members = s.members
        self.tail_mcount.append(len(members))
        self.tail_mext.extend(self.bit(m.ext) for m in members)
        self.tail_msize.extend(m.size for m in members)
        base = s.offset
        self.tail_moffset.extend(m.data_offset - base for m in members)
        self.keys.append(s.key)
        for e, col in self.data.items():
            col.append(s.data.get(e))
        self.samples += 1
        if self.report is not None and self.samples - self.reported >= 1024:
            self.report(self.samples - self.reported)
            self.reported = self.samples

    def flush(self) -> None:
        """The general parser's samples so far become a chunk (before the lean path adds more)."""
        if self.tail_offset or not self.offset:
            self.offset.append(np.array(self.tail_offset, np.int64))
            self.length.append(np.array(self.tail_length, np.int64))
            self.mask.append(np.array(self.tail_mask, np.uint64))
            self.mcount.append(np.array(self.tail_mcount, np.int64))
            self.mext.append(np.array(self.tail_mext, np.uint8))
            self.msize.append(np.array(self.tail_msize, np.int64))
            self.moffset.append(np.array(self.tail_moffset, np.int64))
            self.tail_offset, self.tail_length, self.tail_mask = [], [], []
            self.tail_mcount, self.tail_mext, self.tail_msize, self.tail_moffset = [], [], [], []

    def rows(self, url: str, fault: TarFormatError | None) -> ScanRows:
        if self.report is not None and self.samples > self.reported:
            self.report(self.samples - self.reported)
            self.reported = self.samples
        self.flush()
        cat = lambda xs, dt: (xs[0] if len(xs) == 1 else np.concatenate(xs)).astype(dt, copy=False)  # noqa: E731
        exts = sorted(self.bits, key=self.bits.__getitem__)
        return ScanRows(url, cat(self.offset, np.int64), cat(self.length, np.int64), self.keys, exts,
                        cat(self.mask, np.uint64), self.data, fault, cat(self.mcount, np.int64),
                        cat(self.mext, np.uint8), cat(self.msize, np.int64), cat(self.moffset, np.int64))
