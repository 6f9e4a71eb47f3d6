"""The shard-level drop-in path for existing webdataset scripts.

``wds.WebDataset(urls, nodesplitter=splitter, shardshuffle=False)`` with
``splitter = wds_pad.split_by_node(seed=7)`` orders the shard list with the shared seed
and epoch and cyclically pads it to a multiple of dp_size (CP peers get the same
shards); ``.compose(wds_pad.equalize(index, splitter))`` then makes every rank yield
exactly the same number of samples per epoch, wrapping cyclically over its own shards:
the fix for the classic hang at the end of an epoch when shards are uneven.

Invariants:
- every rank computes the same shard order from (seed, epoch) and the URL list sorted by
  canonical URL (relative local paths made absolute, as the index stores them): the
  deal and each worker's plan are core/local/shardsplit.py's, pure; this module only puts the
  URLs in that order;
- dp_rank d takes padded positions p with p mod dp_size == d: equal shard counts, and
  no rank holds a shard twice;
- DataLoader worker w of a rank takes that rank's shards ``[w::num_workers]`` (as
  webdataset's ``split_by_worker``) and yields exactly ``target`` samples: the most
  that worker w holds on any DP rank. Missing samples are read cyclically from the
  front of the worker's own shards (from the whole index if it has none);
- samples of a padded shard copy and wrapped samples carry ``__pad__ = True``, all others
  ``__pad__ = False``; every sample of a worker carries the same metadata keys;
- :class:`wds_pad.ShardStream` (``shardstream.py``) yields the same samples in the same
  order from :func:`wds_pad.core.local.shardsplit.worker_plan`, and can resume.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping, Sequence
from urllib.parse import urlparse

import numpy as np

from ..errors import ConfigError, StaleShardError
from ..index.codec import load_index
from ..index.record import Index
from ..io.ranges import RangeReader, ReadOptions
from ..io.redact import redact
from ..core.collective import shared_seed
from ..core.local.shardsplit import WorkerPlan, deal_shards, worker_plan
from ..io.urls import canonical_url, expand_urls
from ..tar.scan import parse_sample
from ..core.topology import Topology

__all__ = ["Equalize", "SplitByNode", "assign_shards", "dealing_order", "equalize", "split_by_node"]

_NO_SAMPLES = "No samples found in dataset"  # webdataset's check_empty message


def _is_pattern(url: Any) -> bool:
    """Whether a pipeline's shard URL needs expanding (braces, or a glob off http)."""
    if not isinstance(url, str):
        return False
    if url.startswith(("http://", "https://")):
        return "{" in url or "*" in url
    return any(c in url for c in "{*?[")


def local_path(url: str) -> str | None:
    """What webdataset's opener puts in ``__local_path__`` for ``url`` (None if remote)."""
    parsed = urlparse(url)
    return parsed.path if parsed.scheme in ("", "file") else None


def dealing_order(urls: Sequence[str]) -> list[str]:
    """``urls`` as given, sorted by canonical URL: the order every rank deals the shards in
    (core/local/shardsplit.py), whatever the list's order or spelling.

    Raises:
        ConfigError: a shard is listed twice.
    """
    canon = sorted(urls, key=canonical_url)
    seen = [canonical_url(u) for u in canon]
    dup = next((u for u, a, b in zip(canon[1:], seen, seen[1:]) if a == b), None)
    if dup is not None:
        raise ConfigError(f"shard {redact(dup)!r} is listed twice; list each shard once")
    return canon


def assign_shards(urls: Sequence[str], seed: int, epoch: int, dp_size: int) -> list[list[tuple[str, bool]]]:
    """Per dp_rank, its shards for ``epoch`` as (url, is_padded_copy), in order.

    The URL list sorted by canonical URL is dealt by :func:`wds_pad.core.local.shardsplit.deal_shards`
    (shuffled from (seed, epoch, "shards"), extended cyclically by its own prefix to a
    multiple of dp_size). URLs are returned as given.

    Raises:
        ConfigError: a shard is listed twice.
    """
    canon = dealing_order(list(urls))
    shard, padded = deal_shards(len(canon), seed, epoch, dp_size)
    return [[(canon[s], p) for s, p in zip(row, pad)] for row, pad in zip(shard.tolist(), padded.tolist())]


