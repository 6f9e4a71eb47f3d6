"""Synthetic WebDataset shards for tests, the CLI demo and benchmarks, written the way
real producers write them.

Invariants:
    * Deterministic: the same arguments give byte-identical shards (fixed tar mtime,
      owner and mode; sample order, pixels and payloads all derive from ``seed``).
    * Bucket sizes follow ``skew`` exactly (largest-remainder rounding), not by chance,
      so a test can assert the counts.
    * Shards have uneven lengths, each at least one sample; keys are unique across
      shards (the global sample index, zero-padded).
    * Each shard appears atomically: written to a temporary name in ``out_dir``, then
      renamed, so a reader never sees a half-written shard.
    * A *producer* (:data:`PRODUCERS`) picks the program that writes the tar bytes and so
      the header forms a reader meets; the samples are the same whichever writes them.
      ``webdataset`` (the default) is what ``wds.TarWriter`` writes: a pax header before
      every member. ``tarfile-ustar`` gives plain 512-byte ustar headers: byte for byte
      the shards of versions before producers existed. ``make_*_shards`` write every
      sample's members in extension order (as ``wds.TarWriter`` does), whatever the producer.
    * Local directories only; this module is private (``tools/make_shards.py`` is its CLI).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from wds_pad.errors import ConfigError

from .producers import PRODUCERS, available_producers, check_producer, write_samples

__all__ = ["DEFAULT_RATIOS", "DEFAULT_SKEW", "PRODUCERS", "available_producers", "make_blob_shards",
           "make_image_shards", "make_token_shards", "token_ids", "write_samples"]

#: (width, height) ratios of the synthetic buckets, largest bucket first.
DEFAULT_RATIOS: tuple[tuple[int, int], ...] = ((1, 1), (4, 3), (3, 4), (16, 9), (9, 16))
#: Share of the samples in each ratio's bucket.
DEFAULT_SKEW: tuple[float, ...] = (0.55, 0.25, 0.12, 0.06, 0.02)


def _split_counts(total: int, weights: Sequence[float]) -> list[int]:
    """Split ``total`` in proportion to ``weights`` (largest remainder, ties to the first)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = total * w / w.sum()
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: total - int(counts.sum())]] += 1
    return [int(c) for c in counts]


