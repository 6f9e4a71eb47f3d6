"""Whole plan batches read from local shards through the index's member table.

The fast path of ``BucketedWebDataset``: a batch's references, member offsets and sizes
are computed in numpy from the index (no tar header is parsed, no reference dict is
built), each sample is one ``os.pread`` (large ones: one per member, straight into the
payload's bytes), and each sample dict is a copy of one per-batch template.

Invariants:
- a batch read here is exactly what the exact path (``fetch``: parse every header) gives
  for it: the same sample dicts, keys in the same order, members in archive order;
- it reads only samples the member table records (plain 512-byte headers) of local
  shards; for anything else (a sample without members, a remote shard, a short read, a
  header that does not name the sample, any error) :meth:`BatchReader.read` returns
  None and the caller reads the batch on the exact path, which raises or substitutes as
  it always did;
- identity check per sample: every member's header begins with ``key + "."`` (a
  ``bytes.startswith`` at an offset, no copy); each shard is still checked against its
  indexed size and change stamp once per stream, when first opened (``RangeReader``).
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import numpy as np

from ..core.plan import Batch
from ..index.format import Index
from ..io.ranges import RangeReader

__all__ = ["BatchReader", "BIG_SAMPLE", "CHUNK"]

# Samples at least this large are read one payload per pread (no copy out of a range buffer).
BIG_SAMPLE = 256 * 1024
CHUNK = 32  # plan batches computed together (Plan.batches)

_TABLES: weakref.WeakKeyDictionary[Index, tuple[Any, ...]] = weakref.WeakKeyDictionary()


def _tables(ix: Index) -> tuple[Any, ...]:
    """Per index, once: its URLs and the sections the fast path reads."""
    t = _TABLES.get(ix)
    if t is None:
        a = ix.arrays
        t = _TABLES[ix] = (ix.urls, a["shard"], a["offset"], a["length"], a["key_offsets"], a["keys"],
                           a["member_start"], a["member_ext"], a["member_size"], ix.exts)
    return t


def _keys_with_dot(ko: np.ndarray, table: np.ndarray, ids: np.ndarray) -> list[bytes]:
    """``key + b"."`` of each sample id, gathered in one numpy pass."""
    a, b = ko[ids].astype(np.int64), ko[ids + 1].astype(np.int64)
    lens = b - a
    per = lens + 2  # key, ".", NUL
    end = np.cumsum(per)
    out = np.full(int(end[-1]), 46, np.uint8)
    out[end - 1] = 0
    total = int(lens.sum())
    if total:
        src = np.repeat(a - (np.cumsum(lens) - lens), lens) + np.arange(total, dtype=np.int64)
        dst = np.repeat(end - per - (np.cumsum(lens) - lens), lens) + np.arange(total, dtype=np.int64)
        out[dst] = table[src]
    return out.tobytes().split(b"\0")[:-1]


class BatchReader:
    """Reads plan batches of local shards through the member table (see the module doc).

    Args:
        reader: the stream's RangeReader (its descriptors, shard check and stats).
        names: the dataset names of the PlanSpec, parallel to ``indexes``.
        indexes: the PlanSpec's indexes.
    """

    def __init__(self, reader: RangeReader, names: tuple[str, ...], indexes: tuple[Index, ...]) -> None:
        self.reader = reader
        self.by_name = {n: ix for n, ix in zip(names, indexes)}

    def read(self, batch: Batch) -> list[dict[str, Any]] | None:
        """The sample dicts of ``batch``, or None: read it on the exact path instead."""
        try:
            return self._read(batch)
        except Exception:  # noqa: BLE001 - the exact path reads it again and says what is wrong
            return None

    def _read(self, batch: Batch) -> list[dict[str, Any]] | None:
        ix = self.by_name[batch.dataset]
        if not ix.has_members:
            return None
        urls, shard, offset, length, ko, keys, ms, mext, msize, exts = _tables(ix)
        ids = batch.samples
        n = ids.size
        if not n:
            return []
        starts = ms[ids].astype(np.int64)
        counts = ms[ids + 1].astype(np.int64) - starts
        if not counts.all():
            return None  # a sample without recorded members: its headers must be parsed
        first = np.cumsum(counts) - counts
        total = int(counts.sum())
        at = np.repeat(starts - first, counts) + np.arange(total, dtype=np.int64)
        sizes = msize[at].astype(np.int64)
        blocks = 512 + ((sizes + 511) & ~511)
        ends = np.cumsum(blocks)
        head = ends - blocks - np.repeat((ends - blocks)[first], counts)  # header offsets in the sample
        off, ln = offset[ids].astype(np.int64), length[ids].astype(np.int64)
        if not np.array_equal(ends[first + counts - 1] - (ends - blocks)[first], ln):
            return None  # the member table does not cover the range: let the parser decide
        reader = self.reader
        reader._check_fork()
        fds, local_fd = reader._fds, reader.local_fd
        shard_ids = shard[ids].tolist()
        fd_of: dict[int, int] = {}
        for s in set(shard_ids):
            url = urls[s]
            fd = fds.get(url)
            if fd is None:
                fd = local_fd(url)  # opens it: the stale-shard check, once per stream
                if fd is None:
                    return None  # not a local file: RangeReader's remote path
            fd_of[s] = fd
        kdots = _keys_with_dot(ko, keys, ids)
        ext_names = list(map(exts.__getitem__, mext[at].tolist()))
        heads, size_list = head.tolist(), sizes.tolist()
        tmpl = {"__url__": None, "__key__": None, "__index__": None, "__bucket__": batch.bucket,
                "__dataset__": batch.dataset, "__pad__": False, "__epoch__": batch.epoch,
                "__step__": batch.step, "__batch__": batch.index}
        pread = os.pread
        out: list[dict[str, Any]] = []
        append = out.append
        m = 0
        for s, o, nb, cnt, kd, i, p in zip(shard_ids, off.tolist(), ln.tolist(), counts.tolist(), kdots,
                                            ids.tolist(), batch.pad.tolist()):
            fd = fd_of[s]
            d = tmpl.copy()
            d["__url__"] = urls[s]
            d["__key__"] = kd[:-1].decode("utf-8")
            d["__index__"] = i
            d["__pad__"] = p
            if nb < BIG_SAMPLE:
                data = pread(fd, nb, o)
                if len(data) != nb:
                    return None
                if cnt == 2:  # the common shape (a payload and its .json), unrolled
                    h, h2 = heads[m], heads[m + 1]
                    if not (data.startswith(kd, h) and data.startswith(kd, h2)):
                        return None
                    d[ext_names[m]] = data[h + 512 : h + 512 + size_list[m]]
                    d[ext_names[m + 1]] = data[h2 + 512 : h2 + 512 + size_list[m + 1]]
                    m += 2
                    append(d)
                    continue
                for m in range(m, m + cnt):
                    h = heads[m]
                    if not data.startswith(kd, h):
                        return None
                    d[ext_names[m]] = data[h + 512 : h + 512 + size_list[m]]
            else:  # each payload its own pread: no copy out of a sample buffer
                if not pread(fd, 512, o).startswith(kd):
                    return None
                for m in range(m, m + cnt):
                    size = size_list[m]
                    payload = pread(fd, size, o + heads[m] + 512)
                    if len(payload) != size:
                        return None
                    d[ext_names[m]] = payload
            m += 1
            append(d)
        st = reader.stats
        st.ranges += n
        st.requests += n
        st.bytes += int(ln.sum())
        return out


class BatchCache:
    """Plan batches computed a chunk at a time (``Plan.batches``), for one stream."""

    def __init__(self, step: int = 1) -> None:
        self.step = step
        self._plan: Any = None
        self._batches: dict[int, Batch] = {}

    def get(self, plan: Any, j: int) -> Batch:
        if plan is not self._plan or j not in self._batches:
            chunked = getattr(plan, "batches", None)
            if chunked is None:  # a plan without chunked evaluation: one batch at a time
                return plan[j]  # type: ignore[no-any-return]
            self._plan = plan
            self._batches = {b.index: b for b in chunked(j, j + CHUNK * self.step, self.step)}
        return self._batches.pop(j)