class SplitByNode:
    """A webdataset ``nodesplitter``: this DP rank's shards, seed- and epoch-ordered, padded.

    The most recently made splitter of the process is ``SplitByNode.latest``, so that
    ``wds.WebDataset(urls, nodesplitter=split_by_node(...)).compose(equalize(index))``
    pairs the two without naming the splitter twice.

    Args:
        seed: the shared seed (default: drawn on rank 0 and broadcast, at construction).
        epoch: the epoch whose order to use; change it with ``set_epoch``.
        topology: default ``Topology.detect(group=group, cp_size=cp_size)``.
        group: the torch.distributed group.
        cp_size: ranks per data-parallel replica (they receive the same shards).
    """

    latest: "SplitByNode | None" = None

    def __init__(self, seed: int | None = None, epoch: int = 0, topology: Topology | None = None,
                 group: Any = None, cp_size: int = 1) -> None:
        self.topology = topology if topology is not None else Topology.detect(group=group, cp_size=cp_size)
        self.seed = shared_seed(seed, group)
        self.epoch = int(epoch)
        self.urls: list[str] | None = None  # the list last split: equalize checks it against its index
        SplitByNode.latest = self  # what equalize(index) pairs with when no splitter is passed

    def set_epoch(self, epoch: int) -> None:
        """Order the shards of ``epoch`` on the next iteration."""
        self.epoch = int(epoch)

    def assignment(self, urls: Sequence[str]) -> list[list[tuple[str, bool]]]:
        """Every DP rank's (url, is_padded_copy) list for the current epoch."""
        return assign_shards(urls, self.seed, self.epoch, int(self.topology.dp_size))  # type: ignore[arg-type]

    def __call__(self, src: Iterable[Any]) -> Iterator[dict[str, Any]]:
        items = [s if isinstance(s, dict) else {"url": s} for s in src]
        # a glob or brace pattern in the list becomes its shards, as build_index reads it;
        # a plain URL stays as given (webdataset opens it and names samples after it)
        self.urls = [u for s in items for u in (expand_urls(s["url"]) if _is_pattern(s["url"]) else [s["url"]])]
        for url, padded in self.assignment(self.urls)[int(self.topology.dp_rank)]:  # type: ignore[arg-type]
            # webdataset's openers read only "url"; the marker is for custom stages.
            yield {"url": url, "__pad_shard__": padded}


def split_by_node(seed: int | None = None, epoch: int = 0, topology: Topology | None = None,
                  group: Any = None, cp_size: int = 1) -> SplitByNode:
    """Drop-in for ``wds.WebDataset(urls, nodesplitter=...)``; see :class:`SplitByNode`."""
    return SplitByNode(seed=seed, epoch=epoch, topology=topology, group=group, cp_size=cp_size)


def shard_counts(index: Index, what: str) -> dict[str, int]:
    """url -> samples of an index that holds every sample (else ConfigError)."""
    excluded = int(index.excluded.get("count", 0)) + len(index.excluded.get("shards", []))
    if excluded:
        raise ConfigError(
            f"{what} needs an index of every sample, but {excluded} samples/shards of "
            f"{index.path or index.name!r} were excluded when it was built; rebuild it with "
            "--bucket-by none and no --on-error skip"
        )
    return {s.url: s.samples for s in index.shards}


def _worker() -> tuple[int, int]:
    from webdataset.utils import pytorch_worker_info  # the split webdataset's split_by_worker uses

    _, _, worker, num_workers = pytorch_worker_info()
    return worker, num_workers


