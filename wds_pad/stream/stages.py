"""webdataset stages of the bucketed path: planned source, fetch, plan batching.

``wds.DataPipeline(PlannedSource(spec), fetch(), wds.decode("pil"), plan_batched())``
streams this rank's plan. Stages are generators over the stream (webdataset style),
configured by small picklable objects so they travel into DataLoader workers.

Invariants:
- ``PlannedSource`` yields this rank's planned sample references in exact plan order;
  with N DataLoader workers, worker w yields plan batches j with (j - start) mod N == w,
  so DataLoader's round-robin hands the trainer batches in plan order for any N;
- ``fetch`` turns each reference into an ordinary webdataset sample dict (``__key__``,
  ``__url__``, one entry per member extension, plus ``__bucket__``, ``__dataset__``,
  ``__pad__``, ``__epoch__``, ``__step__``), in reference order, reading many byte ranges
  concurrently: remote ones as concurrent requests, large local ones on read-ahead
  threads that live as long as the stream (``ReadOptions.local_threads``);
- a sample whose bytes fail to read or parse raises with URL, offset and key, unless a
  webdataset-style ``handler`` continues: then a deterministic substitute from the same
  bucket (derived from the seed) takes its place, so batch sizes never change;
- no randomness here: everything comes from the plan.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from ..errors import ConfigError, WdsPadError
from ..index.format import Index, load_index
from ..core.plan import MAX_EPOCH, Mode, PadTo, Plan, Policy, plan_epoch, resolve_policy
from ..io.read import LocalReadAhead, RangeReader, ReadOptions
from ..core.seed import derive_rng, stable_digest
from ..state.schema import fingerprint_of
from ..index.tarscan import parse_sample, parse_sample_at
from ..core.topology import Topology

__all__ = ["Counters", "PlanSpec", "PlannedSource", "Position", "fetch", "plan_batched"]

# Samples at least this large, in local files, skip the copy out of a range buffer.
BIG_SAMPLE = 256 * 1024

META_KEYS = ("__key__", "__url__", "__bucket__", "__dataset__", "__pad__", "__epoch__", "__step__")


@dataclass(frozen=True)
class Position:
    """Where a stream is: the next batch is ``plan(epoch)[index]``."""

    epoch: int = 0
    index: int = 0

    def __post_init__(self) -> None:
        for name in ("epoch", "index"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"Position.{name} must be an int >= 0, got {v!r}")
        if self.epoch > MAX_EPOCH:
            raise ConfigError(f"Position.epoch must be at most MAX_EPOCH={MAX_EPOCH}, got {self.epoch}")


@dataclass(frozen=True, eq=False)
class PlanSpec:
    """Everything the plan depends on, plus the indexes that resolve sample ids.

    Built once in the main process (seed already shared, topology detected) and pickled
    into DataLoader workers, where plans are recomputed identically.
    """

    indexes: tuple[Index, ...]
    names: tuple[str, ...]
    topology: Topology
    seed: int
    batch_size: int
    policy: Policy = Policy.AUTO
    mode: Mode = Mode.EPOCHS
    pad_to: PadTo = PadTo.BATCH
    oversubscribe: bool = False
    repeats: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    _cache: dict[int, Plan] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.indexes)
        if len(self.names) != n:
            raise ConfigError(f"PlanSpec: {len(self.names)} name(s) for {n} index(es); give one per index")
        # empty repeats/weights mean the defaults (0 repeats, weight 1) for every index:
        # zip() over an empty tuple would otherwise silently plan no dataset at all
        for name, default in (("repeats", 0), ("weights", 1.0)):
            values = getattr(self, name) or (default,) * n
            if len(values) != n:
                raise ConfigError(f"PlanSpec.{name} has {len(values)} value(s) for {n} index(es)")
            object.__setattr__(self, name, tuple(values))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"] = {}
        state["indexes"] = tuple(_IndexRef(ix) for ix in self.indexes)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["indexes"] = tuple(ref.get() if isinstance(ref, _IndexRef) else ref for ref in state["indexes"])
        self.__dict__.update(state)

    @property
    def resolved_policy(self) -> Policy:
        return resolve_policy(self.policy, self.mode, self.oversubscribe)

    def datasets(self) -> list[Any]:
        return [ix.to_dataset(name=n, repeats=r, weight=w)
                for ix, n, r, w in zip(self.indexes, self.names, self.repeats, self.weights)]

    def plan(self, epoch: int) -> Plan:
        """This rank's plan for ``epoch`` (cached: the last few epochs only)."""
        plan = self._cache.get(epoch)
        if plan is None:
            plan = plan_epoch(self.datasets(), self.topology, seed=self.seed, epoch=epoch,
                              batch_size=self.batch_size, policy=self.policy, mode=self.mode,
                              oversubscribe=self.oversubscribe, pad_to=self.pad_to,
                              warn=not self._cache)
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = plan
        return plan

    def fingerprint(self) -> str:
        """A digest of everything that shapes the plan but this rank's own place in it:
        :meth:`fingerprint_fields` (so the data-parallel layout is covered; the rank is
        checked through the topology saved beside it). Equal on every rank of a job."""
        return fingerprint_of(self.fingerprint_fields())

    def legacy_fingerprint(self) -> str:
        """The fingerprint as state version 1 computed it (no data-parallel layout)."""
        parts: list[Any] = ["wds_pad.plan/1", stable_digest(self.seed).hex(), self.batch_size,
                            self.resolved_policy.value, self.pad_to.value, self.oversubscribe]
        for ix, n, r, w in zip(self.indexes, self.names, self.repeats, self.weights):
            parts.append((n, ix.digest, r, float(w)))
        return stable_digest(*[tuple(p) if isinstance(p, list) else p for p in parts], size=16).hex()

    def fingerprint_fields(self) -> dict[str, Any]:
        """The fingerprint's ingredients, JSON-safe (saved in a state as ``plan``)."""
        return {
            "seed_hash": stable_digest(self.seed, size=8).hex(),
            "batch_size": self.batch_size,
            "policy": self.resolved_policy.value,
            "mode": self.mode.value,
            "pad_to": self.pad_to.value,
            "dp_size": int(self.topology.dp_size),
            "pad_unit": int(self.topology.dp_size) * (self.batch_size if self.pad_to is PadTo.BATCH else 1),
            "oversubscribe": self.oversubscribe,
            "datasets": [{"name": n, "index_digest": ix.digest, "repeats": r, "weight": float(w)}
                         for ix, n, r, w in zip(self.indexes, self.names, self.repeats, self.weights)],
        }


