"""Batches of mapped local shards sent by reference: a DataLoader worker checks the
member headers of a batch in its mapping of the shards and sends where the members lie;
the main process copies each member once, out of its own mapping of the same files.

Through a worker's ring (transport.py) every payload is copied twice: into the ring by
the worker, out of it by the main process. A batch sent by reference is copied once, by
the main process, as one process copies it; the worker only plans, checks headers and
sends a few numbers a member. That is what makes a worker's cost small beside the main
process's (docs/streaming.md, "Batches sent by reference").

Invariants:
- only a ``Loader``'s worker sends by reference, batches whose members are ``bytes``, of
  samples of ``REF_BYTES`` and more on average (the index's first rows), of shards it has
  mapped: a worker kept
  between epochs from its second stream of a shard on (shardmaps' rule), a worker of one
  epoch at once (it streams each shard once); every header's name and size fields must
  say what the member table says. A batch whose header checks waited for the disk goes
  through the ring, and that worker maps no more: its payloads are not in the page cache
  either. Any other batch travels in the ring as before;
- the main process opens each shard itself, checked against the index as a worker does
  (``StaleShardError``), maps it at once, and compares its size with the mapping before
  each batch (``shardmaps.shrunk``); a batch whose shards it cannot map, or one shorter
  now, is read with ``os.pread`` member by member, and a short read is a
  ``StaleShardError`` naming the shard and the offset;
- a copy in the main process that waited for the disk (a major page fault) stops mapping
  there (``shardmaps.waited``), and so does a batch it can no longer map for that reason:
  it sets the loader's shared flag (``REFS``), which the workers read before each batch,
  and from then on they read and copy into their rings, where waiting for the disk
  overlaps the training loop, until an iteration of the loader starts while this process
  maps again (``shardmaps.RETRY_SECONDS`` after the wait);
- the sample dicts are exactly the ring path's (:meth:`PackedBatch.dicts`), in plan order.
  ``zero_copy`` batches stay in the ring: their views must never be of a mapping (a file
  cut short under a view the trainer holds would kill the process, shardmaps.py), and a
  copy out of the mapping would move the worker's copy into the main process, which
  with views copies nothing (measured at 500 KB: 37-50 us of the main process's CPU a
  sample by reference, 12.5-15 through the ring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..io import shardmaps
from ..io.stale import short_read
from ..tar.names import HEAD, SIZE
from .transport import PackedBatch

__all__ = ["REFS", "REF_BYTES", "MappedBatch", "MappedShards", "refer"]

REFS = 0  # the flag's place in the Loader's shared flags: 0 by reference, 1 in the rings
#: samples of at least this many bytes on average go by reference; smaller ones through the
#: ring, which the main process copies out of while the worker's writes are still in the
#: CPU's cache (measured: 10 KB 5.2-5.6 us a sample through the ring, 5.9-6.7 by reference;
#: 32 KB 8.8-10.1 against 7.4-8.2; docs/streaming.md, "Batches sent by reference")
REF_BYTES = 16 << 10


@dataclass
class MappedBatch(PackedBatch):
    """A plan batch sent by reference (module doc): no buffer; ``bounds`` holds each
    member's payload start and end in its shard, ``offsets`` each sample's byte offset."""

    offsets: list[int] | None = None

    def samples(self, zero_copy: bool = False, rings: Any = None, shards: Any = None) -> list[dict[str, Any]]:
        if shards is None:
            raise RuntimeError("a batch sent by reference needs the main process's shards (Loader)")
        values = shards.members(self)
        if zero_copy:  # not sent so (module doc); views of the copies, as every batch hands out then
            values = [memoryview(v) for v in values]
        return self.dicts(values)


def refer(reader: Any, work: Any, meta: tuple[Any, ...], pack: list[int] | None,
          seeds: list[Any]) -> MappedBatch | None:
    """In a worker: a batch's prepared member work (stream/memberwork.py: samples [lo, hi)
    of chunk ``c``, members [mlo, mhi)) as a batch sent by reference, or None: a shard not
    mapped here, shorter than its mapping, or a header that does not say what the table
    says (the ring path reads it, and says what changed)."""
    c, lo, hi, mlo, mhi, nbytes = work
    urls, offsets = c.urls[lo:hi], c.offsets[lo:hi]
    views = reader.opened_views(urls, offsets)
    if views is None:
        return None
    heads, ntoks, stoks = c.heads, c.ntoks, c.stoks
    at: list[int] = []
    add = at.append
    m = mlo
    waits = shardmaps.faults()
    for v, o, nb, cnt in zip(views, offsets, c.lengths[lo:hi], c.counts[lo:hi]):
        mm = v.obj
        if o + nb > len(mm):
            return None
        for x in range(m, m + cnt):
            h = o + heads[x]
            head = mm[h:h + HEAD]
            if not (head.startswith(ntoks[x]) and head.startswith(stoks[x], SIZE)):
                return None
            add(h + 512)
        m += cnt
    if shardmaps.faults() != waits:  # its headers were not in the page cache: its payloads may not be
        shardmaps.waited(waits)  # either; this worker reads and copies from now on (shardmaps.py)
        return None
    bounds = np.empty((2, len(at)), np.int64)
    bounds[0] = at
    np.add(bounds[0], c.arrays[3][mlo:mhi], out=bounds[1])
    st = reader.stats
    st.ranges += hi - lo
    st.requests += hi - lo
    st.bytes += nbytes
    return MappedBatch(None, None, 0, 0, -1, bounds, c.exts[mlo:mhi], c.counts[lo:hi], c.keys[lo:hi], urls,
                       c.ids[lo:hi], c.pads[lo:hi], meta, pack, seeds, offsets=offsets)  # type: ignore[arg-type]


class MappedShards:
    """The main process's side (module doc): its own reader of the shards (descriptors,
    the index check, mappings made at once) and the workers' shared flag.

    Args:
        fetcher: the main process's fetch stage (stream/fetch.py); only its reader is used.
        flags: the loader's shared flags (``REFS``) as a numpy int64 array.
    """

    def __init__(self, fetcher: Any, flags: np.ndarray) -> None:
        self.fetcher = fetcher
        self.flags = flags

    def members(self, batch: MappedBatch) -> list[bytes]:
        """Every member of ``batch`` in archive order, sample after sample, as ``bytes``."""
        starts, ends = batch.bounds.tolist()
        counts = batch.counts
        views = self._views(batch)
        values: list[bytes] = []
        add = values.append
        m = 0
        if views is None:  # not mapped here, or shorter now: each member read and its length checked
            read = self._pread
            for url, cnt in zip(batch.urls, counts):
                for x in range(m, m + cnt):
                    add(read(url, starts[x], ends[x]))
                m += cnt
            return values
        waits = shardmaps.faults()
        for v, cnt in zip(views, counts):
            mm = v.obj
            if cnt == 2:  # the common shape (a payload and its .json), unrolled
                add(mm[starts[m]:ends[m]])
                add(mm[starts[m + 1]:ends[m + 1]])
                m += 2
                continue
            for x in range(m, m + cnt):
                add(mm[starts[x]:ends[x]])
            m += cnt
        self._waited(waits)
        return values

    def _views(self, batch: MappedBatch) -> list[memoryview] | None:
        """This process's mapping of each sample's shard (opened and checked here), or None:
        read with ``os.pread`` (mapping off here, or a shard shorter now than its mapping)."""
        reader = self.fetcher.reader
        reader.map_at_once = True
        views = reader.opened_views(batch.urls, batch.offsets)
        if views is None and shardmaps.stopped() is not None:  # mapping is off here: the workers copy from now on
            self.flags[REFS] = 1
        return views

    def _pread(self, url: str, start: int, end: int) -> bytes:
        data = self.fetcher.reader._pread(url, start, end - start)
        if len(data) != end - start:
            raise short_read(url, start, end - start, len(data))
        return data

    def _waited(self, since: int) -> None:
        shardmaps.waited(since)
        if shardmaps.stopped() is not None:  # that copy waited for the disk: the workers copy from now on
            self.flags[REFS] = 1

    def close(self) -> None:
        reader = self.fetcher._reader
        if reader is not None:
            reader.close()
