"""The fetch stage: planned sample references in, webdataset sample dicts out.

``fetch()`` is the read side of ``wds.DataPipeline(PlannedSource(spec), fetch(),
wds.decode("pil"), plan_batched())``; the plan side (``PlannedSource``, ``PlanSpec``,
``plan_batched``) is in stages.py.

Invariants:
- each reference becomes an ordinary webdataset sample dict (``__key__``, ``__url__``,
  one entry per member extension, plus ``__bucket__``, ``__dataset__``, ``__pad__``,
  ``__epoch__``, ``__step__``), in reference order: one in, one out, never reordered;
- many byte ranges are read concurrently: remote ones as concurrent requests; local ones
  inline (large ones one payload per pread: read-ahead threads did not pay, so
  ``ReadOptions.local_threads`` is accepted and unused here);
- with the indexes at hand (``spec``), every shard is checked once per stream against
  the size and stamp it had when indexed; bytes that are not the indexed sample raise;
- a sample whose bytes fail to read or parse raises with URL, offset and key, unless a
  webdataset-style ``handler`` continues: then a deterministic substitute from the same
  bucket (derived from the seed and the failed sample) takes its place, so batch sizes
  never change, and it is counted in ``Counters``;
- the configured stage pickles without its reader (a DataLoader worker opens its own).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence


from ..errors import WdsPadError
from ..index.record import Index
from ..io.ranges import LocalReadAhead, RangeReader, ReadOptions
from ..core.seed import derive_rng
from ..tar.names import slice_sample, slice_sample_at
from ..tar.scan import parse_sample, parse_sample_at
from ..state.spec import PlanSpec

__all__ = ["Counters", "all_local", "fetch"]

from ..io.readahead import BIG_SAMPLE  # large local samples: read ahead by threads

META_KEYS = ("__key__", "__url__", "__bucket__", "__dataset__", "__pad__", "__epoch__", "__step__", "__seed__")


@dataclass
class Counters:
    """What the stream did that the plan did not say: substitutes for bad samples."""

    substituted: int = 0
    failures: list[str] = field(default_factory=list)

    def record(self, message: str) -> None:
        self.substituted += 1
        if len(self.failures) < 100:
            self.failures.append(message)


_SHARD_TABLES: weakref.WeakKeyDictionary[Index, dict[str, tuple[int, str]]] = weakref.WeakKeyDictionary()


class _IndexedShards(Mapping[str, tuple[int, str]]):
    """``url -> (size, stamp)`` of the indexes' shards, as RangeReader's ``expected``.

    Built on the first lookup (the first shard a stream opens) and kept per Index for
    the life of the process, so a stream pays for it once, not per sample or per epoch.
    """

    def __init__(self, indexes: Sequence[Index]) -> None:
        self.indexes = tuple(indexes)

    def _tables(self) -> list[dict[str, tuple[int, str]]]:
        tables = []
        for ix in self.indexes:
            table = _SHARD_TABLES.get(ix)
            if table is None:
                table = _SHARD_TABLES[ix] = {s.url: (s.size, s.stamp) for s in ix.shards
                                             if s.error is None and s.size >= 0}
            tables.append(table)
        return tables

    def __getitem__(self, url: str) -> tuple[int, str]:
        for table in self._tables():
            if url in table:
                return table[url]
        raise KeyError(url)

    def __iter__(self) -> Iterator[str]:
        return iter({url: None for table in self._tables() for url in table})

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _Fetch:
    """The configured fetch stage (picklable): reads and expands sample references."""

    def __init__(self, options: ReadOptions | None, handler: Callable[[BaseException], bool] | None,
                 spec: PlanSpec | None, counters: Counters | None) -> None:
        self.options = options
        self.handler = handler
        self.spec = spec
        self.counters = counters if counters is not None else Counters()
        self._reader: RangeReader | None = None
        self._local: dict[str, bool] = {}
        self._exact_batch: tuple[Any, Any] = (None, None)  # the last batch counted in exact_batches

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_reader": None, "_local": {}}

    @property
    def reader(self) -> RangeReader:
        if self._reader is None:
            # with the indexes at hand, every shard is checked against them once per stream
            expected = _IndexedShards(self.spec.indexes) if self.spec is not None else None
            self._reader = RangeReader(self.options, expected=expected)
        return self._reader

    def __call__(self, src: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        # Large local samples are parsed straight from the file (each payload its own
        # pread, no copy out of a bigger buffer), inline: read-ahead threads measured
        # 0.8x of inline here (ReadOptions.local_threads is accepted and no longer used);
        # runs of the others share one read_many.
        ahead: LocalReadAhead | None = None
        try:
            for big, group in itertools.groupby(src, key=self._is_big_local):
                if big:
                    if ahead is None:
                        ahead = LocalReadAhead(self.reader, 0)
                    yield from self._expand_big(ahead, group)
                else:
                    yield from self._expand_many(group)
        finally:
            if ahead is not None:
                ahead.close()

    def _is_big_local(self, ref: Mapping[str, Any]) -> bool:
        if ref["__length__"] < BIG_SAMPLE:
            return False
        url = ref["__url__"]
        local = self._local.get(url)
        if local is None:
            try:
                local = self._local[url] = self.reader.local_fd(url) is not None
            except WdsPadError:
                local = False  # let the ordinary path raise with the full context
        return local

    def _expand_big(self, ahead: LocalReadAhead, refs: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        items = ((ref["__url__"], ref["__offset__"], ref["__length__"], ref) for ref in refs)
        for ref, got, error in ahead.run(items, _expand_at):
            if error is None:
                sample, parsed = got
                if parsed:
                    self._count_exact(ref)
                yield sample
            elif isinstance(error, WdsPadError):
                yield self._substitute(ref, error)
            else:
                raise error

    def _expand_many(self, src: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        reader = self.reader
        refs = iter(src)
        pending: list[dict[str, Any]] = []

        def ranges() -> Iterator[tuple[str, int, int]]:
            for ref in refs:
                pending.append(ref)
                yield ref["__url__"], ref["__offset__"], ref["__length__"]

        data_iter = reader.read_many(ranges())
        position = 0
        while True:
            try:
                data = next(data_iter)
            except StopIteration:
                return
            except Exception as exc:  # a failed read: data_iter is finished now
                ref = pending[position]
                yield self._substitute(ref, exc)
                position += 1
                # restart reading after the failed range
                rest = pending[position:]
                del pending[:]
                data_iter = reader.read_many(_chain_ranges(rest, refs, pending))
                position = 0
                continue
            ref = pending[position]
            position += 1
            if position > 1024:  # keep the pending list short
                del pending[:position]
                position = 0
            try:
                sample, parsed = _expand(ref, data)
            except WdsPadError as exc:
                yield self._substitute(ref, exc)
                continue
            if parsed:
                self._count_exact(ref)
            yield sample

    def _count_exact(self, ref: Mapping[str, Any]) -> None:
        """A sample whose tar headers were parsed: counted, and its batch once."""
        st = self.reader.stats
        st.exact_samples += 1
        batch = (ref.get("__epoch__"), ref.get("__batch__"))
        if batch != self._exact_batch:
            self._exact_batch = batch
            st.exact_batches += 1

    def _substitute(self, ref: dict[str, Any], exc: BaseException) -> dict[str, Any]:
        message = (f"sample {ref['__key__']!r} of {ref['__url__']!r} at byte offset "
                   f"{ref['__offset__']}: {exc}")
        if self.handler is None or self.spec is None or not self.handler(exc):
            if isinstance(exc, WdsPadError) and ref["__key__"] in str(exc):
                raise exc
            raise type(exc)(message) if isinstance(exc, WdsPadError) else exc
        return substitute(self.spec, self.reader, ref, self.counters, message)


def _expand_at(fd: int, url: str, offset: int, length: int,
               ref: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``expand`` reading straight from the shard (on a read-ahead thread, or inline):
    each payload its own pread, found through the member table when the reference has
    it (each header checked against it, ``tar.names``). Returns the sample and whether
    its headers were parsed (the exact path)."""
    key = ref["__key__"]
    table = ref.get("__members__")
    if table is not None:
        return _sample(ref, slice_sample_at(fd, url, offset, key, table)), False
    return _sample(ref, parse_sample_at(fd, url, offset, length, key)), True