class _IndexRef:
    """Pickles an Index loaded from a local file as its path (workers re-map the pages)."""

    def __init__(self, index: Index) -> None:
        local = index.path is not None and "://" not in index.path
        self.path = index.path if local else None
        self.digest = index.digest
        self.index = None if local else index

    def get(self) -> Index:
        if self.index is not None:
            return self.index
        index = load_index(self.path, verify=False)  # type: ignore[arg-type]
        if index.digest != self.digest:
            raise WdsPadError(f"index {self.path!r} changed while the job was running; restart the job")
        return index


@dataclass
class Counters:
    """What the stream did that the plan did not say: substitutes for bad samples."""

    substituted: int = 0
    failures: list[str] = field(default_factory=list)

    def record(self, message: str) -> None:
        self.substituted += 1
        if len(self.failures) < 100:
            self.failures.append(message)


class PlannedSource:
    """Source stage: this rank's planned sample references, for this DataLoader worker.

    Each reference is a dict with ``__url__``, ``__key__``, ``__bucket__``,
    ``__dataset__``, ``__pad__``, ``__epoch__``, ``__step__``, ``__batch__`` (index in
    the rank's plan), ``__index__`` (sample id), ``__offset__`` and ``__length__``.

    Args:
        spec: the PlanSpec.
        start: where to begin (a resume position); epochs mode stops at the end of
            ``start.epoch``, steps mode runs on across epochs.
        worker: (worker_id, num_workers); default: from torch's get_worker_info().
    """

    def __init__(self, spec: PlanSpec, start: Position | None = None,
                 worker: tuple[int, int] | None = None) -> None:
        self.spec = spec
        self.start = start or Position()
        self.worker = worker

    def _worker(self) -> tuple[int, int]:
        if self.worker is not None:
            return self.worker
        try:
            from torch.utils.data import get_worker_info
        except ImportError:  # pragma: no cover
            return 0, 1
        info = get_worker_info()
        return (0, 1) if info is None else (info.id, info.num_workers)

    def epoch_batches(self, epoch: int) -> tuple[Plan, Sequence[int]]:
        """The plan of ``epoch`` and the indices of its batches this stream walks.

        The whole plan here; a resumed elastic epoch walks a subset (see dataset.py).
        """
        plan = self.spec.plan(epoch)
        return plan, range(len(plan))

    def batches(self) -> Iterator[tuple[Plan, int]]:
        """(plan, batch index) of every batch this worker produces, in plan order."""
        wid, nw = self._worker()
        epoch, first = self.start.epoch, self.start.index
        counter = 0
        while True:
            plan, walk = self.epoch_batches(epoch)
            if first > len(walk):
                raise ConfigError(f"resume position {first} is past the end of epoch {epoch} "
                                  f"({len(walk)} batches on this rank)")
            for k in range(first, len(walk)):
                if counter % nw == wid:
                    yield plan, int(walk[k])
                counter += 1
            if self.spec.mode is not Mode.STEPS:
                return
            if len(plan) == 0 and first == 0:
                raise ConfigError("steps mode has nothing to stream: every bucket was dropped; "
                                  "lower batch_size or pass oversubscribe=True")
            epoch, first = epoch + 1, 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        spec = self.spec
        for plan, j in self.batches():
            yield from batch_refs(spec, plan, j)

    def __call__(self) -> Iterator[dict[str, Any]]:
        return iter(self)


