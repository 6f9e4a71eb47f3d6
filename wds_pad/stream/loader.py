"""Loader: a DataLoader over a BucketedWebDataset whose state is exact while workers prefetch.

Invariants:
- the trainer receives the plan's batches in plan order for any ``num_workers`` (each
  worker starts from the same pinned position and takes every num_workers-th batch);
- ``state_dict()`` is the position of the last batch the trainer received, counted in
  the main process, whatever the workers have prefetched;
- ``load_state_dict()`` verifies the whole state first and changes nothing on refusal;
  it is refused while an iterator of the loader or of its dataset is open in this
  process (both count in the dataset's ``_live``);
- DataLoader arguments that would break exactness (batching, shuffling, samplers) are
  refused up front;
- the next iteration is a seek to the saved position: no earlier sample is read again;
- with workers, a batch of local shards crosses to the main process in shared memory
  (stream/transport.py: one buffer, its offsets, the small per-sample fields) and is
  rebuilt into the same sample dicts here: the batches equal those of ``num_workers=0``;
- however an iteration with workers ends (exhausted, stopped early, or by an error), its
  DataLoader workers are shut down before the loop is left (``workers.shut_down``); with
  ``persistent_workers=True`` only an iteration that ran to its end keeps them, for the
  next one to start at its own position (a shared ``[epoch, index]`` the workers read
  when they iterate again) if nothing but that position changed, else they are replaced;
  kept workers end with :meth:`Loader.close` or when the loader is collected;
- ``state_dict()`` holds this rank's entry under ``per_rank`` (so torch.distributed.checkpoint,
  which keeps one copy of a key every rank has, gives each rank its own); with
  ``gather_state=True`` it holds every rank's (one all_gather over the dataset's group), so a
  checkpoint one process writes for the whole job (Lightning, Fabric, accelerate's
  ``register_for_checkpointing``) resumes every rank;
- ``loader.sampler.set_epoch(e)`` is ``loader.set_epoch(e)``: Lightning's Trainer calls it on
  every loader at the start of each epoch, so under ``Trainer.fit`` each epoch has its own
  order and a mid-epoch resume keeps its restored position, with no callback;
- a dataset that detected its topology before the job's process group existed (one process,
  while the group has more ranks: built before ``Trainer.fit`` under Lightning's launchers) is
  refused when iteration starts, before any batch: every rank would stream the whole plan.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping

import numpy as np

from .loaderargs import check_loader_args, check_start_timeout
from ..core.collective import all_gather, dist_for
from ..core.policy import check_flag
from ..errors import ConfigError, TopologyError
from .dataset import BucketedWebDataset
from .fetch import fetch
from ..io import shardmaps
from .mappedbatch import REFS, MappedShards
from .ring import shared_ints
from .stats import StreamStats
from .transport import unpacked
from .workers import START_TIMEOUT, kept_workers, resumed, shut_down, watched
from ..state import Cursor, make_state, restore
from ..state.schema import PER_RANK

__all__ = ["Loader"]


def _as_is(batch: Any) -> Any:
    return batch


_PIPE_BYTES = 1 << 20


def _widen_pipe(batches: Any) -> None:
    """Let the pipe that carries batches from the workers hold a whole batch (Linux: 64 KiB
    by default, 1 MiB allowed): a 640 KB batch then crosses in one write, not ten round
    trips between the processes. Best effort: torch's private queue, Linux only."""
    try:
        import fcntl

        fd = batches._worker_result_queue._reader.fileno()
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), _PIPE_BYTES)
    except Exception:  # noqa: BLE001 - another platform or torch: the default pipe
        pass


@dataclass(eq=False)
class _Workers:
    """An iteration's DataLoader workers: its DataLoader and iterator, the cursor they were
    started at, the shared ``[epoch, index]`` kept workers read at each iteration, and
    the workers' rings of batch buffers the main process has seen (by ring id)."""

    loader: Any
    batches: Any
    start: Cursor
    starts: Any = None
    rings: dict[Any, np.ndarray] = field(default_factory=dict)
    shards: MappedShards | None = None  # for batches kept workers send by reference

    def end(self) -> None:
        """Shut the workers down, and close the main process's descriptors of their shards."""
        try:
            shut_down(self.batches)
        finally:
            if self.shards is not None:
                self.shards.close()

    def serves(self, start: Cursor) -> bool:
        """Whether these workers can start an iteration at ``start``: only its epoch and index differ."""
        return self.starts is not None and replace(start, epoch=self.start.epoch, index=self.start.index) == self.start


def _end_kept(kept: list[_Workers]) -> None:
    """Shut the kept workers down (``Loader.close``, or the loader collected)."""
    while kept:
        kept.pop().end()


def _gather_entries(own: dict[str, Any], group: Any) -> dict[str, Any]:
    """Every rank's ``per_rank`` entries, merged (one all_gather_object); ``own`` alone
    without an initialised process group."""
    gathered = all_gather(own, group)
    if gathered is None:
        return own
    merged: dict[str, Any] = {}
    for entries in gathered:
        merged.update(entries)
    return dict(sorted(merged.items(), key=lambda kv: int(kv[0][len('rank'):])))


