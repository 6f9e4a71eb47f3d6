#!/usr/bin/env python3
"""Write a synthetic wds_pad index (format version 2) without any tar file, for scale work.

Examples::

    python tools/make_index.py --samples 100000000 --shards 10000 --buckets 1000 -o /tmp/big.wdsidx
    python tools/make_index.py --samples 1e6 --shards 100 --buckets 20 --key-kind int -o /tmp/small.wdsidx
    python tools/make_index.py --samples 1e8 --shards 10000 --buckets 1000 --cost tokens -o /tmp/costs.wdsidx

What it writes (deterministic for a given ``--seed``):

- bucket sizes drawn log-normal (sigma ``--sigma``, every bucket at least one sample),
  keys aspect ratios (``"0.500"``, ``"0.501"``, ... as ``--bucket-by aspect --step``
  labels them) or ints (a ``json:FIELD`` of integer values);
- each bucket's samples spread over the shards by a multinomial draw (shards of about
  ``samples / shards`` samples each), three members per sample (``jpg`` or, for about
  3 %, ``png``; ``json``; ``txt``), so a sample's length is three 512-byte tar headers
  plus each member's payload padded to 512 bytes (the image's size log-normal around
  ``--image-kb``);
- offsets as a tar lays them out: 512-aligned, the samples of a shard back to back
  from byte 0 (each starts where the previous one ends), the shard's size their end plus
  the 1,024-byte end-of-archive marker rounded up to tar's 10,240-byte record. Inside a
  shard the samples are laid out bucket by bucket (as if the shard had been written
  sorted by bucket): that is what lets the generator stream the rows, which the format
  groups by bucket, holding O(shards) state instead of every sample;
- keys ``<shard><position in shard>`` in decimal, zero-padded to ``--key-width``
  characters (default: the width they need, at least 9), increasing inside a shard;
- the member table (each sample's members in archive order, their extensions and
  payload sizes, consistent with its length), as ``wds-pad index`` records it for
  plain tar headers; ``--no-members`` leaves it out;
- with ``--cost tokens``, each sample's token count (as ``wds-pad index --cost
  json:tokens`` records it): log-normal around ``--cost-median`` (sigma
  ``--cost-sigma``), whole numbers in [1, ``--cost-max``], and each bucket's cost order.
  The counts are drawn from a table of 65,536 values, so the column's width is known
  before any row is made and a bucket's order is one stable sort of 16-bit values
  (numpy's radix sort): held one bucket at a time.

The file loads with ``load_index`` (digest verified), and ``wds-pad inspect`` and
``wds-pad plan`` work on it; ``wds-pad verify`` reports its shards missing, as there are
none. Memory: the bucket x shard count table (2 bytes a cell) and one chunk of rows;
every section is produced twice (once for the digest, once for the bytes) and streamed
to the file through ``wds_pad.io.atomic.atomic_write``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator

import numpy as np

try:
    import wds_pad  # noqa: F401
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from wds_pad.errors import ConfigError, WdsPadError
from wds_pad.index.codec import columns_parts
from wds_pad.index.layout import narrowest_int, plain_offsets
from wds_pad.index.record import ShardInfo
from wds_pad.io.atomic import atomic_write

__all__ = ["SyntheticIndex", "bucket_sizes", "main"]

EXTS = ("jpg", "json", "png", "txt")  # the extension table (sorted, as a build writes it)
_JPG, _JSON, _PNG, _TXT = (1 << i for i in range(4))
_JPG_ORDER, _PNG_ORDER = np.array([0, 1, 3], np.uint8), np.array([1, 2, 3], np.uint8)  # members' EXTS indices, in archive order
CHUNK = 1 << 21  # rows per chunk: a few tens of MB of temporaries
_TABLE = 1 << 16  # lengths are drawn from a table of this many log-normal sample sizes
_RECORD = 10240  # tar's record: an archive's size is a multiple of it


def bucket_sizes(total: int, buckets: int, sigma: float = 1.5, seed: int = 0) -> np.ndarray:
    """Skewed bucket sizes: log-normal weights, at least one sample each, summing to ``total``."""
    if buckets < 1 or total < buckets:
        raise ConfigError(f"--samples {total} must be at least --buckets {buckets} (>= 1): every bucket holds a sample")
    w = np.random.default_rng([seed, 1]).lognormal(0.0, sigma, size=buckets)
    sizes = 1 + np.floor(w / w.sum() * (total - buckets)).astype(np.int64)
    sizes[np.argmax(sizes)] += total - int(sizes.sum())
    return sizes


def _bucket_keys(buckets: int, kind: str) -> tuple[list[Hashable], dict[str, Any], float | None]:
    """The bucket table in canonical order and its ``bucket_by`` record."""
    if kind == "int":
        return list(range(buckets)), {"kind": "json", "member": "json", "field": "length", "boundaries": None}, None
    decimals = max(3, len(str(buckets)))  # labels "0.500", "0.501", ...: all < 10, so str order is numeric
    step = 10.0 ** -decimals
    first = round(0.5 / step)
    keys = [f"{(first + k) * step:.{decimals}f}" for k in range(buckets)]
    return keys, {"kind": "aspect", "member": "json", "width_field": "width", "height_field": "height",
                  "ratios": None, "step": step}, step


class SyntheticIndex:
    """The rows of a synthetic index, as chunk producers for ``columns_parts``.

    Rows are grouped by bucket, then shard, then byte order. Per shard a byte cursor and
    a sample cursor advance bucket by bucket, so every producer walks the same chunks in
    the same order and sees the same values: chunk ``c`` of bucket ``b`` draws its lengths
    and extension masks from an RNG seeded with ``(seed, b, c)``.
    """

    def __init__(self, samples: int, shards: int, buckets: int, *, seed: int = 0, key_width: int | None = None,
                 key_kind: str = "aspect", sigma: float = 1.5, image_kb: float = 40.0, name: str = "synthetic",
                 chunk: int = CHUNK, members: bool = True, cost: str | None = None, cost_median: float = 512.0,
                 cost_sigma: float = 1.0, cost_max: int = 32767) -> None:
        if shards < 1 or shards > 2**31 - 1:
            raise ConfigError(f"--shards must be in [1, 2**31), got {shards}")
        self.n, self.shards, self.seed, self.name, self.chunk = int(samples), int(shards), int(seed), name, int(chunk)
        self.sizes = bucket_sizes(self.n, buckets, sigma, seed)
        self.keys, self.bucket_by, _ = _bucket_keys(buckets, key_kind)
        rng = np.random.default_rng([seed, 2])
        # the bucket x shard counts: each bucket's samples spread uniformly over the shards
        per_shard = np.full(self.shards, 1.0 / self.shards)
        counts = np.stack([rng.multinomial(int(c), per_shard) for c in self.sizes]) if self.shards > 1 else \
            self.sizes[:, None]
        self.shard_samples = counts.sum(axis=0, dtype=np.int64)
        cell = np.uint16 if int(counts.max()) < 2**16 else np.uint32
        self.counts = counts.astype(cell)
        del counts
        # sample lengths: 3 tar headers + jpg/png (log-normal) + json + txt, each padded to 512
        image = np.ceil(np.minimum(rng.lognormal(math.log(image_kb * 1024), 0.6, _TABLE), 64 * 2**20)).astype(np.int64)
        js = rng.integers(200, 900, _TABLE)
        txt = rng.integers(20, 600, _TABLE)
        pad = lambda x: -(-x // 512) * 512  # noqa: E731
        self.length_table = (3 * 512 + pad(image) + pad(js) + pad(txt)).astype(np.int32)
        # the member table's payload sizes, in archive order: image, json, txt (a png sample: json, png, txt)
        self.members = members
        # (rows 0.._TABLE-1 for a jpg sample, _TABLE.. for a png one: one gather either way)
        self.size_table = np.concatenate([np.stack([image, js, txt], axis=1),
                                          np.stack([js, image, txt], axis=1)]).astype(np.int32)
        self.pos_digits = len(str(max(int(self.shard_samples.max()) - 1, 0)))
        need = len(str(self.shards - 1)) + self.pos_digits
        self.key_width = max(9, need) if key_width is None else int(key_width)
        if self.key_width < need:
            raise ConfigError(f"--key-width {key_width} is too narrow: keys <shard><position> of {self.shards} "
                              f"shards of up to {int(self.shard_samples.max())} samples need {need} digits")
        self.cost = cost
        if cost is not None:
            if cost != "tokens":
                raise ConfigError(f"--cost {cost!r}: the generator draws 'tokens' only")
            if not 1 <= cost_max <= 2**31 - 1 or not cost_median > 0 or not cost_sigma >= 0:
                raise ConfigError("--cost-max must be in [1, 2**31), --cost-median > 0 and --cost-sigma >= 0")
            draws = np.random.default_rng([seed, 6]).lognormal(math.log(cost_median), cost_sigma, _TABLE)
            self.cost_table = np.clip(np.rint(draws), 1, cost_max).astype(narrowest_int(int(cost_max)))
        self.bounds = np.zeros(buckets + 1, dtype=np.int64)
        np.cumsum(self.sizes, out=self.bounds[1:])
        # one walk over the lengths: the shard table's sizes and the largest offset
        ends = np.zeros(self.shards, dtype=np.int64)
        self.max_offset = 0
        for ch in self._chunks():
            self.max_offset = max(self.max_offset, int(ch["last_offset"].max()))
            ends = ch["cursor"]
        self.max_length = int(self.length_table.max())  # the column's width: as the largest drawn
        self.shard_bytes = -(-(ends + 1024) // _RECORD) * _RECORD

    # -- the rows, chunk by chunk -----------------------------------------------------------
    def _chunks(self, *need: str) -> Iterator[dict[str, Any]]:
        """Per chunk (whole cells of one bucket, at most ``chunk`` rows unless one cell is
        larger) the columns in ``need`` ("shard", "offset", "length", "exts", "position"
        in shard, "member_ext", "member_size", "cost"); always ``bucket``, ``cells``/
        ``cell_rows`` (its shards and their rows); with no ``need``, or offsets or lengths, ``last_offset`` (each
        cell's last offset) and ``cursor`` (each shard's byte cursor after it)."""
        cursor = np.zeros(self.shards, dtype=np.int64)  # next free byte of each shard
        placed = np.zeros(self.shards, dtype=np.int64)  # samples already in each shard
        sdt = np.int16 if self.shards <= 2**15 else np.int32
        for b in range(len(self.sizes)):
            cells = self.counts[b]
            nz = np.flatnonzero(cells)
            cnt = cells[nz].astype(np.int64)
            ccum = np.cumsum(cnt)
            lo, c = 0, 0
            while lo < nz.size:
                base = int(ccum[lo - 1]) if lo else 0
                hi = max(int(np.searchsorted(ccum, base + self.chunk, side="right")), lo + 1)
                sh, k = nz[lo:hi], cnt[lo:hi]
                rows = int(ccum[hi - 1]) - base
                first = np.zeros(sh.size, dtype=np.int64)  # each cell's first row in the chunk
                np.cumsum(k[:-1], out=first[1:])
                last = first + k - 1
                out: dict[str, Any] = {"cells": sh, "cell_rows": k, "bucket": b}
                if "cost" in need:  # per sample its token count, a draw from the cost table
                    pick = np.random.default_rng([self.seed, 5, b, c]).integers(0, _TABLE, rows, dtype=np.uint16)
                    out["cost"] = self.cost_table[pick]
                if "shard" in need:
                    out["shard"] = np.repeat(sh.astype(sdt), k)
                if "position" in need:
                    out["position"] = np.repeat(placed[sh] - first, k) + np.arange(rows, dtype=np.int64)
                if {"exts", "member_size", "member_ext"} & set(need):
                    png = np.random.default_rng([self.seed, 4, b, c]).integers(0, 256, rows, dtype=np.uint8) < 8
                    out["exts"] = np.where(png, np.uint8(_PNG | _JSON | _TXT), np.uint8(_JPG | _JSON | _TXT))
                draw_len = np.random.default_rng([self.seed, 3, b, c]).integers(0, _TABLE, rows, dtype=np.uint16)
                if "member_size" in need:  # per sample its 3 members' payload sizes, in archive order
                    out["member_size"] = self.size_table[draw_len + png.astype(np.int32) * _TABLE].ravel()
                if "member_ext" in need:
                    out["member_ext"] = np.where(png[:, None], _PNG_ORDER, _JPG_ORDER).ravel()
                if not need or "offset" in need or "length" in need:  # the byte layout
                    ln = self.length_table[draw_len]
                    ends = np.cumsum(ln, dtype=np.int64)
                    shift = cursor[sh] - (ends[first] - ln[first])  # a row's offset: its cell's shift + ends - ln
                    if "length" in need:
                        out["length"] = ln
                    if "offset" in need:
                        out["offset"] = np.repeat(shift, k) + (ends - ln)
                    out["last_offset"] = shift + ends[last] - ln[last]
                    cursor[sh] = shift + ends[last]
                placed[sh] += k
                out["cursor"] = cursor
                yield out
                lo, c = hi, c + 1

    def _column(self, k: str) -> Iterator[np.ndarray]:
        for ch in self._chunks(k):
            yield ch[k]

    def _members(self, k: str) -> Iterator[np.ndarray]:
        for ch in self._chunks(k):
            yield ch[k]

    def _cost_order(self) -> Iterator[np.ndarray]:
        """Each bucket's rows in cost order (equal costs by row id), as offsets in the bucket:
        the bucket's costs gathered from its chunks, one stable sort."""
        held: list[np.ndarray] = []
        bucket = 0
        for ch in itertools.chain(self._chunks("cost"), [{"bucket": len(self.sizes), "cost": None}]):
            if ch["bucket"] != bucket and held:
                yield np.argsort(np.concatenate(held), kind="stable")
                held = []
            bucket = ch["bucket"]
            if ch["cost"] is not None:
                held.append(ch["cost"])

    def _member_offsets(self) -> Iterator[np.ndarray]:
        """Payload offsets from each sample's first byte: plain headers, back to back."""
        for sizes in self._members("member_size"):
            yield plain_offsets(sizes, np.full(sizes.size // 3, 3, np.int64))

    def _member_start(self) -> Iterator[np.ndarray]:
        for lo in range(0, self.n + 1, self.chunk):
            yield np.arange(lo, min(lo + self.chunk, self.n + 1), dtype=np.int64) * 3

    def _key_offsets(self) -> Iterator[np.ndarray]:
        w = self.key_width
        for lo in range(0, self.n + 1, self.chunk):
            yield np.arange(lo, min(lo + self.chunk, self.n + 1), dtype=np.int64) * w

    def _keys(self) -> Iterator[np.ndarray]:
        # a key is the digits of its shard (zero-padded) then of its position: two table lookups
        pd, ws = self.pos_digits, self.key_width - self.pos_digits
        # (each table row one fixed-size void scalar: a gather copies whole keys' halves)
        shard_digits = _digits(np.arange(self.shards, dtype=np.int64), ws).view(f"V{ws}").ravel()
        pos_digits = _digits(np.arange(max(int(self.shard_samples.max()), 1), dtype=np.int64), pd).view(f"V{pd}").ravel()
        row = np.dtype([("shard", f"V{ws}"), ("position", f"V{pd}")])
        for ch in self._chunks("shard", "position"):
            out = np.empty(ch["shard"].size, dtype=row)
            out["shard"] = shard_digits[ch["shard"]]
            out["position"] = pos_digits[ch["position"]]
            yield out.view(np.uint8)

    # -- the file ------------------------------------------------------------------------------
    def shard_table(self, prefix: str = "synthetic/shard-") -> list[ShardInfo]:
        digits = max(6, len(str(self.shards - 1)))
        return [ShardInfo(url=f"{prefix}{s:0{digits}d}.tar", size=int(size), stamp="synthetic", samples=int(n))
                for s, (size, n) in enumerate(zip(self.shard_bytes.tolist(), self.shard_samples.tolist()))]

    def parts(self) -> Iterator[bytes | memoryview]:
        """The bytes of the index file, in order."""
        producers: dict[str, Callable[[], Any]] = {
            "bucket_offsets": lambda: [self.bounds],
            "shard": lambda: self._column("shard"), "offset": lambda: self._column("offset"),
            "length": lambda: self._column("length"), "exts": lambda: self._column("exts"),
            "key_offsets": self._key_offsets, "keys": self._keys,
        }
        table: dict[str, Any] = {}
        if self.members:
            producers.update(member_start=self._member_start, member_ext=lambda: self._members("member_ext"),
                             member_size=lambda: self._members("member_size"), member_offset=self._member_offsets)
            # plain headers: the last member's payload starts after two padded payloads and three headers
            most = 3 * 512 + 2 * int(((self.size_table + 511) & ~511).max())
            table = {"members": 3 * self.n, "max_member_size": int(self.size_table.max()), "max_member_offset": most}
        if self.cost is not None:
            producers.update(cost=lambda: self._column("cost"), cost_order=self._cost_order)
            table["cost"] = ("json:tokens", self.cost_table.dtype, narrowest_int(max(int(self.sizes.max()) - 1, 0)))
        excluded = {"samples": [], "shards": [], "count": 0}
        return columns_parts(self.name, self.shard_table(), self.keys, self.bucket_by, EXTS, excluded, producers,
                             samples=self.n, key_bytes=self.n * self.key_width, max_offset=self.max_offset,
                             max_length=self.max_length, **table)

    def write(self, path: str) -> str:
        """Write the index to ``path`` atomically; returns ``path``."""
        return atomic_write(path, self.parts())


def _digits(values: np.ndarray, width: int) -> np.ndarray:
    """The decimal digits of ``values`` as ASCII, zero-padded to ``width``: shape (len, width)."""
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    return np.ascontiguousarray(((values[:, None] // powers) % 10 + ord("0")).astype(np.uint8))


def _count(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count such as 100000000 or 1e8, got {text!r}") from None
    if value != int(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole count >= 0, got {text!r}")
    return int(value)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=_count, required=True, help="samples in total (1e8 allowed)")
    p.add_argument("--shards", type=_count, required=True, help="number of shards")
    p.add_argument("--buckets", type=_count, required=True, help="number of buckets (log-normal sizes)")
    p.add_argument("-o", "--output", required=True, help="index file to write")
    p.add_argument("--seed", type=int, default=0, help="seed of every random draw (default 0)")
    p.add_argument("--key-width", type=int, default=None, help="characters per sample key (default: as needed, >= 9)")
    p.add_argument("--key-kind", choices=("aspect", "int"), default="aspect",
                   help="bucket keys: aspect-ratio labels (default) or ints")
    p.add_argument("--sigma", type=float, default=1.5, help="log-normal sigma of the bucket sizes (default 1.5)")
    p.add_argument("--image-kb", type=float, default=40.0, help="median image payload in KB (default 40)")
    p.add_argument("--name", default=None, help="dataset name (default: the output file stem)")
    p.add_argument("--no-members", action="store_true", help="leave out the optional member table")
    p.add_argument("--cost", choices=("tokens",), default=None,
                   help="also write costs: per sample a log-normal token count (as --cost json:tokens records it)")
    p.add_argument("--cost-median", type=float, default=512.0, help="--cost tokens: the median count (default 512)")
    p.add_argument("--cost-sigma", type=float, default=1.0, help="--cost tokens: log-normal sigma (default 1.0)")
    p.add_argument("--cost-max", type=int, default=32767, help="--cost tokens: the largest count (default 32767)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    t = time.perf_counter()
    try:
        synth = SyntheticIndex(args.samples, args.shards, args.buckets, seed=args.seed, key_width=args.key_width,
                               key_kind=args.key_kind, sigma=args.sigma, image_kb=args.image_kb,
                               name=args.name or Path(args.output).stem, members=not args.no_members,
                               cost=args.cost, cost_median=args.cost_median, cost_sigma=args.cost_sigma,
                               cost_max=args.cost_max)
        synth.write(args.output)
    except WdsPadError as exc:
        print(f"make_index: {exc}", file=sys.stderr)
        return 2
    size = Path(args.output).stat().st_size
    print(f"make_index: wrote {args.samples:,} samples, {args.shards:,} shards, {args.buckets:,} buckets, "
          f"{size / 2**20:,.1f} MiB ({size / max(args.samples, 1):.1f} B/sample) in {time.perf_counter() - t:.1f} s "
          f"-> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
