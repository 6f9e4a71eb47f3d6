"""The shard-level drop-in path for existing webdataset scripts.

``wds.WebDataset(urls, nodesplitter=wds_pad.split_by_node(seed=7), shardshuffle=False)``
orders the shard list with the shared seed and epoch and cyclically pads it to a
multiple of dp_size (CP peers get the same shards); ``.compose(wds_pad.equalize(index,
splitter))`` then makes every rank yield exactly the same number of samples per epoch,
wrapping cyclically over its own shards: the fix for the classic hang at the end of an
epoch when shards are uneven.

Invariants:
- every rank computes the same shard order from (seed, epoch) and the sorted URL list;
- dp_rank d takes padded positions p with p mod dp_size == d: equal shard counts;
- with N DataLoader workers, worker w of every rank yields exactly
  max over DP ranks of (samples in worker w's shards), so every rank yields the same total.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from .errors import ConfigError, StaleShardError
from .index import Index, load_index
from .read import RangeReader, ReadOptions
from .seed import derive_rng, shared_seed
from .tarscan import parse_sample
from .topology import Topology

__all__ = ["Equalize", "SplitByNode", "assign_shards", "equalize", "split_by_node"]


def assign_shards(urls: Sequence[str], seed: int, epoch: int, dp_size: int) -> list[list[tuple[str, bool]]]:
    """Per dp_rank, its shards for ``epoch`` as (url, is_padded_copy), in order.

    The sorted URL list is shuffled by an RNG derived from (seed, epoch, "shards") and
    extended cyclically by its own prefix to a multiple of dp_size.
    """
    canon = sorted(set(urls))
    if len(canon) != len(list(urls)):
        raise ConfigError("the shard list contains duplicate URLs; list each shard once")
    n = len(canon)
    if n == 0:
        return [[] for _ in range(dp_size)]
    order = derive_rng(seed, epoch, "shards").permutation(n)
    length = -(-n // dp_size) * dp_size
    return [[(canon[order[p % n]], p >= n) for p in range(d, length, dp_size)] for d in range(dp_size)]


class SplitByNode:
    """A webdataset ``nodesplitter``: this DP rank's shards, seed- and epoch-ordered, padded.

    Args:
        seed: the shared seed (default: drawn on rank 0 and broadcast, at construction).
        epoch: the epoch whose order to use; change it with ``set_epoch``.
        topology: default ``Topology.detect(group=group, cp_size=cp_size)``.
        group: the torch.distributed group.
        cp_size: ranks per data-parallel replica (they receive the same shards).
    """

    def __init__(self, seed: int | None = None, epoch: int = 0, topology: Topology | None = None,
                 group: Any = None, cp_size: int = 1) -> None:
        self.topology = topology if topology is not None else Topology.detect(group=group, cp_size=cp_size)
        self.seed = shared_seed(seed, group)
        self.epoch = int(epoch)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def assignment(self, urls: Sequence[str]) -> list[list[tuple[str, bool]]]:
        return assign_shards(urls, self.seed, self.epoch, int(self.topology.dp_size))  # type: ignore[arg-type]

    def __call__(self, src: Iterable[Any]) -> Iterator[dict[str, Any]]:
        items = [s if isinstance(s, dict) else {"url": s} for s in src]
        mine = self.assignment([s["url"] for s in items])[int(self.topology.dp_rank)]  # type: ignore[arg-type]
        for url, padded in mine:
            yield {"url": url, "__pad_shard__": padded}


def split_by_node(seed: int | None = None, epoch: int = 0, topology: Topology | None = None,
                  group: Any = None, cp_size: int = 1) -> SplitByNode:
    """Drop-in for ``wds.WebDataset(urls, nodesplitter=...)``; see :class:`SplitByNode`."""
    return SplitByNode(seed=seed, epoch=epoch, topology=topology, group=group, cp_size=cp_size)


def _worker() -> tuple[int, int]:
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class Equalize:
    """Stage after webdataset's sample grouping: equal samples per rank, wrapping cyclically.

    Args:
        index: an index of the same shards (built with no excluded samples).
        splitter: the SplitByNode used by the pipeline (same seed, epoch, topology).
        read_options: how padding samples are read back (byte ranges from the index).
    """

    def __init__(self, index: Index | str, splitter: SplitByNode,
                 read_options: ReadOptions | None = None) -> None:
        self.index = load_index(index) if isinstance(index, str) else index
        excluded = int(self.index.excluded.get("count", 0)) + len(self.index.excluded.get("shards", []))
        if excluded:
            raise ConfigError(
                f"equalize needs an index of every sample, but {excluded} samples/shards were "
                "excluded when it was built; rebuild it with --bucket-by none and no --on-error skip"
            )
        if not isinstance(splitter, SplitByNode):
            raise ConfigError("equalize needs the wds_pad.split_by_node(...) splitter of the pipeline")
        self.splitter = splitter
        self.read_options = read_options
        self._counts = {s.url: s.samples for s in self.index.shards}

    def targets(self, worker: int, num_workers: int) -> tuple[list[tuple[str, bool]], int]:
        """This rank's shards for ``worker`` and the number of samples it must yield."""
        assignment = self.splitter.assignment(list(self._counts))
        per_rank = [[self._counts[u] for u, _ in shards[worker::num_workers]] for shards in assignment]
        mine = assignment[int(self.splitter.topology.dp_rank)][worker::num_workers]  # type: ignore[arg-type]
        return mine, max(sum(c) for c in per_rank)

    def __call__(self, src: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        worker, num_workers = _worker()
        shards, target = self.targets(worker, num_workers)
        count = 0
        for sample in src:
            if count >= target:
                raise StaleShardError(
                    f"this worker's shards yielded more than the {target} samples the index "
                    f"records (at {sample.get('__url__')!r}); re-index the shards"
                )
            count += 1
            sample.setdefault("__pad__", False)
            yield sample
        if count < target:
            yield from self._wrap(shards, target - count)

    def _wrap(self, shards: list[tuple[str, bool]], missing: int) -> Iterator[dict[str, Any]]:
        """``missing`` samples read cyclically from the front of this worker's shards."""
        ix = self.index
        by_url = {s.url: i for i, s in enumerate(ix.shards)}
        ids = np.concatenate([np.flatnonzero(ix.shard == by_url[u]) for u, _ in shards]) if shards else []
        if len(ids) == 0:
            ids = np.arange(len(ix))  # a worker without shards borrows from the whole index
        if len(ids) == 0:
            raise ConfigError("equalize: the index has no samples to pad with")
        reader = RangeReader(self.read_options)
        picks = [int(ids[k % len(ids)]) for k in range(missing)]
        ranges = [(ix.url(i), int(ix.offset[i]), int(ix.length[i])) for i in picks]
        for i, (url, offset, _), data in zip(picks, ranges, reader.read_many(ranges)):
            sample: dict[str, Any] = {"__key__": ix.key(i), "__url__": url, "__pad__": True}
            sample.update(parse_sample(data, url, offset, ix.key(i)))
            yield sample


def equalize(index: Index | str, splitter: SplitByNode, read_options: ReadOptions | None = None) -> Equalize:
    """Stage making every rank yield the same number of samples; see :class:`Equalize`."""
    return Equalize(index, splitter, read_options)
