"""Whole plan batches read from local shards through the index's member table.

The fast path of ``BucketedWebDataset``: a batch's references, member offsets and sizes
are computed in numpy from the index for a chunk of plan batches at once (no tar header
is parsed, no reference dict is built, and a batch of one sample pays no numpy fixed
cost of its own, memberwork.py); each sample is one ``os.pread`` (large ones: one per
member, straight into the payload's bytes) or, from the second stream of its shard in
this process, copied out of the shard's mapping (io/shardmaps.py: no system call, and
the shard's size checked before each batch; each payload, of a large sample too, is
copied straight out of it, once, after its header's name and size fields are checked);
each sample dict is a copy of one per-batch template.

Invariants:
- a batch read here is exactly what ``fetch`` gives for it: the same sample dicts, keys in
  the same order, members in archive order;
- it reads every sample the member table records, whatever headers lie before its
  payloads (the table holds each payload's offset from the sample's first byte), of
  local shards. A batch with a sample the table does not record (an index from before
  ``member_offset``, or without a table) or whose table does not cover its byte range
  goes to ``fetch``'s exact path (every header parsed); a batch with a short read, an
  ``OSError`` or our own error, or a header that does not say what the table says goes
  to ``fetch`` with its member table (``fallback_members``), which reads it again,
  checking every header, and raises (``StaleShardError`` naming what changed) or
  substitutes. Either way it counts in ``ReadStats.exact_batches`` / ``exact_samples``;
  any other exception is a bug and propagates;
- each member's header is checked against the table (``wds_pad.tar.names``): its name is
  the sample's key, a dot and the member's extension, its size field the recorded size;
  the common header form costs two ``bytes.startswith`` a member (for a batch read into
  one buffer, :meth:`BatchReader.read_packed`: two numpy comparisons a batch), any other
  form is read with the indexer's rules. Each shard is still checked against its indexed size
  and change stamp once per stream, when first opened (``RangeReader``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..core.planning.plan import Batch
from ..errors import WdsPadError
from ..index.record import Index
from ..io.ranges import RangeReader
from ..io import shardmaps
from ..tar.names import HEAD, SIZE, Members, key_list, name_token_rows, size_token_rows, slice_sample, slice_sample_at
from .memberwork import EXACT, Chunk, Work, tables
from .ring import Arena, allocate, reserve
from .mappedbatch import REFS, refer
from .transport import PackedBatch

__all__ = ["BatchReader", "BIG_SAMPLE", "member_refs", "seed_list"]

from ..io.readahead import BIG_SAMPLE  # read one payload per pread (no copy out of a range buffer)

class BatchReader:
    """Reads plan batches of local shards through the member table (see the module doc).

    Args:
        reader: the stream's RangeReader (its descriptors, shard check and stats); None for
            a reader that only prepares member work (:meth:`take`, :func:`member_refs`).
        names: the dataset names of the PlanSpec, parallel to ``indexes``.
        indexes: the PlanSpec's indexes.
    """

    def __init__(self, reader: RangeReader | None, names: tuple[str, ...], indexes: tuple[Index, ...],
                 arenas: dict[Any, Arena] | None = None) -> None:
        self.reader = reader  # type: ignore[assignment]
        self.by_name = {n: ix for n, ix in zip(names, indexes)}
        self._work: dict[tuple[int, int], Work] = {}
        # batch buffers, shared or not (ring.Arena); given: a kept worker's, across its iterations
        self._arenas: dict[Any, Arena] = {} if arenas is None else arenas
        self.run = 1  # batches sent at a time (transport.run_length): what a ring is sized for
        #: the Loader's shared flag (numpy): send batches of mapped shards by reference while
        #: ``REFS`` is 0 (stream/mappedbatch.py); None: always in the ring
        self.refs: np.ndarray | None = None
        #: after :meth:`read` returned None: the member table entries of that batch's
        #: samples (None: it has a sample the table does not record), for the exact path
        self.fallback_members: list[Members] | None = None

    def prepare(self, batches: list[Batch]) -> None:
        """Compute the member work of ``batches`` (a chunk of one plan) together: what a
        batch would pay alone in numpy's fixed costs is paid once for the chunk."""
        by_ds: dict[str, list[Batch]] = {}
        for b in batches:
            by_ds.setdefault(b.dataset, []).append(b)
        for name, group in by_ds.items():
            ix = self.by_name[name]
            if not ix.has_members:
                self._work.update(((b.epoch, b.index), EXACT) for b in group)
                continue
            self._prepare(ix, group)

    def _prepare(self, ix: Index, group: list[Batch]) -> None:
        urls, shard, offset, length, ko, keys, ms, mext, msize, exts = tables(ix)
        sizes_b = np.fromiter((b.samples.size for b in group), np.int64, len(group))
        ids = np.concatenate([b.samples for b in group]) if len(group) > 1 else group[0].samples
        n = ids.size
        if not n:
            empty = Chunk(*([] for _ in range(8)))  # type: ignore[arg-type]
            self._work.update(((b.epoch, b.index), (empty, 0, 0, 0, 0, 0)) for b in group)
            return
        ids = ids.astype(np.int64, copy=False)
        starts = ms[ids].astype(np.int64)
        counts = ms[ids + 1].astype(np.int64) - starts
        first = np.cumsum(counts) - counts
        total = int(counts.sum())
        at = np.repeat(starts - first, counts) + np.arange(total, dtype=np.int64)
        sizes = msize[at].astype(np.int64)
        moff = ix.member_offsets(at, counts)
        off, ln = offset[ids].astype(np.int64), length[ids].astype(np.int64)
        # a sample is covered when it records members and its last payload, padded, ends
        # where its byte range does (what the scan measured): else the exact path decides
        last = first + counts - 1
        has = counts > 0
        lastc = np.where(has, last, 0)
        covered = has & (moff[lastc] + ((sizes[lastc] + 511) & ~511) == ln) if total else has
        b_end = np.cumsum(sizes_b)
        b_start = b_end - sizes_b
        bad_c = np.concatenate([[0], np.cumsum(~covered)])
        bad = bad_c[b_end] - bad_c[b_start]
        ka, kb = ko[ids].astype(np.int64), ko[ids + 1].astype(np.int64)
        ext_ids = mext[at]
        rows, fits = name_token_rows(keys, ka, kb, counts, ext_ids, exts)
        srows = size_token_rows(sizes)
        ext_list = list(map(exts.__getitem__, ext_ids.tolist()))
        chunk = Chunk(list(map(urls.__getitem__, shard[ids].tolist())), off.tolist(), ln.tolist(), counts.tolist(),
                       key_list(ka, kb, keys), ids.tolist(), np.concatenate([b.pad for b in group]).tolist(),
                       ext_list, (ln, counts, moff - 512, sizes, rows, fits, srows))
        mc = np.concatenate([[0], np.cumsum(counts)])
        bc = np.concatenate([[0], np.cumsum(ln)])
        work = self._work
        for b, lo, hi, mlo, mhi, nb, nbad in zip(group, b_start.tolist(), b_end.tolist(), mc[b_start].tolist(),
                                                 mc[b_end].tolist(), (bc[b_end] - bc[b_start]).tolist(), bad.tolist()):
            work[(b.epoch, b.index)] = EXACT if nbad else (chunk, lo, hi, mlo, mhi, nb)

    def take(self, batch: Batch) -> Work | None:
        """The prepared member work of ``batch`` (prepared now if its chunk was not), or
        None: it has a sample the member table does not cover."""
        work = self._work.pop((batch.epoch, batch.index), None)
        if work is None:  # not prepared with its chunk (a plan without chunks)
            self.prepare([batch])
            work = self._work.pop((batch.epoch, batch.index))
        return None if work is EXACT else work

    def read(self, batch: Batch) -> list[dict[str, Any]] | None:
        """The sample dicts of ``batch``, or None: read it with ``fetch`` instead, handing it
        ``fallback_members`` (counted in ``ReadStats.exact_batches`` and ``exact_samples``:
        here when the table records its samples, else by ``fetch``, which parses them)."""
        return self._attempt(batch, self._read)

    def read_packed(self, batch: Batch, shared: bool) -> PackedBatch | None:
        """``batch`` read into one buffer (:class:`~wds_pad.stream.transport.PackedBatch`;
        ``shared``: in shared memory), or None as :meth:`read` (the same fallback)."""
        return self._attempt(batch, lambda b, w: self._read_packed(b, w, shared))

    def _attempt(self, batch: Batch, how: Any) -> Any:
        work = self.take(batch)
        self.fallback_members = None
        try:
            got = None if work is None else how(batch, work)
        except (OSError, WdsPadError):  # the exact path reads it again and says what is wrong
            got = None
        if got is None and work is not None:  # fetch reads it through the table, checking each
            self.fallback_members = member_refs(work)  # header, parsing none: counted here
            st = self.reader.stats
            st.exact_batches += 1
            st.exact_samples += work[2] - work[1]
        return got

    def _read_packed(self, batch: Batch, w: Work, shared: bool) -> PackedBatch | None:
        c, lo, hi, mlo, mhi, nbytes = w
        meta = (batch.bucket, batch.dataset, batch.epoch, batch.step, batch.index)
        if hi == lo:
            return PackedBatch(allocate(0, False)[0], None, 0, 0, -1, np.zeros((2, 0), np.int64), [], [], [], [],
                               [], [], meta)
        reader = self.reader
        reader._check_fork()
        refs = self.refs
        if refs is not None and not refs[REFS]:  # a worker's batch of mapped shards: by reference
            sent = refer(reader, w, meta, None if batch.pack is None else batch.pack.tolist(), seed_list(batch))
            if sent is not None:
                return sent
        lengths, counts = c.arrays[:2]
        ln = lengths[lo:hi]
        base = np.cumsum(ln) - ln
        bounds = None
        space = reserve(self._arenas.get(shared), shared, nbytes, self.run)
        self._arenas[shared] = space.arena
        try:
            bounds = self._fill(c, lo, hi, mlo, mhi, space.arr, base)
        finally:
            if bounds is None:  # read on the exact path: its space is free
                space.drop()
        if bounds is None:
            return None
        space.sent()
        st = reader.stats
        st.ranges += hi - lo
        st.requests += hi - lo
        st.bytes += nbytes
        return PackedBatch(space.buf, space.ring, space.start, nbytes, space.seq, bounds, c.exts[mlo:mhi], counts[lo:hi].tolist(),
                           c.keys[lo:hi], c.urls[lo:hi], c.ids[lo:hi], c.pads[lo:hi], meta,
                           None if batch.pack is None else batch.pack.tolist(), seed_list(batch), space.short)

    def _fill(self, c: Chunk, lo: int, hi: int, mlo: int, mhi: int, arr: np.ndarray,
              base: np.ndarray) -> np.ndarray | None:
        """Read samples [lo, hi) of chunk ``c`` into ``arr`` at ``base`` and check every
        member header in numpy; the members' payload bounds in ``arr``, or None: not local,
        or cut short. Raises StaleShardError as ``slice_sample``."""
        reader = self.reader
        fds, local_fd = reader._fds, reader.local_fd
        lengths, counts, heads, sizes, _, fits, _ = c.arrays
        ln = lengths[lo:hi]
        view = memoryview(arr)
        urls, offsets = c.urls[lo:hi], c.offsets[lo:hi]
        preadv, nbs, starts = os.preadv, c.lengths[lo:hi], base.tolist()
        views = reader.mapped_views(urls)
        if views is not None:  # each sample copied out of its shard's mapping: no system call
            waits = shardmaps.faults()
            try:
                for v, o, nb, b in zip(views, offsets, nbs, starts):
                    view[b:b + nb] = v[o:o + nb]
            except ValueError:  # a range past the mapped file's end: read it with pread
                return None
            shardmaps.waited(waits)
        elif None not in (open_fds := list(map(fds.get, urls))):  # every shard open: no open closes one
            iovs = [(view[b:b + nb],) for b, nb in zip(starts, nbs)]
            if list(map(preadv, open_fds, iovs, offsets)) != nbs:
                return None
        else:
            for url, o, nb, b in zip(urls, offsets, nbs, starts):
                fd = fds.get(url)  # looked up per sample: opening another shard may close an idle one
                if fd is None:
                    fd = local_fd(url)  # opens it: the stale-shard check, once per stream
                    if fd is None:
                        return None  # not a local file: RangeReader's remote path
                if preadv(fd, (view[b:b + nb],), o) != nb:
                    return None
        # every member's header against the table, in numpy: its name field, its size field
        cnt = counts[lo:hi]
        pos = np.repeat(base, cnt) + heads[mlo:mhi]
        want, cols = c.fields
        ok = (arr[pos[:, None] + cols] == want[mlo:mhi]).all(1)
        ok &= fits[mlo:mhi]
        if not ok.all():  # another header form, or a changed shard: read in full (raises)
            first = np.cumsum(cnt) - cnt
            for s in np.unique(np.repeat(np.arange(hi - lo), cnt)[~ok]).tolist():
                m, j = mlo + int(first[s]), mlo + int(first[s] + cnt[s])
                b, nb = int(base[s]), int(ln[s])
                slice_sample(arr[b:b + nb].tobytes(), urls[s], offsets[s], c.keys[lo + s],
                             (c.exts[m:j], c.heads[m:j], c.sizes[m:j], c.ntoks[m:j], c.stoks[m:j]))
        bounds = np.empty((2, pos.size), np.int64)
        np.add(pos, 512, out=bounds[0])
        np.add(bounds[0], sizes[mlo:mhi], out=bounds[1])
        return bounds

    def _read(self, batch: Batch, w: Work) -> list[dict[str, Any]] | None:
        c, lo, hi, mlo, mhi, nbytes = w
        if hi == lo:
            return []
        reader = self.reader
        reader._check_fork()
        fds, local_fd = reader._fds, reader.local_fd
        tmpl = {"__url__": None, "__key__": None, "__index__": None, "__bucket__": batch.bucket,
                "__dataset__": batch.dataset, "__pad__": False, "__epoch__": batch.epoch,
                "__step__": batch.step, "__batch__": batch.index}
        heads, size_list, ext_names = c.heads[mlo:mhi], c.sizes[mlo:mhi], c.exts[mlo:mhi]
        ntoks, stoks = c.ntoks[mlo:mhi], c.stoks[mlo:mhi]
        pread, size_at = os.pread, SIZE
        out: list[dict[str, Any]] = []
        append = out.append
        m = 0
        urls = c.urls[lo:hi]
        views = reader.mapped_views(urls)
        maps = [v.obj for v in views] if views is not None else [None] * (hi - lo)  # type: ignore[union-attr]
        waits = shardmaps.faults() if views is not None else 0
        for url, mm, o, nb, cnt, key, i, p, z in zip(urls, maps, c.offsets[lo:hi], c.lengths[lo:hi], c.counts[lo:hi],
                                                      c.keys[lo:hi], c.ids[lo:hi], c.pads[lo:hi], seed_list(batch)):
            fd = fds.get(url)  # looked up per sample: opening another shard may close an idle one
            if fd is None:
                fd = local_fd(url)  # opens it: the stale-shard check, once per stream
                if fd is None:
                    return None  # not a local file: RangeReader's remote path
            d = tmpl.copy()
            d["__url__"] = url
            d["__key__"] = key
            d["__index__"] = i
            d["__pad__"] = p
            d["__seed__"] = z
            if mm is not None:  # out of the mapping: each payload copied once, after its header's fields
                if o + nb > len(mm):
                    return None
                if cnt == 2:  # the common shape (a payload and its .json), unrolled
                    h, h2, n, n2 = o + heads[m], o + heads[m + 1], size_list[m], size_list[m + 1]
                    head, head2 = mm[h:h + HEAD], mm[h2:h2 + HEAD]  # a header's name and size fields
                    if (head.startswith(ntoks[m]) and head.startswith(stoks[m], size_at)
                            and head2.startswith(ntoks[m + 1]) and head2.startswith(stoks[m + 1], size_at)):
                        d[ext_names[m]] = mm[h + 512 : h + 512 + n]
                        d[ext_names[m + 1]] = mm[h2 + 512 : h2 + 512 + n2]
                        m += 2
                        append(d)
                        continue
                elif mapped_members(mm, o, d, ext_names, heads, size_list, ntoks, stoks, m, m + cnt):
                    m += cnt
                    append(d)
                    continue
                # another header form, or a changed shard: read as below (raises, naming what changed)
            if nb >= BIG_SAMPLE:  # each header and payload its own pread: no copy out of a buffer
                j = m + cnt
                members = (ext_names[m:j], heads[m:j], size_list[m:j], ntoks[m:j], stoks[m:j])
                d.update(slice_sample_at(fd, url, o, key, members))  # StaleShardError: read() hands it to fetch
                m = j
                append(d)
                continue
            data = pread(fd, nb, o) if mm is None else mm[o:o + nb]  # out of the mapping: no system call
            if len(data) != nb:
                return None
            at = data.startswith
            if cnt == 2:  # the common shape (a payload and its .json), unrolled
                h, h2, n, n2 = heads[m], heads[m + 1], size_list[m], size_list[m + 1]
                if not (at(ntoks[m], h) and at(stoks[m], h + size_at) and at(ntoks[m + 1], h2)
                        and at(stoks[m + 1], h2 + size_at)):
                    j = m + 2  # another header form, or a changed shard: read in full (raises)
                    d.update(slice_sample(data, url, o, key, (ext_names[m:j], heads[m:j], size_list[m:j],
                                                              ntoks[m:j], stoks[m:j])))
                else:
                    d[ext_names[m]] = data[h + 512 : h + 512 + n]
                    d[ext_names[m + 1]] = data[h2 + 512 : h2 + 512 + n2]
                m += 2
                append(d)
                continue
            j = m + cnt
            quick = True
            for x in range(m, j):
                h = heads[x]
                quick = quick and at(ntoks[x], h) and at(stoks[x], h + size_at)
                d[ext_names[x]] = data[h + 512 : h + 512 + size_list[x]]
            if not quick:  # as above
                slice_sample(data, url, o, key, (ext_names[m:j], heads[m:j], size_list[m:j], ntoks[m:j], stoks[m:j]))
            m = j
            append(d)
        if views is not None:
            shardmaps.waited(waits)
        st = reader.stats
        st.ranges += hi - lo
        st.requests += hi - lo
        st.bytes += nbytes
        return out


