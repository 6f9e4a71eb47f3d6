"""A shard-level worker's samples: its plan's shards read in order, each sequentially by
the tar scanner from a byte offset, checked against what the index records.

Invariants:
- samples come in the plan's order (its shards, then cyclically its padding shards,
  marked ``__pad__``) until the plan's target is yielded; ``live[0]`` is, after each
  sample, the position just past it (shard position, byte offset, samples yielded),
  so a stream resumed there reads no byte before it;
- a shard is opened once, at its offset (a seek locally, a ranged read remotely); one
  whose size differs from the index, that is gone, whose samples hold members the
  index does not know, or that holds another number of samples than recorded is a
  StaleShardError naming it and the fix; running out of descriptors is one
  ReadError naming the limit and what to use fewer of.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from ..core.local.shardsplit import WorkerPlan
from ..errors import ConfigError, StaleShardError
from ..io.descriptors import out_of_descriptors, runs_out
from ..io.fs import get_filesystem
from ..io.redact import redact
from ..state.cursor import WorkerPosition
from ..tar.scan import scan_tar
from .shards import local_path

__all__ = ["ShardReader"]


class ShardReader:
    """Reads a worker's planned shards.

    Args:
        counts: samples per shard URL, as the index records them.
        sizes: ``(size, stamp)`` per shard URL, as indexed.
        name: the index's path or name, for messages.
        exts: the member extensions the index records.
        storage_options: fsspec options for remote shards.
        open_options: extra ``fs.open`` arguments.
    """

    def __init__(self, counts: Mapping[str, int], sizes: Mapping[str, tuple[int, Any]], name: str,
                 exts: tuple[str, ...], storage_options: Mapping[str, Any], open_options: Mapping[str, Any]) -> None:
        self.counts, self.sizes, self.name, self.exts = counts, sizes, name, exts
        self.storage_options, self.open_options = storage_options, open_options

    def samples(self, plan: WorkerPlan, start: WorkerPosition,
                live: list[WorkerPosition]) -> Iterator[dict[str, Any]]:
        """The plan's samples from ``start`` on, ``live[0]`` kept at the position after each."""
        k, offset, yielded = start.shard, start.offset, start.yielded
        empty = 0
        while yielded < plan.target:
            url, pad = plan.shard_at(k)
            got = 0
            for sample, next_offset in self.read(url, offset, pad):
                if yielded >= plan.target:
                    if k < len(plan.shards):
                        raise StaleShardError(f"shard {redact(url)!r} holds more samples than the index "
                                              f"records (at key {sample['__key__']!r}); re-index the shards")
                    break
                yielded, got = yielded + 1, got + 1
                live[0] = WorkerPosition(k, next_offset, yielded)
                yield sample
            if k < len(plan.shards) and offset == 0 and got != self.counts[url]:
                raise StaleShardError(f"shard {redact(url)!r} holds {got} samples, the index records "
                                      f"{self.counts[url]}; re-index the shards")
            k, offset = k + 1, 0
            live[0] = WorkerPosition(k, 0, yielded)
            empty = 0 if got else empty + 1
            if empty > len(plan.shards) + len(plan.cycle):
                raise ConfigError(f"the shards of index {self.name!r} hold no samples to pad with")

    def read(self, url: str, offset: int, pad: bool) -> Iterator[tuple[dict[str, Any], int]]:
        """Samples of one shard from byte ``offset`` on, with the offset after each."""
        fs, path = get_filesystem(url, self.storage_options)
        meta = {} if (lp := local_path(url)) is None else {"__local_path__": lp}
        try:
            f = fs.open(path, "rb", **self.open_options)
        except FileNotFoundError:
            raise StaleShardError(f"shard {redact(url)!r} no longer exists; restore it or re-index") from None
        except OSError as exc:  # one shard is open at a time: running out is the limit's fault
            if runs_out(exc):
                raise out_of_descriptors(f"cannot open shard {redact(url)!r}", exc,
                                         fewer="DataLoader workers") from exc
            raise
        with f:
            size = getattr(f, "size", None)
            size = fs.size(path) if size is None else size
            if size != self.sizes[url][0]:
                raise StaleShardError(f"shard {redact(url)!r} has {size} bytes, the index records "
                                      f"{self.sizes[url][0]}: it changed; re-index the shards")
            if offset >= size:
                return
            if offset:
                f.seek(offset)  # a seek locally; fsspec files then fetch ranges from here on
            for s in scan_tar(f, url, want=self.exts, seekable=False):
                if len(s.data) != len(s.members):
                    raise StaleShardError(f"sample {s.key!r} of {redact(url)!r} has members the index does "
                                          "not know; the shard changed, re-index it")
                sample: dict[str, Any] = {"__key__": s.key, "__url__": url, **meta, **s.data, "__pad__": pad}
                yield sample, offset + s.offset + s.length