def _check_layout(
    samples: int, shards: int, ratios: Sequence[tuple[int, int]], skew: Sequence[float]
) -> None:
    for name, value in (("samples", samples), ("shards", shards)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive int, got {value!r}")
    if shards > samples:
        raise ConfigError(f"shards={shards} > samples={samples}: every shard needs at least one sample")
    if not ratios or len(ratios) != len(skew):
        raise ConfigError(
            f"ratios ({len(ratios)}) and skew ({len(skew)}) must be non-empty and of equal length"
        )
    for ratio in ratios:
        if len(ratio) != 2 or not all(isinstance(v, int) and v > 0 for v in ratio):
            raise ConfigError(f"ratio {ratio!r} must be a (width, height) pair of positive ints")
    if any(not (s >= 0) for s in skew) or sum(skew) <= 0:
        raise ConfigError(f"skew {tuple(skew)!r} must be non-negative shares with a positive sum")


def _layout(
    samples: int, shards: int, skew: Sequence[float], rng: np.random.Generator
) -> tuple[np.ndarray, list[int]]:
    """Return the bucket index of every sample (shuffled) and the uneven shard lengths."""
    buckets = np.repeat(np.arange(len(skew)), _split_counts(samples, skew))
    rng.shuffle(buckets)
    # Shard i gets a share growing from 1 to 2 (shuffled), so lengths differ by design.
    weights = rng.permutation(np.linspace(1.0, 2.0, shards)) if shards > 1 else np.ones(1)
    lengths = [c + 1 for c in _split_counts(samples - shards, weights)]  # at least one each
    return buckets, lengths


def _write_shards(
    out_dir: str | os.PathLike[str], lengths: Sequence[int], sample_at: Callable[[int], dict[str, Any]],
    producer: str,
) -> list[str]:
    """Write ``len(lengths)`` shards with consecutive samples; return their paths."""
    check_producer(producer)  # before any sample is made

    def sorted_at(i: int) -> dict[str, Any]:  # members in extension order, as wds.TarWriter writes them
        sample = sample_at(i)
        return {"__key__": sample.pop("__key__"), **dict(sorted(sample.items()))}

    starts = np.cumsum([0, *lengths[:-1]])
    return write_samples(out_dir, [map(sorted_at, range(int(a), int(a) + n)) for a, n in zip(starts, lengths)],
                         producer)


def _image_bytes(width: int, height: int, fmt: str, rng: np.random.Generator) -> bytes:
    from PIL import Image  # only the image generator needs PIL

    base = rng.integers(0, 256, size=3)
    yy, xx = np.mgrid[0:height, 0:width]
    pixels = np.empty((height, width, 3), dtype=np.uint8)
    pixels[..., 0] = (base[0] + 255 * xx // max(width - 1, 1)) % 256  # horizontal ramp
    pixels[..., 1] = (base[1] + 255 * yy // max(height - 1, 1)) % 256  # vertical ramp
    pixels[..., 2] = np.where(((xx // 4) + (yy // 4)) % 2 == 0, base[2], 255 - base[2])  # checkers
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="JPEG" if fmt in ("jpg", "jpeg") else fmt.upper())
    return buf.getvalue()


def make_image_shards(
    out_dir: str | os.PathLike[str],
    *,
    samples: int = 300,
    shards: int = 6,
    seed: int = 0,
    ratios: Sequence[tuple[int, int]] = DEFAULT_RATIOS,
    skew: Sequence[float] = DEFAULT_SKEW,
    formats: Sequence[str] = ("png", "jpg"),
    producer: str = "webdataset",
) -> list[str]:
    """Write small real images in aspect-ratio buckets of skewed sizes.

    Sample ``i`` (key ``f"{i:06d}"``) has an image member ``png`` / ``jpg`` / ``webp``
    (format drawn from ``formats``) of size exactly ``k * ratio`` for an integer ``k``
    (longest side 16..64 pixels, shortest >= 8), with a deterministic ramp-and-checkers
    pattern, and a ``json`` member ``{"width", "height", "label", "ratio", "format",
    "index"}`` where ``ratio`` is ``"W:H"`` of its bucket and ``label`` an int in 0..9.
    Needs Pillow.

    Args:
        out_dir: Local directory, created if missing.
        samples: Total number of samples.
        shards: Number of shards (uneven lengths, at least one sample each).
        seed: Seed of every random choice.
        ratios: (width, height) of each bucket.
        skew: Share of the samples in each bucket, same length as ``ratios``.
        formats: Image formats to draw from: ``png``, ``jpg``, ``jpeg``, ``webp``.
        producer: What writes the tar bytes, one of :data:`PRODUCERS` (see
            :func:`write_samples`); ``tarfile-ustar`` gives plain ustar headers.

    Returns:
        The shard paths, in order.

    Raises:
        ConfigError: An argument is out of range, or an unknown or unavailable producer.
    """
    _check_layout(samples, shards, ratios, skew)
    formats = tuple(formats)
    if not formats or any(f not in ("png", "jpg", "jpeg", "webp") for f in formats):
        raise ConfigError(f"formats {formats!r} must be a non-empty subset of png, jpg, jpeg, webp")
    rng = np.random.default_rng(seed)
    buckets, lengths = _layout(samples, shards, skew, rng)
    fmt_choice = rng.integers(0, len(formats), size=samples)
    longest = rng.integers(24, 65, size=samples)  # target longest side in pixels
    pixel_rng = np.random.default_rng([seed, 1])

    def sample_at(i: int) -> dict[str, Any]:
        rw, rh = ratios[int(buckets[i])]
        k = max(1, int(longest[i]) // max(rw, rh))
        width, height = rw * k, rh * k
        if min(width, height) < 8:  # keep JPEG blocks meaningful for tiny ratios
            k = -(-8 // min(rw, rh))
            width, height = rw * k, rh * k
        fmt = formats[int(fmt_choice[i])]
        meta = {"width": width, "height": height, "label": int(i % 10), "ratio": f"{rw}:{rh}",
                "format": fmt, "index": i}
        return {"__key__": f"{i:06d}", fmt: _image_bytes(width, height, fmt, pixel_rng),
                "json": json.dumps(meta, sort_keys=True).encode()}

    return _write_shards(out_dir, lengths, sample_at, producer)


def make_blob_shards(
    out_dir: str | os.PathLike[str],
    *,
    samples: int,
    sample_bytes: int,
    shards: int,
    seed: int = 0,
    producer: str = "webdataset",
) -> list[str]:
    """Write benchmark shards of random ``.bin`` payloads with aspect metadata.

    Sample ``i`` (key ``f"{i:08d}"``) has a ``bin`` member of ``sample_bytes`` +/- 10%
    random bytes whose first 8 bytes are ``i`` as little-endian uint64 (so a reader can
    check it got the right range), and a ``json`` member ``{"width", "height", "ratio",
    "index", "nbytes"}``; width/height are 64 x a ratio of :data:`DEFAULT_RATIOS`, with
    :data:`DEFAULT_SKEW` bucket sizes, so ``AspectBuckets`` gives skewed buckets.

    Payloads are slices of one random pool at random offsets (not independent draws),
    which keeps 10^4 x 10 KB or 10^3 x 500 KB to well under a second of generation.

    Args:
        out_dir: Local directory, created if missing.
        samples: Total number of samples.
        sample_bytes: Mean payload size in bytes (>= 16).
        shards: Number of shards (uneven lengths, at least one sample each).
        seed: Seed of every random choice.
        producer: What writes the tar bytes, one of :data:`PRODUCERS` (see
            :func:`write_samples`); ``tarfile-ustar`` gives plain ustar headers.

    Returns:
        The shard paths, in order.

    Raises:
        ConfigError: An argument is out of range, or an unknown or unavailable producer.
    """
    _check_layout(samples, shards, DEFAULT_RATIOS, DEFAULT_SKEW)
    if isinstance(sample_bytes, bool) or not isinstance(sample_bytes, int) or sample_bytes < 16:
        raise ConfigError(f"sample_bytes must be an int >= 16, got {sample_bytes!r}")
    rng = np.random.default_rng(seed)
    buckets, lengths = _layout(samples, shards, DEFAULT_SKEW, rng)
    low, high = max(8, int(sample_bytes * 0.9)), max(9, int(sample_bytes * 1.1) + 1)
    sizes = rng.integers(low, high, size=samples)
    pool = rng.bytes(max(1 << 22, 2 * high))
    offsets = rng.integers(0, len(pool) - high, size=samples)

    def sample_at(i: int) -> dict[str, Any]:
        rw, rh = DEFAULT_RATIOS[int(buckets[i])]
        size, start = int(sizes[i]), int(offsets[i])
        payload = i.to_bytes(8, "little") + pool[start + 8 : start + size]
        meta = {"width": 64 * rw, "height": 64 * rh, "ratio": f"{rw}:{rh}", "index": i, "nbytes": size}
        return {"__key__": f"{i:08d}", "bin": payload, "json": json.dumps(meta, sort_keys=True).encode()}

    return _write_shards(out_dir, lengths, sample_at, producer)



def token_ids(i: int, n: int, vocab: int = 256) -> np.ndarray:
    """The tokens of sample ``i`` of :func:`make_token_shards` (``n`` of them): a run that a
    reader can check, starting at ``i mod vocab``, none of them 0 (kept for padding)."""
    return (1 + (i + np.arange(n, dtype=np.int64)) % (vocab - 1)).astype(np.int32)


def make_token_shards(
    out_dir: str | os.PathLike[str],
    *,
    samples: int,
    shards: int,
    seed: int = 0,
    median: float = 40.0,
    longest: int = 256,
    sources: Sequence[str] = ("web", "code"),
    producer: str = "webdataset",
) -> list[str]:
    """Write language-model shards: sample ``i`` has ``tokens.npy`` (int32, :func:`token_ids`),
    ``tokens.bin`` (the same tokens as raw uint16 bytes) and ``json`` ``{"tokens": n,
    "source": ..., "index": i}``; lengths are log-normal around ``median``, 1 .. ``longest``.

    Raises:
        ConfigError: an argument out of range, or an unknown or unavailable producer.
    """
    _check_layout(samples, shards, DEFAULT_RATIOS, DEFAULT_SKEW)
    if isinstance(longest, bool) or not isinstance(longest, int) or longest < 1 or not sources:
        raise ConfigError(f"longest must be an int >= 1 and sources not empty, got {longest!r}, {sources!r}")
    rng = np.random.default_rng(seed)
    lengths_tok = np.clip(np.round(rng.lognormal(np.log(median), 0.9, samples)), 1, longest).astype(np.int64)
    origin = rng.integers(0, len(sources), samples)
    _, lengths = _layout(samples, shards, DEFAULT_SKEW, rng)

    def sample_at(i: int) -> dict[str, Any]:
        tok = token_ids(i, int(lengths_tok[i]))
        buf = io.BytesIO()
        np.save(buf, tok)
        meta = {"tokens": int(tok.size), "source": sources[int(origin[i])], "index": i}
        return {"__key__": f"{i:08d}", "tokens.npy": buf.getvalue(), "tokens.bin": tok.astype("<u2").tobytes(),
                "json": json.dumps(meta, sort_keys=True).encode()}

    return _write_shards(out_dir, lengths, sample_at, producer)