def mapped_members(mm: Any, o: int, d: dict[str, Any], exts: list[str], heads: list[int], sizes: list[int],
                   ntoks: list[bytes], stoks: list[bytes], m: int, j: int) -> bool:
    """Members ``m:j`` of the sample at ``o`` in the mapping ``mm`` put in ``d``, each
    payload copied out once, if every header's name and size fields say what the table
    says (else False, ``d`` left without them: the caller reads the sample in full)."""
    for x in range(m, j):
        head = mm[o + heads[x]:o + heads[x] + HEAD]
        if not (head.startswith(ntoks[x]) and head.startswith(stoks[x], SIZE)):
            return False
    for x in range(m, j):
        at = o + heads[x] + 512
        d[exts[x]] = mm[at:at + sizes[x]]
    return True


def member_refs(work: Work) -> list[Members]:
    """Per sample of a prepared batch, what slicing its bytes takes: its member table
    entry (``tar.names.Members``: its members' extensions, header offsets in the sample,
    payload sizes, name and size tokens; the ``__members__`` of a reference, see
    ``fetch``)."""
    c, lo, hi, m, _, _ = work
    out = []
    exts, heads, sizes, ntoks, stoks = c.exts, c.heads, c.sizes, c.ntoks, c.stoks
    for cnt in c.counts[lo:hi]:
        j = m + cnt
        out.append((exts[m:j], heads[m:j], sizes[m:j], ntoks[m:j], stoks[m:j]))
        m = j
    return out


def seed_list(batch: Batch) -> list[Any]:
    """``batch``'s ``__seed__`` per sample, as Python ints (core/sampleseed.py)."""
    return [None] * len(batch.samples) if batch.seeds is None else batch.seeds.tolist()
