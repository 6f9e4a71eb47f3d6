#!/usr/bin/env python3
"""Write synthetic WebDataset shards for demos, tests and benchmarks.

Examples::

    python tools/make_shards.py images /tmp/wds-demo --samples 300 --shards 6
    python tools/make_shards.py blobs /tmp/wds-bench --samples 10000 --sample-bytes 10000 --shards 10
    python tools/make_shards.py blobs /tmp/wds-ustar --producer tarfile-ustar
    python tools/make_shards.py tokens /tmp/wds-tokens --samples 1000 --shards 10

``images``: small real PNG/JPEG images in aspect-ratio buckets of skewed sizes, each with
a ``.json`` holding width/height/label. ``blobs``: random ``.bin`` payloads of about
``--sample-bytes`` with a ``.json`` holding width/height. ``tokens``: token samples
(``tokens.npy``, the same as raw uint16 ``tokens.bin``) of log-normal lengths with a
``.json`` holding ``tokens`` and ``source`` (docs/packing.md). Output is deterministic for a
given ``--seed``. ``--producer`` picks what writes the tar bytes, as real datasets are
made: ``webdataset`` (default: ``wds.TarWriter``, a pax header per member),
``wds-shardwriter``, ``tarfile-pax``/``-gnu``/``-ustar`` (Python's tarfile),
``gnutar-posix``/``-gnu``/``-ustar`` (the GNU ``tar`` binary); ``tarfile-ustar`` gives
plain 512-byte ustar headers. Prints one shard path per line, then a summary line on stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

try:
    from wds_pad.cli import synth as _synth
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from wds_pad.cli import synth as _synth

from wds_pad.errors import WdsPadError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("kind", choices=("images", "blobs", "tokens"), help="what to write")
    parser.add_argument("out_dir", help="local output directory (created if missing)")
    parser.add_argument(
        "--samples", type=int, default=None, help="samples in total (images: 300, blobs: 1000)"
    )
    parser.add_argument("--shards", type=int, default=None, help="number of shards (images: 6, blobs: 10)")
    parser.add_argument("--sample-bytes", type=int, default=10_000, help="blobs: mean payload bytes (10000)")
    parser.add_argument("--formats", default="png,jpg", help="images: comma-separated png,jpg,webp (png,jpg)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice (0)")
    parser.add_argument("--producer", choices=_synth.PRODUCERS, default="webdataset",
                        help="what writes the tar bytes (webdataset)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return the process exit code."""
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    try:
        if args.kind == "images":
            paths = _synth.make_image_shards(
                args.out_dir,
                samples=300 if args.samples is None else args.samples,
                shards=6 if args.shards is None else args.shards,
                seed=args.seed,
                formats=tuple(f.strip() for f in args.formats.split(",")),
                producer=args.producer,
            )
        elif args.kind == "tokens":  # tokens.npy / tokens.bin and a .json with tokens and source
            paths = _synth.make_token_shards(
                args.out_dir,
                samples=1000 if args.samples is None else args.samples,
                shards=10 if args.shards is None else args.shards,
                seed=args.seed,
                producer=args.producer,
            )
        else:
            paths = _synth.make_blob_shards(
                args.out_dir,
                samples=1000 if args.samples is None else args.samples,
                sample_bytes=args.sample_bytes,
                shards=10 if args.shards is None else args.shards,
                seed=args.seed,
                producer=args.producer,
            )
    except (WdsPadError, OSError) as exc:
        print(f"make_shards: error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    size = sum(Path(p).stat().st_size for p in paths)
    print(
        f"make_shards: wrote {len(paths)} {args.kind} shards ({args.producer}), {size / 1e6:.1f} MB, "
        f"in {time.perf_counter() - start:.2f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