def _sample(ref: Mapping[str, Any], members: Mapping[str, bytes]) -> dict[str, Any]:
    """The sample dict of a reference and its payloads (the reference's own keys dropped)."""
    sample = dict(ref)  # a C-level copy: cheaper per sample than filtering in Python
    del sample["__offset__"], sample["__length__"]
    sample.pop("__members__", None)
    sample.update(members)
    return sample


def _chain_ranges(rest: list[dict[str, Any]], refs: Iterator[dict[str, Any]],
                  pending: list[dict[str, Any]]) -> Iterator[tuple[str, int, int]]:
    for ref in itertools.chain(rest, refs):
        pending.append(ref)
        yield ref["__url__"], ref["__offset__"], ref["__length__"]


def expand(ref: Mapping[str, Any], data: bytes) -> dict[str, Any]:
    """A webdataset sample dict from a reference and its bytes (StaleShardError if they differ).

    With ``__members__`` (the reference's member table entry) the payloads are sliced out
    of ``data`` where the table says, each header checked against it (``tar.names``:
    another name, extension or size is a ``StaleShardError`` naming it); without it,
    every tar header is parsed.
    """
    return _expand(ref, data)[0]


def _expand(ref: Mapping[str, Any], data: bytes) -> tuple[dict[str, Any], bool]:
    """:func:`expand`, and whether the headers were parsed (the exact path)."""
    table = ref.get("__members__")
    if table is not None:
        return _sample(ref, slice_sample(data, ref["__url__"], ref["__offset__"], ref["__key__"], table)), False
    return _sample(ref, parse_sample(data, ref["__url__"], ref["__offset__"], ref["__key__"])), True


