"""BucketedWebDataset: this rank's planned batches as a torch IterableDataset.

Invariants:
- batches follow this rank's plan exactly: never mixing buckets or datasets, per-sample
  transforms applied inside each batch so a batch is always exactly the plan's batch
  (a transform must map one sample to one);
- what a batch is depends on the samples and ``collation_fn`` only, never on whether
  transforms ran (collate.py: a list of sample dicts, columns for tuple samples);
- with N DataLoader workers the trainer receives batches in plan order (worker w makes
  batches j with (j - start) mod N == w);
- ``state_dict()`` is exact when iterated in the main process (num_workers=0); inside a
  worker it is that worker's own next batch (loader.py's ``Loader`` counts what the
  trainer received, for any num_workers);
- ``load_state_dict()`` verifies the whole state first; on refusal nothing changes; it is
  refused while an iterator of the same dataset or loader is open in this process
  (``_live`` counts both; that iterator would go on from its own position and undo the
  restored one);
- after a restore, ``set_epoch`` of the restored epoch keeps the restored position (the
  documented loops call it at the top of every epoch); ``set_epoch`` of another epoch
  moves to that epoch's start;
- resuming is a seek into the plan: no earlier sample is read again;
- the configured dataset pickles into DataLoader workers (with no open iterator).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Callable, Iterator, Mapping, Sequence

from torch.utils.data import IterableDataset, get_worker_info
from webdataset.compat import FluidInterface
from webdataset.filters import default_collation_fn

from ..errors import ConfigError, WdsPadError
from ..index.codec import load_index
from ..index.record import Index
from ..core.budgets.budget import Budget
from ..core.sizing import Count, as_sizing
from ..core.local.locality import Locality
from ..core.policy import Mode, PadTo, Policy, check_epoch, check_flag, parse_enum
from ..io.options import ReadOptions, ReadStats, stream_options
from .stats import Clock, StreamStats
from ..core.collective import shared_seed
from .agreement import check_agreement
from .batches import BatchMaker
from .fetch import Counters, fetch
from .live import OpenIterators, refuse_resplitting
from .loaderargs import check_callables
from .stages import PlannedSource
from .wholeshards import join_node_folder
from .transport import packs
from ..state import Cursor, PlanSpec, epoch_length, make_state, restore
from ..state.spec import per_index
from ..core.topology import Topology

__all__ = ["BucketedWebDataset"]


def _unmoved(done: tuple[int, int]) -> None:
    """A Loader's worker keeps no position: the Loader counts what the trainer received,
    and the worker's batches are dealt in runs (transport.run_length)."""


