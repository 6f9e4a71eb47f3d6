"""ShardStream and ShardLoader: the shard-level path, resumable at a byte offset.

``ShardStream(index, seed=7)`` is a torch IterableDataset with webdataset's fluid
interface (``.decode()``, ``.to_tuple()``, ``.batched()``, ...). It yields what
``wds.WebDataset(index.urls, nodesplitter=split_by_node(...), shardshuffle=False)
.compose(equalize(index, splitter))`` yields, and can stop and resume anywhere.

Invariants:
- worker w of a rank streams :func:`wds_pad.core.local.shardsplit.worker_plan`'s shards in order, each
  read sequentially by the tar scanner in stream mode, then wraps cyclically until it
  has yielded the plan's target: same samples, order, keys and ``__pad__`` marks as the
  drop-in pipeline;
- a worker's position is (shard position in its plan, byte offset of its next sample,
  samples yielded); resuming opens that shard at that offset (a seek locally, a ranged
  read remotely), so no byte before it is read again;
- ``state_dict`` is exact: iterated in the main process, the stream records its
  position after each item leaves the last stage; under :class:`ShardLoader` each worker
  tags its items with its position and the main process records what it received, and
  resumes the DataLoader's round-robin at the worker that was next;
- ``load_state_dict`` verifies kind, topology, fingerprint (seed, shard list, order),
  worker count and the size of every shard a worker stands in, before changing anything.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Callable, Iterator, Mapping

from torch.utils.data import IterableDataset, get_worker_info
from webdataset.compat import FluidInterface
from webdataset.filters import default_collation_fn

from .collate import run_collation
from .loaderargs import check_loader_args, check_start_timeout
from .workers import START_TIMEOUT, shut_down, watched, worker_batches
from ..errors import ConfigError, StaleShardError, StateMismatchError
from ..index.codec import load_index
from ..index.record import Index
from ..core.policy import check_epoch
from ..index.shardfile import shard_info
from ..io.options import check_storage_options
from ..io.redact import redact
from ..core.collective import shared_seed
from .live import OpenIterators, refuse_resplitting
from ..core.local.shardsplit import WorkerPlan, worker_plan
from ..index.location import is_relative
from ..io.urls import canonical_url
from .shardread import ShardReader
from .shards import dealing_order, shard_counts
from ..state import fingerprint_of
from ..state.cursor import Cursor, ShardProgress, WorkerPosition
from ..state.shards import make_shard_state, restore_shards, shard_plan_fields
from ..core.topology import Topology

__all__ = ["ShardLoader", "ShardStream"]


class ShardStream(OpenIterators, IterableDataset, FluidInterface):  # type: ignore[misc]
    """This rank's shards as webdataset sample dicts, equalized across ranks, resumable.

    Args:
        index: an Index or index path of every sample of the shards.
        topology: default ``Topology.detect(group=group, cp_size=cp_size)``.
        seed: default ``shared_seed(None, group)`` (drawn on rank 0, broadcast).
        epoch: the epoch whose shard order to use; change it with ``set_epoch``.
        group: the torch.distributed group of the job.
        cp_size: ranks per data-parallel replica when detecting the topology.
        storage_options: fsspec options for remote shards (and a remote index).
        open_options: extra ``fs.open`` arguments (``block_size``, ``cache_type``).
        relocate: ``{old prefix: new prefix}`` for the shards of an index given as a
            path (``load_index(..., relocate=...)``). The shards are dealt and the state
            fingerprinted by their URLs as the index stores them, so a state saved
            before a move (or a relocation) resumes after it.

    With DataLoader workers, iterate it through :class:`ShardLoader`: a plain DataLoader
    works, but then only the workers know the position and ``state_dict`` cannot.
    """

    def __init__(self, index: Index | str, *, topology: Topology | None = None, seed: int | None = None,
                 epoch: int = 0, group: Any = None, cp_size: int = 1,
                 storage_options: Mapping[str, Any] | None = None,
                 open_options: Mapping[str, Any] | None = None,
                 relocate: Mapping[str, str] | None = None) -> None:
        super().__init__()
        check_storage_options(storage_options)
        if relocate and not isinstance(index, str):
            raise ConfigError("ShardStream(relocate=...) applies to an index given as a path; load an Index with "
                              "load_index(path, relocate=...) instead")
        ix = load_index(index, storage_options=storage_options, relocate=relocate) if isinstance(index, str) else index
        if not isinstance(ix, Index):
            raise ConfigError(f"ShardStream needs a wds_pad Index or index path, got {type(index).__name__}")
        self.counts = shard_counts(ix, "ShardStream")  # no Index kept: workers get a small pickle
        self.sizes = {s.url: (s.size, s.stamp) for s in ix.shards}
        self.exts = tuple(ix.exts)
        self.name = ix.path or ix.name
        self.topology = topology if topology is not None else Topology.detect(group=group, cp_size=cp_size)
        self.seed = shared_seed(seed, group)
        self.storage_options = dict(storage_options or {})
        self.open_options = dict(open_options or {})
        self.stages: list[Callable[[Any], Any]] = []
        self._cursor = Cursor(check_epoch(epoch))  # the epoch and each worker's place in its shards
        self._tag = False   # under ShardLoader: yield (worker, position, item)
        self._order = _dealing_order(ix)
        shards = [[u, s.size, s.stamp, s.samples] for u, s in zip(ix.stored_urls, ix.shards)]
        self._fields = shard_plan_fields(
            self.seed, shards, sum(self.counts.values()), int(self.topology.dp_size))
        self._fingerprint = fingerprint_of(self._fields)

    # -- the fluid interface and epochs ----------------------------------------------------
    def compose(self, *stages: Callable[[Any], Any]) -> "ShardStream":
        """A copy with ``stages`` appended (what ``.decode``, ``.map``, ``.batched`` call)."""
        result = copy.copy(self)
        result.stages = list(self.stages) + [s for s in stages if s is not None]
        return result

    def batched(self, batchsize: int, collation_fn: Callable[[list[Any]], Any] | None = default_collation_fn,
                partial: bool = True) -> "ShardStream":
        """Batches as webdataset's ``batched``, but handed on as soon as full (exact positions)."""
        if isinstance(batchsize, bool) or not isinstance(batchsize, int) or batchsize < 1:
            raise ConfigError(f"batched: batchsize must be an int >= 1, got {batchsize!r}")
        return self.compose(_Batcher(batchsize, collation_fn, partial))

    def shuffle(self, size: int, **kw: Any) -> "ShardStream":
        """Refused: a sample shuffle buffer cannot be saved, so resuming would lose its contents."""
        raise ConfigError(
            f"ShardStream.shuffle({size}): the samples held in a shuffle buffer are not in the "
            "saved state and would be skipped on resume. Shards are already shuffled per epoch "
            "by the seed; shuffle within a batch in a .map() stage if you need more")

    @property
    def epoch(self) -> int:
        return self._cursor.epoch

    @property
    def cursor(self) -> Cursor:
        """Where this stream is: its epoch, each worker's place in its shards, whether pinned."""
        return self._cursor

    def seek(self, cursor: Cursor) -> None:
        """Make the next iteration start at ``cursor`` (how a ShardLoader moves its stream).

        Nothing is verified here: a cursor comes from a verified state or from this
        stream's own cursor.
        """
        self._cursor = cursor

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its beginning on the next iteration.

        After ``load_state_dict``, ``set_epoch`` of the restored epoch keeps the restored
        position (so ``for e in range(s.epoch, n): s.set_epoch(e); ...`` resumes exactly);
        ``set_epoch`` of another epoch moves there, at its beginning.
        """
        epoch = check_epoch(epoch)
        if self._cursor.pinned and epoch == self._cursor.epoch:
            return
        self._cursor = Cursor(epoch)

    def plan(self, worker: int = 0, num_workers: int = 1) -> WorkerPlan:
        """What logical ``worker`` of this rank streams in the current epoch."""
        return worker_plan(self.counts, self.seed, self._cursor.epoch, self.topology, worker, num_workers,
                           order=self._order)

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The current position as a small JSON-safe dict (see docs/shards.md)."""
        return make_shard_state(self._cursor, self.topology, self._fingerprint, self._fields)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a saved position after verifying the whole state.

        Raises:
            StateError, TopologyMismatchError, StateMismatchError: the state is refused.
            StaleShardError: a shard a worker stands in changed since the state was saved.
            On any error the stream is left exactly as it was.
        """
        cursor = self._verify(state)
        self._refuse_while_open("ShardStream")
        self.seek(cursor)

    def _verify(self, state: Mapping[str, Any], num_workers: int | None = None) -> Cursor:
        """The pinned cursor ``state`` resumes at, after verifying it in full (and, with
        ``num_workers``, the worker count and every shard a worker stands in)."""
        cursor = restore_shards(state, topology=self.topology, fingerprint=self._fingerprint,
                                fields=self._fields)
        progress = cursor.shards
        if num_workers is not None:
            self._check_workers(progress, num_workers)
        epoch, n = cursor.epoch, len(progress.positions)
        for w, pos in enumerate(progress.positions):
            plan = worker_plan(self.counts, self.seed, epoch, self.topology, w, n, order=self._order)
            if pos.yielded > plan.target:
                raise StateMismatchError(f"worker {w} of the state yielded {pos.yielded} samples, more than "
                                         f"its {plan.target} in epoch {epoch}; the state is not of this stream")
            if pos.offset and pos.yielded < plan.target and not progress.done:
                self._check_shard(plan.shard_at(pos.shard)[0], pos.offset)
        return cursor

    def _check_workers(self, progress: ShardProgress, num_workers: int) -> None:
        n = len(progress.positions)
        if n and not progress.done and n != max(num_workers, 1):
            raise StateMismatchError(
                f"the state was saved mid-epoch with {n} worker position(s) (num_workers "
                f"{n if n > 1 else 0}), this loader has num_workers {num_workers}; each worker "
                "resumes its own shards, so resume with the saved num_workers")

    def _check_shard(self, url: str, offset: int) -> None:
        size, stamp = shard_info(url, self.storage_options)
        want = self.sizes[url]
        if (size, stamp) != want:
            raise StaleShardError(
                f"shard {redact(url)!r} changed since it was indexed (size {size}, stamp {stamp!r}; "
                f"indexed {want[0]}, {want[1]!r}); a worker would resume inside it at byte offset "
                f"{offset}. Restore the shard, or re-index and start the epoch afresh")

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        refuse_resplitting("ShardStream")
        if get_worker_info() is not None or self._tag:
            yield from self._iterate()
            return
        yield from self._counted(self._iterate())

    def _iterate(self) -> Iterator[Any]:
        info = get_worker_info()
        n, wid = (1, 0) if info is None else (info.num_workers, info.id)
        if info is None and not self._tag:
            progress = self._start()
            if progress is None:
                return  # restored at the end of the epoch: nothing is left of it
        else:
            progress = self._cursor.shards.rewound()
        self._check_workers(progress, n if info is not None else 0)
        # under ShardLoader torch worker i plays logical worker (i + next_worker) % n
        logical = (wid + (progress.next_worker if self._tag else 0)) % n
        start = progress.positions[logical] if progress.positions else WorkerPosition()
        live = [start]
        reader = ShardReader(self.counts, self.sizes, self.name, self.exts, self.storage_options, self.open_options)
        it: Any = reader.samples(self.plan(logical, n), start, live)
        for stage in self.stages:
            it = stage(it)
        track = info is None and not self._tag
        for item in it:
            if self._tag:
                pos = live[0]
                yield logical, (pos.shard, pos.offset, pos.yielded), item
                continue
            if track:
                self._cursor = self._cursor.with_shards(ShardProgress((live[0],), 0, False))
            yield item
        if track:
            self._cursor = self._cursor.with_shards(ShardProgress((live[0],), 0, True))

    def _start(self) -> ShardProgress | None:
        """Where an iteration in the main process starts, unpinning the cursor: None when a
        state restored at the end of its epoch pins it there (nothing is left of it)."""
        cursor = self._cursor
        self.seek(replace(cursor, pinned=False))
        return None if cursor.pinned and cursor.shards.done else cursor.shards.rewound()

    def _for_workers(self, progress: ShardProgress) -> ShardStream:
        """The copy ShardLoader's workers run: each yields (logical worker, its position,
        item), worker (i + progress.next_worker) % n from its position in ``progress``."""
        worker = copy.copy(self)
        worker._tag = True
        worker.seek(self._cursor.with_shards(progress))
        return worker


def _dealing_order(index: Index) -> list[str]:
    """The index's shard URLs in the order they are dealt: sorted by the URL the index
    stores (relative to its folder where it does so, else canonical), which a moved
    folder or a relocation leaves as it was; for an index that was not moved, the order
    of ``dealing_order`` (a common folder prefix does not change an order)."""
    urls = dealing_order(list(index.urls))  # refuses a shard listed twice
    stored = dict(zip(index.urls, index.stored_urls))
    relative = index.relative
    key = {u: stored[u] if relative and is_relative(stored[u]) else canonical_url(stored[u]) for u in urls}
    return sorted(urls, key=key.__getitem__)


class _Batcher:
    """webdataset's ``_batched`` without its look-ahead: a full batch leaves at once, so the
    source has given out exactly the samples the trainer received."""

    def __init__(self, size: int, collate: Callable[[list[Any]], Any] | None, partial: bool) -> None:
        self.size, self.collate, self.partial = size, collate, partial

    def __call__(self, src: Iterator[Any]) -> Iterator[Any]:
        batch: list[Any] = []
        for sample in src:
            batch.append(sample)
            if len(batch) == self.size:
                yield run_collation(self.collate, batch) if self.collate is not None else batch
                batch = []
        if batch and self.partial:
            yield run_collation(self.collate, batch) if self.collate is not None else batch



class ShardLoader:
    """A DataLoader over a :class:`ShardStream` whose ``state_dict()`` is exact with workers.

    Each worker tags its items with its position; the main process records the position
    of every item it hands out, and on resume restarts the workers there, the worker
    that was next in the round-robin first.

    Args:
        dataset: a ShardStream (with its stages).
        num_workers: DataLoader worker processes (0: iterate in the main process).
        worker_start_timeout: seconds a forked worker may take to start before it is taken
            for stuck in the fork and replaced (see :mod:`wds_pad.stream.workers`).
        **kwargs: passed to torch's DataLoader (pin_memory, prefetch_factor, ...);
            ``batch_size`` is None (batch with ``.batched()``), no ``persistent_workers``.
    """

    def __init__(self, dataset: ShardStream, num_workers: int = 0, *,
                 worker_start_timeout: float = START_TIMEOUT, **kwargs: Any) -> None:
        if not isinstance(dataset, ShardStream):
            raise ConfigError(f"ShardLoader wraps a ShardStream, got {type(dataset).__name__}")
        check_loader_args("ShardLoader", num_workers, kwargs, "batch with .batched(), and "
                          "workers must restart at each saved position")
        self.dataset, self.num_workers, self.kwargs = dataset, num_workers, kwargs
        self.worker_start_timeout = check_start_timeout("ShardLoader", worker_start_timeout)

    @property
    def epoch(self) -> int:
        return self.dataset.epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its beginning on the next iteration."""
        self.dataset.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """As :meth:`ShardStream.load_state_dict`, also refusing another worker count."""
        ds = self.dataset
        cursor = ds._verify(state, self.num_workers)
        ds._refuse_while_open("ShardLoader")
        ds.seek(cursor)

    def __iter__(self) -> Iterator[Any]:
        yield from self.dataset._counted(self._iterate())  # the stream counts its loader's iterators

    def _iterate(self) -> Iterator[Any]:
        ds, n = self.dataset, self.num_workers
        if n == 0:
            yield from ds
            return
        progress = ds._start()
        if progress is None:
            return  # restored at the end of the epoch: nothing is left of it
        ds._check_workers(progress, n)
        positions = list(progress.positions or [WorkerPosition()] * n)
        batches = worker_batches(ds._for_workers(progress), n, self.kwargs, owner="ShardLoader",
                                 start_timeout=self.worker_start_timeout)
        try:
            for logical, pos, item in watched(batches, "ShardLoader"):
                positions[logical] = WorkerPosition(*(int(v) for v in pos))
                ds.seek(ds.cursor.with_shards(ShardProgress(tuple(positions), (int(logical) + 1) % n, False)))
                yield item
        finally:  # an error or an early stop too: no worker outlives the loop
            shut_down(batches)
        ds.seek(ds.cursor.with_shards(ShardProgress(tuple(positions), 0, True)))
