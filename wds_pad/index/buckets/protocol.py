"""The bucket-function protocol: what the indexer calls, and what it may return.

The indexer scans each sample's tar headers and reads only the members a bucket
function asks for (``members``), optionally only their first ``head_bytes`` bytes, then
calls ``fn(key, data)`` with ``data = {extension: raw bytes}``. The result is the
sample's bucket key, or ``None`` to exclude the sample from the index.

Invariants:
    * Bucket keys are JSON-safe scalars: ``str``, ``int`` or finite ``float`` (never
      ``bool``); :func:`check_bucket_key` enforces it and normalises numpy scalars.
    * A bucket function is a pure function of ``(key, data)``: no I/O, no clock, no
      randomness, so every rank and every re-index computes the same keys.
    * ``describe()`` returns a JSON-safe dict that says how the buckets were computed;
      it is stored in the index.
    * Bad configuration raises :class:`ConfigError` at construction; bad sample data
      raises :class:`BucketError` naming the sample key and the field or member at
      fault (the indexer adds the shard URL and byte offset).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Mapping
from typing import Any, Protocol, runtime_checkable

from ...errors import BucketError, ConfigError

__all__ = ["BucketFn", "BucketKey", "check_bucket_key"]

BucketKey = str | int | float


@runtime_checkable
class BucketFn(Protocol):
    """What the indexer needs from a bucket-key function.

    Attributes:
        members: Member extensions whose bytes are needed (``()`` for none). For a
            tuple of image extensions, the indexer passes the first present one.
        head_bytes: Read only the first N bytes of those members (``None``: whole).
    """

    members: tuple[str, ...]
    head_bytes: int | None

    def __call__(self, key: str, data: Mapping[str, bytes]) -> Hashable | None:
        """Return the sample's bucket key, or ``None`` to exclude the sample."""
        ...

    def describe(self) -> dict[str, Any]:
        """Return a JSON-safe description of how buckets are computed."""
        ...


def check_bucket_key(value: object, key: str) -> BucketKey | None:
    """Validate a bucket key returned for sample ``key``; return it normalised.

    ``numpy`` integers and floats become ``int`` / ``float``. ``None`` passes through.

    Raises:
        BucketError: ``value`` is not a str, int or finite float (``bool`` is refused
            because a keep/drop predicate passed by mistake would return one).
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BucketError(
            f"sample {key!r}: bucket key {value!r} of type {type(value).__name__} is not "
            "a str, int or float; return one of those (or None to exclude the sample)"
        )
    if isinstance(value, numbers.Integral):
        return int(value)
    if not math.isfinite(float(value)):
        raise BucketError(f"sample {key!r}: bucket key {value!r} is not finite (not JSON-safe)")
    return float(value)


def check_member(name: str, what: str) -> None:
    if not isinstance(name, str) or not name or name.startswith("."):
        raise ConfigError(f"{what} must be a member extension like 'json', got {name!r}")