class _EpochHook:
    """``Loader.sampler``: not a torch Sampler (the plan orders the batches), only the
    ``set_epoch`` that Lightning's loops call on a loader's sampler at every epoch start."""

    __slots__ = ("_loader",)

    def __init__(self, loader: "Loader") -> None:
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)


def _refuse_early_topology(ds: BucketedWebDataset) -> None:
    """Raise a TopologyError if ``ds`` detected fewer ranks than the job's process group has.

    Lightning creates the process group inside ``Trainer.fit``: a dataset built before it,
    with no torchrun environment (``strategy="ddp_spawn"`` pickles it into every process;
    under Lightning's own ``ddp`` launcher rank 0 builds it before rank 1 exists), detected
    one process, and every rank would stream the whole plan. The agreement check cannot see
    it: every rank holds the same one-process plan.
    """
    if not getattr(ds, "_detected_topology", False) or ds.group is not None:
        return
    dist = dist_for()
    if dist is None:
        return
    world = dist.get_world_size()
    if world != ds.topology.world_size:
        raise TopologyError(
            f"Loader: the dataset detected {ds.topology.world_size} process(es) when it was built, but the "
            f"job's process group has {world} ranks now: it was built before the process group existed, "
            "and every rank would stream the same batches. Build it where the group exists: under "
            "Lightning in LightningModule.train_dataloader() or LightningDataModule.setup() (Trainer.fit "
            "starts the processes), otherwise after torch.distributed.init_process_group(); or pass "
            "topology= or group= explicitly (see docs/distributed.md, 'PyTorch Lightning')")