class Equalize:
    """Stage after webdataset's sample grouping: equal samples per rank, wrapping cyclically.

    Args:
        index: an index of the same shards (built with no excluded samples).
        splitter: the SplitByNode of the pipeline (same object: it records the URL list).
        read_options: how padding samples are read back (byte ranges from the index).
    """

    def __init__(self, index: Index | str, splitter: SplitByNode | None = None,
                 read_options: ReadOptions | None = None) -> None:
        self.index = load_index(index) if isinstance(index, str) else index
        if not isinstance(self.index, Index):
            raise ConfigError(f"equalize needs a wds_pad Index or index path, got {type(index).__name__}")
        if splitter is None:
            splitter = SplitByNode.latest
            if splitter is None:
                raise ConfigError(
                    "equalize(index) pairs with the pipeline's wds_pad.split_by_node(...) "
                    "nodesplitter, and none was made yet in this process; make it first, or "
                    "pass it: equalize(index, splitter)"
                )
        if not isinstance(splitter, SplitByNode):
            raise ConfigError("equalize needs the wds_pad.split_by_node(...) splitter of the pipeline")
        self.splitter = splitter
        self.read_options = read_options
        self._counts = shard_counts(self.index, "equalize")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self.index.path is not None:  # workers map the file instead of receiving a copy
            state["index"] = (self.index.path, self.index.digest, dict(self.index.relocate))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["index"], tuple):
            path, digest, relocate = state["index"]
            state["index"] = load_index(path, verify=False, relocate=relocate)
            if state["index"].digest != digest:
                raise StaleShardError(f"index {path!r} changed while the pipeline was running; restart it")
        self.__dict__.update(state)

    def plan(self, worker: int, num_workers: int) -> WorkerPlan:
        """What ``worker`` of this rank must yield this epoch."""
        return worker_plan(self._counts, self.splitter.seed, self.splitter.epoch,
                           self.splitter.topology, worker, num_workers, order=dealing_order(list(self._counts)))

    def check_urls(self, urls: Sequence[str]) -> None:
        """Raise ConfigError unless ``urls`` are the index's shards (canonically)."""
        listed = {canonical_url(u) for u in urls}
        indexed = set(self._counts)
        if listed != indexed:
            extra, missing = sorted(listed - indexed), sorted(indexed - listed)
            raise ConfigError(
                f"the pipeline's shard list ({len(listed)} shards) is not the one indexed in "
                f"{self.index.path or self.index.name!r} ({len(indexed)} shards): only in the "
                f"list {[redact(u) for u in extra[:3]]}, only in the index "
                f"{[redact(u) for u in missing[:3]]}; build the index from the same URLs"
            )

    def _check_count(self, url: str, got: int) -> None:
        if url and got != self._counts[url]:
            raise StaleShardError(f"shard {redact(url)!r} yielded {got} samples, the index records "
                                  f"{self._counts[url]}: it changed since it was indexed; re-index it")

    def _next_shard(self, order: list[str], done: int, url: str, key: Any) -> int:
        """Check that ``url`` is the worker's next shard with samples; return its position."""
        k = order.index(url, done) if url in order[done:] else -1
        skipped = [u for u in order[done:k] if self._counts[u]] if k >= 0 else []
        if k < 0 or skipped:
            where = (f"before shard {redact(skipped[0])!r}, which split_by_node orders first for this "
                     "worker" if skipped else "which split_by_node did not give this worker (here)")
            raise ConfigError(
                f"sample {key!r} comes from shard {redact(url)!r} {where}: pass the same splitter "
                "object to WebDataset(nodesplitter=...) and equalize(), with shardshuffle=False "
                "(split_by_node already shuffles by the seed), and no handler that skips a failed "
                "shard (equal counts need every shard)"
            )
        return k

    def __call__(self, src: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        plan = self.plan(*_worker())
        order = [canonical_url(u) for u, _ in plan.shards]
        padded = dict(zip(order, (pad for _, pad in plan.shards)))
        extras: dict[str, dict[str, Any]] = {}  # url -> metadata the opener added (__local_path__)
        count, checked, current, at, per_shard = 0, False, "", 0, 0
        try:
            for sample in src:
                if not checked and self.splitter.urls is not None:
                    self.check_urls(self.splitter.urls)
                    checked = True
                url = canonical_url(sample["__url__"])
                if url != current:  # each shard of the worker is one run, in plan order
                    self._check_count(current, per_shard)
                    at = self._next_shard(order, at + (current != ""), url, sample.get("__key__"))
                    current, per_shard = url, 0
                    extras[url] = {k: v for k, v in sample.items() if k in ("__local_path__",)}
                if count >= plan.target:
                    raise StaleShardError(
                        f"this worker's shards yielded more than the {plan.target} samples the "
                        f"index records (at {redact(url)!r}); re-index the shards"
                    )
                count += 1
                per_shard += 1
                sample["__pad__"] = padded[url]
                yield sample
        except ValueError as exc:
            # webdataset's check_empty fails a worker that has no shards; equalize fills it.
            if count or plan.shards or _NO_SAMPLES not in str(exc):
                raise
        if not checked and self.splitter.urls is not None:
            self.check_urls(self.splitter.urls)
        self._check_count(current, per_shard)
        for url in order[at + (current != ""):]:
            self._check_count(url, 0)
        if count < plan.target:
            names = {canonical_url(u): u for u in self.splitter.urls or ()}
            yield from self._wrap(plan, plan.target - count, extras, names)

    def _wrap(self, plan: WorkerPlan, missing: int, extras: dict[str, dict[str, Any]],
              names: Mapping[str, str]) -> Iterator[dict[str, Any]]:
        """``missing`` samples read cyclically from the front of ``plan.cycle``."""
        ix = self.index
        by_url = {s.url: i for i, s in enumerate(ix.shards)}
        ids = np.concatenate([np.flatnonzero(ix.shard == by_url[u]) for u in plan.cycle])
        if len(ids) == 0:
            raise ConfigError(f"equalize: the shards of index {ix.path or ix.name!r} hold no samples to pad with")
        picks = [int(ids[k % len(ids)]) for k in range(missing)]
        ranges = [(ix.url(i), int(ix.offset[i]), int(ix.length[i])) for i in picks]
        with RangeReader(self.read_options) as reader:
            for i, (url, offset, _), data in zip(picks, ranges, reader.read_many(ranges)):
                sample: dict[str, Any] = {"__key__": ix.key(i), "__url__": names.get(url, url)}
                meta = extras.get(url)
                if meta is None:
                    path = local_path(sample["__url__"])
                    meta = {} if path is None else {"__local_path__": path}
                sample.update(meta)
                sample.update(parse_sample(data, url, offset, ix.key(i)))
                sample["__pad__"] = True
                yield sample


def equalize(index: Index | str, splitter: SplitByNode | None = None,
             read_options: ReadOptions | None = None) -> Equalize:
    """Stage making every rank yield the same number of samples; see :class:`Equalize`.

    Args:
        index: an index of the pipeline's shards (path or Index).
        splitter: the pipeline's ``split_by_node(...)``; default: the one made last in
            this process (``SplitByNode.latest``).
        read_options: how padding samples are read back.
    """
    return Equalize(index, splitter, read_options)
