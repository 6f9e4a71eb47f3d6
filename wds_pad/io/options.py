"""How a range reader reads (:class:`ReadOptions`) and what it counted (:class:`ReadStats`).

Invariants:
    * A ``ReadOptions`` is valid once made: every bound is an int or number in range,
      else a :class:`ConfigError` naming the field, the value and the fix.
    * Its ``storage_options`` are a private copy of the caller's (fsspec mutates them),
      and their credentials are registered for :func:`~wds_pad.io.redact.redact`; the
      repr never shows them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from wds_pad.errors import ConfigError

from .fs import copy_dicts
from .redact import register_secrets

__all__ = ["ReadOptions", "ReadStats", "check_storage_options", "stream_options"]


@dataclass(frozen=True)
class ReadOptions:
    """How a :class:`RangeReader` reads.

    Attributes:
        max_in_flight: Requests (single or merged ranges) outstanding at once, per
            process or DataLoader worker. 16-64 hide object-store latency. Also the
            number of large local samples read ahead (see ``local_threads``).
        max_bytes_in_flight: Read-ahead memory bound, remote requests and large local
            samples alike. Peak buffered bytes are at most this plus one largest sample.
        merge_gap: Consecutive ranges of one URL whose gap is at most this many bytes
            are fetched as one request and sliced (0: only exactly adjacent ranges).
        max_merged_bytes: Largest merged request (0 disables merging).
        retries: Retries of a transient failure (5xx, connection reset, timeout).
        backoff: First retry delay in seconds, doubled each retry, capped at backoff_max.
        backoff_max: Largest retry delay in seconds.
        timeout: Seconds one attempt may take before it is cancelled and retried.
        storage_options: Passed to fsspec (credentials, endpoint_url, ...). A value that
            is a dict under a protocol name (``{"s3": {...}}``) applies to that protocol
            only, which is how options for chained or mixed URLs are given.
        local_threads: Threads per process or DataLoader worker that read large local
            samples (the fetch stage's, 256 KB and more) ahead of the consumer, so the
            kernel's copy of the next samples overlaps the Python work on this one; the
            consumer joins in rather than wait. Order is kept; ``max_in_flight`` and
            ``max_bytes_in_flight`` bound what is read ahead. They start with a stream and
            stop with it. 0 reads every local sample inline in the consuming thread.
        block_bytes: With a shard-local plan (``locality="shard"``), each remote shard a
            rank reads whole is fetched in requests of this many bytes (the last one
            shorter), ahead of its first use (:mod:`wds_pad.io.shardcache`).
        cache_dir: A folder on a local disk of the node for whole shards, shared by every
            process of the job there (local ranks, DataLoader workers, context-parallel
            peers: one fetch per shard per node) and kept across epochs and jobs
            (:mod:`wds_pad.io.nodecache`). None: the job's own folder in the temporary
            directory when the node runs several of its processes, else memory.
        cache_bytes: Bound on the whole-shard bytes: of one process's memory (fetched and
            held, besides the one in use), or of the node folder's shard files (a shard a
            read needs is fetched in any case).
        map_local: From the second time a process streams a local shard on, copy its
            samples out of a memory mapping of it instead of reading each with
            ``os.pread`` (:mod:`wds_pad.io.shardmaps`): about twice as fast from the page
            cache, and turned off by itself when a copy waits for the disk. False: always
            ``os.pread`` (for shards other programs rewrite in place while jobs read them).
    """

    max_in_flight: int = 32
    max_bytes_in_flight: int = 256 * 2**20
    merge_gap: int = 0
    max_merged_bytes: int = 16 * 2**20
    retries: int = 5
    backoff: float = 0.2
    backoff_max: float = 5.0
    timeout: float = 60.0
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False, hash=False)
    local_threads: int = 2
    block_bytes: int = 64 * 2**20
    cache_dir: str | None = None
    cache_bytes: int = 2 * 2**30
    map_local: bool = True

    def __post_init__(self) -> None:
        for name, low in (("max_in_flight", 1), ("max_bytes_in_flight", 1), ("merge_gap", 0),
                          ("max_merged_bytes", 0), ("retries", 0), ("local_threads", 0),
                          ("block_bytes", 1), ("cache_bytes", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"ReadOptions.{name} must be an int >= {low}, got {value!r}")
        if not isinstance(self.map_local, bool):
            raise ConfigError(f"ReadOptions.map_local must be True or False, got {self.map_local!r}")
        for name in ("backoff", "backoff_max", "timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"ReadOptions.{name} must be a number >= 0, got {value!r}")
        if not 0 < self.timeout < float("inf"):
            raise ConfigError("ReadOptions.timeout must be positive and finite, got "
                              f"{self.timeout!r}")
        if self.backoff_max < self.backoff:
            raise ConfigError(f"ReadOptions.backoff_max ({self.backoff_max}) must be >= backoff "
                              f"({self.backoff}); raise backoff_max or lower backoff")
        if self.cache_dir is not None and (not isinstance(self.cache_dir, str) or not self.cache_dir
                                           or "://" in self.cache_dir):
            raise ConfigError(f"ReadOptions.cache_dir must be a local folder path or None, got "
                              f"{self.cache_dir!r}")
        if not isinstance(self.storage_options, Mapping):
            raise ConfigError("ReadOptions.storage_options must be a mapping, got "
                              f"{type(self.storage_options).__name__}")
        object.__setattr__(self, "storage_options", copy_dicts(self.storage_options))
        register_secrets(self.storage_options)


def check_storage_options(storage_options: Any) -> None:
    """A ConfigError unless ``storage_options`` is a mapping of fsspec options or None."""
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise ConfigError(f"storage_options must be a dict of fsspec options or None, got "
                          f"{type(storage_options).__name__}; e.g. storage_options={{'anon': True}}")


def stream_options(read_options: Any, storage_options: Any) -> "ReadOptions | None":
    """A dataset's read options: ``read_options`` (a ReadOptions or None) with the dataset's
    own ``storage_options`` merged over its own; a ConfigError naming a wrong type."""
    if read_options is not None and not isinstance(read_options, ReadOptions):
        raise ConfigError(f"read_options must be a wds_pad.ReadOptions or None, got {type(read_options).__name__}; "
                          "e.g. read_options=ReadOptions(max_in_flight=32)")
    check_storage_options(storage_options)
    if not storage_options:
        return read_options
    base = read_options or ReadOptions()
    return ReadOptions(**{**base.__dict__, "storage_options": {**base.storage_options, **storage_options}})


@dataclass
class ReadStats:
    """Counters of one reader, for benchmarks and reports (``as_dict()`` to log them)."""

    ranges: int = 0
    requests: int = 0
    merged: int = 0
    bytes: int = 0
    retries: int = 0
    timeouts: int = 0
    peak_bytes_in_flight: int = 0
    peak_requests_in_flight: int = 0
    shard_blocks: int = 0  # requests of whole-shard blocks (ShardCache)
    store_checks: int = 0  # HEADs asking the store whether a node's copy is still the indexed shard
    peak_cache_bytes: int = 0  # most shard bytes held (fetched ahead or in use) at once
    exact_batches: int = 0  # batches whose tar headers were parsed: no member table for a sample, or it differed
    exact_samples: int = 0  # samples read that way
    gets: int = 0  # GETs sent to a remote store, retries and whole-shard blocks included
    get_bytes: int = 0  # bytes those GETs returned
    get_wait_ns: int = 0  # time the reading thread waited on its own ranged GETs
    cache_wait_ns: int = 0  # time it waited on the shard cache (memory or the node's copies)
    cache_hits: int = 0  # reads the shard cache answered with bytes already held (no wait)
    # the two waits above per shard URL, to name the slowest shard (not in as_dict())
    wait_ns_by_url: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    # the URLs whose wait grew since a DataLoader worker last sent its counters (it empties it)
    waited_urls: set[str] = field(default_factory=set, repr=False, compare=False)

    def as_dict(self) -> dict[str, int]:
        """Returns the counters as a plain dict (without the per-shard waits)."""
        return {k: v for k, v in asdict(self).items() if k not in ("wait_ns_by_url", "waited_urls")}
