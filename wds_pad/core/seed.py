"""Seeds and stable RNG derivation (the seed every rank shares is agreed in core/collective.py).

Invariants:
- Every rank of a job uses the same seed: a configured one as is, or one drawn from
  the OS on rank 0 and broadcast (:func:`~wds_pad.core.collective.shared_seed`).
- Every random choice derives from (seed, parts...) through a stable hash (blake2b of
  a canonical, type-tagged encoding): never Python's ``hash()``, the pid or the clock,
  so the same inputs give the same numbers in every process, on every machine, under
  any PYTHONHASHSEED.
- A JSON document's digest (plan fingerprints, state-file checksums, a build part's
  identity) is one rule, :func:`json_digest`: blake2b of its JSON text, with the text's
  options (key order, separators) fixed by each caller, so a saved digest never changes.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Hashable

import numpy as np

from ..errors import ConfigError

__all__ = ["MAX_SEED", "check_seed", "derive_rng", "derive_seed", "encode_key", "json_digest",
           "stable_digest"]

SEED_BITS = 63
#: The largest seed accepted anywhere (API and CLI): seeds are unsigned 64-bit integers.
MAX_SEED = 2**64 - 1


def encode_key(part: Hashable) -> bytes:
    """Canonical, type-tagged bytes for a seed part or bucket key.

    Supports None, bool, int, float, str, bytes and tuples of those. Equal values of
    different types (``1`` and ``"1"``) encode differently.
    """
    if part is None:
        return b"N"
    if isinstance(part, bool):
        return b"B1" if part else b"B0"
    if isinstance(part, (int, np.integer)):
        return b"I" + str(int(part)).encode() + b";"
    if isinstance(part, (float, np.floating)):
        return b"F" + float(part).hex().encode() + b";"
    if isinstance(part, str):
        raw = part.encode("utf-8")
        return b"S" + str(len(raw)).encode() + b":" + raw
    if isinstance(part, bytes):
        return b"Y" + str(len(part)).encode() + b":" + part
    if isinstance(part, tuple):
        return b"T" + str(len(part)).encode() + b"(" + b"".join(encode_key(p) for p in part) + b")"
    raise ConfigError(
        f"cannot derive a stable key from {type(part).__name__} {part!r}; "
        "use str, int, float, bytes or tuples of them"
    )


def stable_digest(*parts: Hashable, size: int = 16) -> bytes:
    """blake2b digest of the canonical encoding of ``parts``."""
    h = hashlib.blake2b(digest_size=size)
    for p in parts:
        h.update(encode_key(p))
    return h.digest()


def json_digest(value: Any, size: int = 16, *, sort_keys: bool = True, compact: bool = False,
                allow_nan: bool = True) -> str:
    """The hex blake2b digest (``size`` bytes) of ``value`` as JSON text.

    Args:
        value: a JSON-safe value.
        size: digest bytes (the hex string is twice as long).
        sort_keys: write mapping keys sorted (``json.dumps(sort_keys=...)``).
        compact: separators ``","`` and ``":"`` instead of json's default ``", "`` and ``": "``.
        allow_nan: as ``json.dumps``; False raises ValueError on NaN or infinity.

    Each caller keeps the options its saved digests were made with: the text, hence the
    digest, is exactly what ``json.dumps`` writes with them.
    """
    text = json.dumps(value, sort_keys=sort_keys, separators=(",", ":") if compact else None, allow_nan=allow_nan)
    return hashlib.blake2b(text.encode(), digest_size=size).hexdigest()


def derive_seed(seed: int, *parts: Hashable) -> int:
    """A 64-bit integer derived from ``seed`` and ``parts`` through a stable hash."""
    return int.from_bytes(stable_digest(int(seed), *parts, size=8), "little")


def derive_rng(seed: int, *parts: Hashable) -> np.random.Generator:
    """An explicit numpy Generator for (seed, parts...), e.g. (seed, epoch, dataset, bucket, purpose)."""
    digest = stable_digest(int(seed), *parts, size=16)
    entropy = [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


def check_seed(seed: Any) -> int:
    """``seed`` as a Python int, or a ConfigError: not an int (a bool is not), or outside
    ``[0, 2**64)``. The one rule for every entry point (``shared_seed``, ``plan_epoch``,
    the loaders and ``wds-pad ... --seed``), so the CLI and the API accept the same seeds."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ConfigError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    seed = int(seed)
    if not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"seed must be in [0, 2**64), got {seed}; pick a seed between 0 and {MAX_SEED}")
    return seed