class BucketedWebDataset(OpenIterators, IterableDataset, FluidInterface):  # type: ignore[misc]
    """A torch IterableDataset yielding this rank's planned batches.

    Args:
        index: an Index or index path, or a list of them (one dataset each).
        batch_size: samples per batch per data-parallel rank, or a ``wds_pad.Budget``:
            batches sized by the samples' costs (an index built with ``--cost``;
            docs/planning.md, "Budgets"), or a ``wds_pad.Pack``: batches of packs of at
            most ``seq_len`` tokens, each sample carrying ``__pack__`` (docs/packing.md).
        topology: default ``Topology.detect(group=group, cp_size=cp_size)``.
        seed: default ``shared_seed(None, group)`` (drawn on rank 0, broadcast).
        epoch: the epoch to start with (epochs mode: change with ``set_epoch``).
        pad: ``auto`` | ``cyclic`` | ``drop`` | ``none``.
        mode: ``epochs`` (one epoch per iteration) | ``steps`` (endless).
        oversubscribe: keep buckets smaller than one global step, filled cyclically.
        pad_to: ``batch`` | ``rank``.
        repeats, weights, names: per index (or one value for all).
        read_options: concurrency, read-ahead bound, read-ahead threads for large local
            samples (``local_threads``), retries, timeouts.
        storage_options: fsspec options for remote shards (merged into read_options).
        handler: webdataset-style handler; if it returns True for a failed sample, a
            deterministic substitute from the same bucket takes its place.
        collation_fn: what a batch is made of its list of samples (default
            ``collate_batch``: a list of sample dicts whatever the transforms, a tuple of
            columns for tuple samples such as ``.to_tuple`` makes; docs/streaming.md).
        check_agreement: compare plan fingerprint and batch count across ranks (one
            small collective) before the first batch.
        group: the torch.distributed group of the job.
        cp_size: ranks per data-parallel replica when detecting the topology.
        locality: ``none`` (each bucket shuffled over all shards: one ranged read per
            sample) or ``shard`` (each rank reads its own shards whole, through a window
            of ``window`` shards; docs/object-storage.md).
        window: shards a rank visits at once with ``locality="shard"``.
        relocate: ``{old prefix: new prefix}`` for the shards of indexes given as paths
            (``load_index(..., relocate=...)``): shards moved since they were indexed.
            It travels into DataLoader workers and leaves the plan's fingerprint as it
            was, so a state saved before the move resumes after it.
        accumulation_steps: micro-batches per optimizer step (gradient accumulation): every
            rank's epoch is a multiple of this many batches, and each run of them reads
            one bucket.
        proportions, mix_by, epoch_size: each index's share of an epoch, counted in ``samples``
            or in ``cost``, and the epoch's size (``plan_epoch``; core/planning/proportion.py).
        zero_copy: members are read-only ``memoryview``s over the batch's buffer instead of
            ``bytes`` (docs/streaming.md, "Zero-copy members"); per-sample stages in
            DataLoader workers still see ``bytes`` (a view cannot cross processes).
    """

    def __init__(
        self,
        index: Index | str | Sequence[Index | str],
        *,
        batch_size: int | Budget,
        topology: Topology | None = None,
        seed: int | None = None,
        epoch: int = 0,
        pad: Policy | str = "auto",
        mode: Mode | str = "epochs",
        oversubscribe: bool = False,
        pad_to: PadTo | str = "batch",
        repeats: int | Sequence[int] = 0,
        weights: float | Sequence[float] = 1.0,
        names: Sequence[str] | None = None,
        read_options: ReadOptions | None = None,
        storage_options: Mapping[str, Any] | None = None,
        handler: Callable[[BaseException], bool] | None = None,
        collation_fn: Callable[[list[Any]], Any] | None = None,
        check_agreement: bool = True,
        group: Any = None,
        cp_size: int = 1,
        locality: str = "none",
        window: int = 8,
        relocate: Mapping[str, str] | None = None,
        accumulation_steps: int = 1,
        zero_copy: bool = False,
        proportions: Sequence[float] | None = None,
        mix_by: str = "samples",
        epoch_size: float | None = None,
    ) -> None:
        super().__init__()
        read_options = stream_options(read_options, storage_options)  # before an index is loaded with them
        check_callables("BucketedWebDataset", {"handler": handler, "collation_fn": collation_fn})
        items = list(index) if isinstance(index, (list, tuple)) else [index]
        if not items:
            raise ConfigError("BucketedWebDataset needs at least one index")
        if relocate and not all(isinstance(i, str) for i in items):
            raise ConfigError("BucketedWebDataset(relocate=...) applies to indexes given as paths; load an Index "
                              "with load_index(path, relocate=...) instead")
        indexes = tuple(load_index(i, storage_options=storage_options, relocate=relocate) if isinstance(i, str)
                        else i for i in items)
        for ix in indexes:
            if not isinstance(ix, Index):
                raise ConfigError(f"index must be a wds_pad Index or a path, got {type(ix).__name__}")
        n = len(indexes)
        names = tuple(names) if names is not None else tuple(
            ix.name if [j.name for j in indexes].count(ix.name) == 1 else f"{ix.name}#{k}"
            for k, ix in enumerate(indexes))
        if len(names) != n:
            raise ConfigError(f"names has {len(names)} values for {n} index(es)")
        self.zero_copy = check_flag("zero_copy", zero_copy)
        self.check_agreement = check_flag("check_agreement", check_agreement)
        # detected: a Loader refuses it if the job's process group turns out bigger (built too early)
        self._detected_topology = topology is None
        if topology is None:
            topology = Topology.detect(group=group, cp_size=cp_size)
        self.spec = PlanSpec(
            indexes=indexes, names=names, topology=topology, seed=shared_seed(seed, group),
            batch_size=batch_size, policy=parse_enum(Policy, pad, "padding policy"),
            mode=parse_enum(Mode, mode, "mode"), pad_to=parse_enum(PadTo, pad_to, "pad_to"),
            oversubscribe=check_flag("oversubscribe", oversubscribe), repeats=per_index(repeats, n, "repeats", int),
            weights=per_index(weights, n, "weights", float),
            locality=parse_enum(Locality, locality, "locality"), window=window,
            accumulation_steps=accumulation_steps, mix_by=mix_by,
            proportions=per_index(proportions, n, "proportions", float, optional=True),
            epoch_size=epoch_size,
        )
        epoch = check_epoch(epoch)
        self.spec.plan(epoch)  # validates every argument now, in the main process
        self.read_options = read_options
        join_node_folder(self.spec, read_options)  # a default shard folder lives as long as the job
        self.handler = handler
        self._pack = False  # in DataLoader workers: send batches packed (``packed()``)
        self._starts: Any = None  # kept workers: each iteration's start; their rings (``packed()``)
        self._arenas: dict[bool, Any] | None = None
        self._refs: Any = None  # the shared flag of batches sent by reference (``packed()``)
        self.collation_fn = collation_fn
        self.group = group
        self.stages: list[Callable[[Any], Any]] = []
        self.counters = Counters()
        self._read_stats: ReadStats | None = None
        self._clock = Clock()  # where data time goes (stats.py)
        self._cursor = Cursor(epoch)  # where the next iteration starts (state/cursor.py)
        self._agreed: set[int] = set()

    # -- the fluid interface -----------------------------------------------------------
    def compose(self, *stages: Callable[[Any], Any]) -> "BucketedWebDataset":
        """A copy with per-sample ``stages`` appended (``.decode``, ``.map``, ``.to_tuple`` ...)."""
        result = copy.copy(self)
        result.stages = list(self.stages) + [s for s in stages if s is not None]
        return result

    def batched(self, batchsize: int | None = None, collation_fn: Callable[[list[Any]], Any] | None = default_collation_fn,
                partial: bool = True) -> "BucketedWebDataset":
        """Set how plan batches are collated; their size is the plan's ``batch_size``.

        The default, as in webdataset, collates samples into columns (dict samples into
        one dict): every sample of a batch must then have the same members, or a
        ``ConfigError`` names the one that differs (see docs/streaming.md, "What a batch is").
        """
        sizing = as_sizing(self.spec.batch_size)
        if batchsize is not None and sizing != Count(batchsize):
            raise ConfigError(f"batched({batchsize}): batches follow the plan's {sizing.summary()}; "
                              "call batched() without a size")
        check_callables("batched", {"collation_fn": collation_fn})
        result = copy.copy(self)
        # an explicit None means "a plain list", as in webdataset's batched(); only the
        # constructor's default None turns into default collation once transforms exist
        result.collation_fn = list if collation_fn is None else collation_fn
        return result

    def packed(self, starts: Any = None, refs: Any = None) -> "BucketedWebDataset":
        """A copy whose DataLoader workers send batches packed in shared memory, for a
        consumer that unpacks them (``Loader``; stream/transport.py). ``starts``: a shared
        int64 tensor ``[epoch, index]`` set before each iteration of workers the consumer
        keeps (``persistent_workers``): a worker's iterations start there and reuse its
        ring. ``refs``: the shared flag of batches sent by reference (stream/mappedbatch.py)."""
        result = copy.copy(self)
        result._pack, result._starts, result._refs = True, starts, refs
        result._arenas = {} if starts is not None else None
        return result

    # -- epochs and state ----------------------------------------------------------------
    @property
    def topology(self) -> Topology:
        return self.spec.topology

    @property
    def seed(self) -> int:
        return self.spec.seed

    @property
    def read_stats(self) -> ReadStats | None:
        """Counters of the reader of the latest iteration in this process (requests, bytes,
        retries, peak in flight); None before the first iteration. With DataLoader
        workers each worker has its own reader, not visible here."""
        return self._read_stats

    def stats(self) -> StreamStats:
        """Where this rank's data time went so far: wait, GETs, bytes, cache hits and
        seconds per stage, its DataLoader workers' summed in (docs/streaming.md,
        "Where data time goes")."""
        return self._clock.stats(self.spec.topology.rank)

    @property
    def epoch(self) -> int:
        return self._cursor.epoch

    @property
    def cursor(self) -> Cursor:
        """Where this dataset is in its plan: the next batch, the elastic view of a resumed
        epoch, the DataLoader worker the position belongs to, whether it is pinned."""
        return self._cursor

    def seek(self, cursor: Cursor) -> None:
        """Make the next iteration start at ``cursor`` (how a Loader moves its dataset).

        Nothing is verified here: a cursor comes from :func:`wds_pad.state.restore` (a
        verified state) or from this dataset's own cursor.
        """
        self._cursor = cursor

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its first batch on the next iteration.

        After ``load_state_dict``, and until the next iteration starts, ``set_epoch`` of
        the restored epoch keeps the restored position, so a loop that calls it at the
        top of every epoch resumes exactly; ``set_epoch`` of another epoch moves to that
        epoch's first batch (the restored position is given up, deliberately).

        Raises:
            ConfigError: ``epoch`` is not an int in [0, MAX_EPOCH].
        """
        epoch = check_epoch(epoch)
        if self._cursor.pinned and epoch == self._cursor.epoch:
            return
        self._cursor = Cursor(epoch)

    def plan(self, epoch: int | None = None) -> Any:
        """This rank's Plan for ``epoch`` (default: the current one)."""
        return self.spec.plan(self.epoch if epoch is None else epoch)

    def __len__(self) -> int:
        """Batches in the current epoch on this rank (epochs mode; after an elastic
        resume, the batches left in the resumed epoch)."""
        return self._cursor.length(self.spec)

    def state_dict(self) -> dict[str, Any]:
        """The current position as a small JSON-safe dict (see docs/resume.md).

        Exact when iterated in the main process. Inside a DataLoader worker (torchdata's
        StatefulDataLoader asks each worker) it is that worker's own next batch, marked
        with ``worker``; use :class:`Loader` to get one exact state from the main process.
        """
        return make_state(self.spec, self._cursor)

    def load_state_dict(self, state: Mapping[str, Any], *, allow_elastic: bool = False) -> None:
        """Resume at a saved position after verifying the whole state.

        Args:
            state: a dict returned by ``state_dict()`` (of this dataset or its Loader).
            allow_elastic: resume on another number of DP ranks: the rest of the saved
                epoch, planned on this layout (docs/resume.md, "Elastic resume").

        Raises:
            StateError, TopologyMismatchError, StateMismatchError: the state is refused;
                the dataset is left exactly as it was.
        """
        info = get_worker_info()
        worker = None if info is None else (info.id, info.num_workers)
        cursor = restore(self.spec, state, allow_elastic=allow_elastic, worker=worker)
        self._refuse_while_open("BucketedWebDataset")
        self.seek(cursor)  # pinned: even at a finished epoch, resuming there yields nothing, not a rerun

    # -- iteration -------------------------------------------------------------------------
    def agree(self) -> None:
        """Run the cross-rank agreement check for the current epoch (once per epoch)."""
        if self.check_agreement and self.epoch not in self._agreed:
            check_agreement(self.spec, self._cursor, self.group)
            self._agreed.add(self.epoch)

    def __iter__(self) -> Iterator[Any]:
        refuse_resplitting("BucketedWebDataset")
        if get_worker_info() is not None:
            yield from self._iterate()
            return
        self.agree()
        # in one process the loop's wait is the time batches take to make: one timing for both
        yield from self._counted(self._clock.waited(self._iterate(), making=True))

    def _iterate(self) -> Iterator[Any]:
        source = self._source()
        fetcher = fetch(self.read_options, handler=self.handler, spec=self.spec, counters=self.counters)
        self._read_stats = fetcher.reader.stats
        in_worker = get_worker_info() is not None
        if in_worker:  # a worker counts its own iteration; the main process sums the workers
            self._clock = Clock()
        clock = self._clock
        clock.start_reader(self._read_stats)
        pack = self._pack and in_worker and packs(self.stages, self.collation_fn)  # the main process unpacks
        views = self.zero_copy and not in_worker  # one process: members are views here
        made = BatchMaker(self.spec, self.stages, self.collation_fn, self.handler, self.counters,
                          fetcher, _unmoved if pack else self._advance, pack, views, clock,
                          self._arenas if in_worker else None, None if self.zero_copy else self._refs)(source)
        if in_worker:
            made = clock.made(made)
        try:
            yield from clock.noted(made) if in_worker and self._pack else made
        finally:
            clock.end_reader()

    def _source(self) -> PlannedSource:
        """Where this iteration starts: a seek into the plan (or the elastic view)."""
        info = get_worker_info()
        cursor, worker = self._cursor, None
        if info is not None and self._starts is not None:  # a kept worker: this iteration's start
            epoch, index = (int(v) for v in self._starts.tolist())
            cursor = replace(cursor.at(epoch, index), worker=None)
        if info is not None and cursor.worker == (info.id, info.num_workers):
            worker = (0, info.num_workers)  # a worker-local position: every num_workers-th from here
        else:
            cursor = cursor.rewound(self.spec)
        if info is None:
            cursor = replace(cursor, pinned=False)
        self._cursor = cursor
        return PlannedSource(self.spec, cursor, worker)

    def _advance(self, done: tuple[int, int]) -> Cursor:
        """Record that plan batch ``done = (epoch, j)`` was yielded."""
        epoch, k = done  # the view's batches are its plan's, indexed from 0
        info = get_worker_info()
        cursor = self._cursor
        if info is None and self.spec.mode is Mode.EPOCHS:  # the common case, per batch: one move
            self._cursor = cursor.at(epoch, min(k + 1, epoch_length(self.spec, epoch, cursor.view)))
        elif info is None:
            self._cursor = cursor.at(epoch, k).forward(self.spec, 1)
        else:  # this worker's next batch is num_workers further on
            moved = cursor.at(epoch, k).forward(self.spec, info.num_workers)
            self._cursor = replace(moved, worker=(info.id, info.num_workers))
        return self._cursor
