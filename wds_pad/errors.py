"""One exception hierarchy for wds_pad.

Every error the library raises on purpose is a :class:`WdsPadError`. Each subclass also
inherits the builtin that fits (``ValueError`` for bad configuration or data,
``OSError`` for I/O), so callers that already catch builtins keep working.

A message names the thing at fault (shard URL, byte offset, rank, state field), says
what was expected, and how to fix it. This module imports nothing of ours.
"""

from __future__ import annotations

__all__ = [
    "BucketError",
    "ConfigError",
    "DroppedBucketWarning",
    "IndexFormatError",
    "ReadError",
    "SeedError",
    "ShardError",
    "SharedMemoryWarning",
    "StaleShardError",
    "StateError",
    "StateMismatchError",
    "TarFormatError",
    "TopologyError",
    "TopologyMismatchError",
    "WdsPadError",
    "WorkerStartError",
    "WorkerStartWarning",
    "WriteError",
]


class WdsPadError(Exception):
    """Base class of every error wds_pad raises on purpose."""


class ConfigError(WdsPadError, ValueError):
    """A wrong argument or an invalid combination of arguments."""


class TopologyError(ConfigError):
    """An impossible topology (rank out of range, world size not divisible by cp_size, ...)."""


class SeedError(WdsPadError, RuntimeError):
    """The shared seed could not be agreed on by every rank."""


class ShardError(WdsPadError, OSError):
    """A shard is missing, unreadable, or not what the index says it is."""


class TarFormatError(ShardError, ValueError):
    """A shard is not a valid tar archive (bad checksum, truncated, not a tar)."""


class StaleShardError(ShardError):
    """A shard changed since it was indexed (size, change stamp or content differ)."""


class ReadError(WdsPadError, OSError):
    """A byte-range read failed permanently or timed out after its retries."""


class WriteError(WdsPadError, OSError):
    """A file wds_pad writes (an index) could not be written: no space left, a read-only
    filesystem, a store that refuses the upload. Nothing was half-written."""


class BucketError(WdsPadError, ValueError):
    """A bucket-key function failed or the data it needs is malformed."""


class IndexFormatError(WdsPadError, ValueError):
    """An index file is missing, of another format version, or damaged."""


class StateError(WdsPadError, ValueError):
    """A saved loader state is corrupt, truncated or of an unknown version."""


class StateMismatchError(StateError):
    """A saved state belongs to another plan (fingerprint, mode or dataset differ)."""


class TopologyMismatchError(StateMismatchError):
    """A saved state belongs to another topology (world size, rank, dp or cp layout)."""


class WorkerStartError(WdsPadError, RuntimeError):
    """A DataLoader worker did not start (stuck in the fork) in every attempt."""


class WorkerError(WdsPadError, RuntimeError):
    """A DataLoader worker died while the loop ran (killed by a signal, out of memory, crashed)."""


class WorkerStartWarning(UserWarning):
    """A DataLoader worker stuck in the fork was replaced (the plan continues exactly)."""


class SharedMemoryWarning(UserWarning):
    """Shared memory (``/dev/shm``) ran out: a Loader's batches cross through the pipe instead."""


class DroppedBucketWarning(UserWarning):
    """A bucket was too small to fill one global step and was left out of the epoch."""