def substitute(spec: PlanSpec, reader: RangeReader, ref: dict[str, Any], counters: Counters,
               message: str, attempts: int = 8) -> dict[str, Any]:
    """A deterministic stand-in from the same bucket for a sample that failed.

    The choice derives from (seed, epoch, dataset, bucket, failed sample id, attempt),
    so every run picks the same stand-in; it is marked ``__substitute_for__``.

    Raises:
        WdsPadError: every attempt failed too (the bucket is unreadable).
    """
    ds = spec.names.index(ref["__dataset__"])
    ix = spec.indexes[ds]
    bucket_id = ix.buckets.index(ref["__bucket__"])
    lo, hi = int(ix.bucket_offsets[bucket_id]), int(ix.bucket_offsets[bucket_id + 1])  # the bucket's rows
    last: BaseException | None = None
    for attempt in range(attempts):
        rng = derive_rng(spec.seed, ref["__epoch__"], ref["__dataset__"], ref["__bucket__"],
                         "substitute", ref["__index__"], attempt)
        i = lo + int(rng.integers(hi - lo))
        if i == ref["__index__"]:
            continue
        alt = dict(ref, __url__=ix.url(i), __key__=ix.key(i), __offset__=int(ix.offset[i]),
                   __length__=int(ix.length[i]), __index__=i)
        alt.pop("__members__", None)  # the failed sample's: the stand-in's headers are parsed
        try:
            sample = expand(alt, reader.read(alt["__url__"], alt["__offset__"], alt["__length__"]))
        except WdsPadError as exc:
            last = exc
            continue
        sample["__substitute_for__"] = ref["__key__"]
        counters.record(message)
        return sample
    raise WdsPadError(f"{message}; no readable substitute found in bucket {ref['__bucket__']!r} "
                      f"after {attempts} attempts (last: {last})")


def fetch(options: ReadOptions | None = None, *, handler: Callable[[BaseException], bool] | None = None,
          spec: PlanSpec | None = None, counters: Counters | None = None) -> _Fetch:
    """The fetch stage: sample references in, webdataset sample dicts out, in order.

    Args:
        options: how to read (concurrency, read-ahead bound, read-ahead threads for large
            local samples, retries, timeouts, storage options).
        handler: webdataset-style exception handler; if it returns True for a failure,
            a deterministic substitute from the same bucket replaces the sample (needs ``spec``).
        spec: the PlanSpec (for substitutes).
        counters: where substitutions are counted.
    """
    return _Fetch(options, handler, spec, counters)


_LOCAL: dict[str, bool] = {}


def all_local(spec: PlanSpec, reader: Any) -> bool:
    """Whether every shard of the spec's indexes is a local file (the batch-wise path)."""
    for ix in spec.indexes:
        for url in ix.urls:
            local = _LOCAL.get(url)
            if local is None:
                try:
                    local = _LOCAL[url] = reader.is_local(url)
                except Exception:  # noqa: BLE001 - the exact path reports it where it is read
                    return False
            if not local:
                return False
    return True