class Loader:
    """A thin DataLoader wrapper whose ``state_dict()`` is exact while workers prefetch.

    It counts batches as the trainer receives them in the main process; on the next
    iteration every worker starts at the saved position (a seek, not a replay).

    Args:
        dataset: a BucketedWebDataset.
        num_workers: DataLoader worker processes (0: iterate in the main process).
        gather_state: ``state_dict()`` gathers every rank's entry into ``per_rank`` (a
            collective over the dataset's group: every rank calls it at once, as Lightning's,
            Fabric's and accelerate's checkpointing do), so a checkpoint that one process
            writes for the whole job resumes every rank. Not needed with
            torch.distributed.checkpoint or per-rank state files.
        worker_start_timeout: seconds a forked worker may take to start before it is taken
            for stuck in the fork and replaced (see :mod:`wds_pad.stream.workers`).
        **kwargs: passed to torch's DataLoader (pin_memory, prefetch_factor,
            multiprocessing_context, timeout, ...). ``batch_size`` is always None
            (the dataset batches). ``persistent_workers=True`` keeps the workers from
            one iteration that runs to its end to the next (each starts at the loader's
            position; later epochs read local shards out of the workers' kept mappings):
            :meth:`close` ends them.
    """

    def __init__(self, dataset: BucketedWebDataset, num_workers: int = 0, *, gather_state: bool = False,
                 worker_start_timeout: float = START_TIMEOUT, **kwargs: Any) -> None:
        if not isinstance(dataset, BucketedWebDataset):
            raise ConfigError(f"Loader wraps a BucketedWebDataset, got {type(dataset).__name__}")
        check_loader_args("Loader", num_workers, kwargs, "the plan decides batches and order, "
                          "and workers must restart at each saved position", keeps_workers=True)
        self.persistent_workers = bool(kwargs.pop("persistent_workers", False))
        # batches are collated by the dataset already; DataLoader's default_convert would
        # turn numpy arrays into tensors only when num_workers > 0
        kwargs.setdefault("collate_fn", _as_is)
        self.dataset = dataset
        self.num_workers = num_workers
        self.kwargs = kwargs
        self.gather_state = check_flag("Loader: gather_state", gather_state)
        self.worker_start_timeout = check_start_timeout("Loader", worker_start_timeout)
        # the trainer's place: its epoch and index count; the view and the pin are the dataset's
        self._cursor = dataset.cursor
        self._kept: list[_Workers] = []  # persistent_workers: the idle workers of the last iteration
        self._refs: Any = None  # the workers' shared flag: 0 while they send batches by reference
        weakref.finalize(self, _end_kept, self._kept)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_kept": [], "_refs": None}  # workers stay with the process that started them

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        weakref.finalize(self, _end_kept, self._kept)

    def close(self) -> None:
        """Shut down the workers kept between iterations (``persistent_workers=True``); the
        next iteration starts new ones. Nothing to do otherwise."""
        _end_kept(self._kept)

    @property
    def epoch(self) -> int:
        """The epoch of the next batch the trainer receives (or of the last, once finished)."""
        return self._cursor.epoch

    def set_epoch(self, epoch: int) -> None:
        """As :meth:`BucketedWebDataset.set_epoch`: the restored epoch keeps a restored
        position; another epoch starts at its first batch."""
        self.dataset.set_epoch(epoch)
        self._cursor = self.dataset.cursor

    def _here(self) -> Cursor:
        """The trainer's place on the dataset's cursor (its elastic view, its pin)."""
        return self.dataset.cursor.at(self._cursor.epoch, self._cursor.index)

    @property
    def sampler(self) -> _EpochHook:
        """An object whose ``set_epoch(epoch)`` is this loader's :meth:`set_epoch` (no sampling:
        the plan orders the batches).

        Lightning's Trainer calls ``sampler.set_epoch(epoch)`` on every loader at the start of
        each epoch, and before each validation run: so under ``Trainer.fit`` every epoch gets
        its own order, and after a mid-epoch resume the restored epoch keeps its position.
        """
        return _EpochHook(self)

    def __len__(self) -> int:
        return len(self.dataset)

    def state_dict(self) -> dict[str, Any]:
        """The position of the last batch the trainer received (JSON-safe, see docs/resume.md).

        With ``gather_state=True`` this is a collective: call it on every rank at once.
        """
        state = make_state(self.dataset.spec, replace(self._here(), worker=None))
        if self.gather_state:
            state[PER_RANK] = _gather_entries(state[PER_RANK], self.dataset.group)
        return state

    def load_state_dict(self, state: Mapping[str, Any], *, allow_elastic: bool = False) -> None:
        """Verify ``state`` in full, then make the next iteration start at its position.

        Raises:
            StateError, TopologyMismatchError, StateMismatchError: the state is refused;
                the loader is left exactly as it was.
        """
        cursor = restore(self.dataset.spec, state, allow_elastic=allow_elastic)  # pinned, no worker
        self.dataset._refuse_while_open("Loader")
        self.dataset.seek(cursor)
        self._cursor = cursor

    def stats(self) -> StreamStats:
        """Where this rank's data time went so far, its workers' counters summed in
        (:meth:`BucketedWebDataset.stats`; docs/streaming.md, "Where data time goes")."""
        return self.dataset.stats()

    def __iter__(self) -> Iterator[Any]:
        yield from self.dataset._counted(self._iterate())  # the dataset counts its loader's iterators

    def _iterate(self) -> Iterator[Any]:
        ds = self.dataset
        _refuse_early_topology(ds)
        # workers (and the dataset itself) start exactly here: a seek, decided once
        start = replace(self._here().rewound(ds.spec), worker=None, pinned=True)
        ds.seek(start)
        self._cursor = start
        ds.agree()
        if self.num_workers == 0:
            for batch in ds:
                self._cursor = ds.cursor
                yield batch
            return
        workers, ended = self._workers(start), False
        try:
            ds.seek(replace(start, pinned=False))
            yield from ds._clock.waited(self._received(workers), making=False)
            ended = True
        finally:  # an error or an early stop too: no worker outlives the loop, unless kept
            if ended and self.persistent_workers:
                _end_kept(self._kept)
                self._kept.append(workers)
            else:
                workers.end()
            ds._clock.end_workers()
        ds.seek(ds.cursor.at(self._cursor.epoch, self._cursor.index))

    def _workers(self, start: Cursor) -> _Workers:
        """Workers for an iteration from ``start``: the kept ones if they can start there
        (told where through their shared ``[epoch, index]``), else new ones."""
        if self._refs is not None and shardmaps.stopped() is None:  # this process maps again (its copies
            self._refs[REFS] = 0  # waited for the disk shardmaps.RETRY_SECONDS ago): by reference again
        kept = self._kept.pop() if self._kept else None
        if kept is not None and kept.serves(start):
            kept.starts[0], kept.starts[1] = start.epoch, start.index
            try:
                kept.batches = resumed(kept.loader, kept.batches, "Loader")
            except BaseException:  # one died meanwhile (a WorkerError): the others end too
                kept.end()
                raise
            return kept
        if kept is not None:
            kept.end()
        starts = shared_ints([start.epoch, start.index], "Loader") if self.persistent_workers else None
        if self._refs is None:  # whether workers send batches by reference, for the loader's life (mappedbatch.py)
            self._refs = shared_ints([0], "Loader")
        # starts the workers, each with its copy of the pinned dataset; one stuck in the fork is replaced
        # batches cross in shared memory and are unpacked here (transport.py)
        loader, batches = kept_workers(self.dataset.packed(starts, self._refs), self.num_workers, self.kwargs, owner="Loader",
                                       start_timeout=self.worker_start_timeout, keep=self.persistent_workers)
        _widen_pipe(batches)
        ds = self.dataset
        shards = MappedShards(fetch(ds.read_options, spec=ds.spec), self._refs.numpy())
        return _Workers(loader, batches, start, starts, shards=shards)

    def _received(self, workers: _Workers) -> Iterator[Any]:
        """The workers' batches, unpacked here (transport.py), their counters kept (stats.py)."""
        ds = self.dataset
        clock, collate, zero_copy, rings = ds._clock, ds.collation_fn, ds.zero_copy, workers.rings
        for item in clock.received(watched(workers.batches, "Loader")):
            # a run of batches, or one; unpacking and collating here is counted as collation
            for batch in unpacked(item, collate, zero_copy, rings, workers.shards):
                self._cursor = self._cursor.forward(ds.spec, 1)
                yield batch