def batch_refs(spec: PlanSpec, plan: Plan, j: int) -> list[dict[str, Any]]:
    """The sample references of batch ``j`` of ``plan``."""
    batch = plan[j]
    ds = plan.datasets.index(batch.dataset)
    ix = spec.indexes[ds]
    ids = batch.samples
    shards, offsets, lengths = ix.shard[ids], ix.offset[ids], ix.length[ids]
    urls = ix.urls
    return [
        {"__url__": urls[s], "__key__": k, "__offset__": o, "__length__": n,
         "__index__": i, "__bucket__": batch.bucket, "__dataset__": batch.dataset, "__pad__": p,
         "__epoch__": batch.epoch, "__step__": batch.step, "__batch__": j}
        for i, k, s, o, n, p in zip(ids.tolist(), _keys(ix, ids), shards.tolist(), offsets.tolist(),
                                    lengths.tolist(), batch.pad.tolist())
    ]


def _keys(ix: Index, ids: np.ndarray) -> list[str]:
    """``[ix.key(i) for i in ids]`` with one gather per batch instead of numpy calls per sample."""
    ko = ix.arrays["key_offsets"]
    table = memoryview(ix.arrays["keys"])
    return [str(table[a:b], "utf-8") for a, b in zip(ko[ids].tolist(), ko[ids + 1].tolist())]


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
        # pread, no copy out of a bigger buffer) by read-ahead threads, so the kernel's
        # copy of the next ones overlaps the Python work on this one; runs of the others
        # share one read_many. The threads live as long as this stream.
        ahead: LocalReadAhead | None = None
        try:
            for big, group in itertools.groupby(src, key=self._is_big_local):
                if big:
                    if ahead is None:
                        ahead = self.reader.local_read_ahead()
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
        for ref, sample, error in ahead.run(items, _expand_at):
            if error is None:
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
                yield expand(ref, data)
            except WdsPadError as exc:
                yield self._substitute(ref, exc)

    def _substitute(self, ref: dict[str, Any], exc: BaseException) -> dict[str, Any]:
        message = (f"sample {ref['__key__']!r} of {ref['__url__']!r} at byte offset "
                   f"{ref['__offset__']}: {exc}")
        if self.handler is None or self.spec is None or not self.handler(exc):
            if isinstance(exc, WdsPadError) and ref["__key__"] in str(exc):
                raise exc
            raise type(exc)(message) if isinstance(exc, WdsPadError) else exc
        return substitute(self.spec, self.reader, ref, self.counters, message)


def _expand_at(fd: int, url: str, offset: int, length: int, ref: dict[str, Any]) -> dict[str, Any]:
    """``expand`` reading straight from the shard (on a read-ahead thread, or inline)."""
    members = parse_sample_at(fd, url, offset, length, ref["__key__"])
    sample = dict(ref)
    del sample["__offset__"], sample["__length__"]
    sample.update(members)
    return sample


def _chain_ranges(rest: list[dict[str, Any]], refs: Iterator[dict[str, Any]],
                  pending: list[dict[str, Any]]) -> Iterator[tuple[str, int, int]]:
    for ref in itertools.chain(rest, refs):
        pending.append(ref)
        yield ref["__url__"], ref["__offset__"], ref["__length__"]


def expand(ref: Mapping[str, Any], data: bytes) -> dict[str, Any]:
    """A webdataset sample dict from a reference and its bytes (StaleShardError if they differ)."""
    members = parse_sample(data, ref["__url__"], ref["__offset__"], ref["__key__"])
    sample = dict(ref)  # a C-level copy: cheaper per sample than filtering in Python
    del sample["__offset__"], sample["__length__"]
    sample.update(members)
    return sample


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
    candidates = np.flatnonzero(ix.bucket == bucket_id)
    last: BaseException | None = None
    for attempt in range(attempts):
        rng = derive_rng(spec.seed, ref["__epoch__"], ref["__dataset__"], ref["__bucket__"],
                         "substitute", ref["__index__"], attempt)
        i = int(candidates[int(rng.integers(candidates.size))])
        if i == ref["__index__"]:
            continue
        alt = dict(ref, __url__=ix.url(i), __key__=ix.key(i), __offset__=int(ix.offset[i]),
                   __length__=int(ix.length[i]), __index__=i)
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


def plan_batched(collation_fn: Callable[[list[Any]], Any] | None = None) -> Callable[[Iterable[dict[str, Any]]], Iterator[Any]]:
    """Stage grouping samples into the plan's batches (by ``__epoch__``/``__batch__``).

    Place it before stages that drop the ``__`` keys (e.g. ``to_tuple``), or use
    ``BucketedWebDataset``, which applies per-sample transforms inside each batch.
    """
    return _PlanBatched(collation_fn)


class _PlanBatched:
    def __init__(self, collation_fn: Callable[[list[Any]], Any] | None) -> None:
        self.collation_fn = collation_fn

    def __call__(self, src: Iterable[dict[str, Any]]) -> Iterator[Any]:
        for _, group in itertools.groupby(src, key=lambda s: (s["__epoch__"], s["__batch__"])):
            batch = list(group)
            yield self.collation_fn(batch) if self.collation_fn is not None else batch

