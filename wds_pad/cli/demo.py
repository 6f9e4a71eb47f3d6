"""``wds-pad demo``: the main job end to end on a generated dataset.

Generates a few hundred real PNG/JPEG images of several aspect ratios with JSON
metadata as tar shards (skewed bucket sizes, uneven shards), indexes them into aspect
buckets, streams every rank of a simulated job (8 ranks, context-parallel size 2),
decodes the images, prints per rank: batches, buckets visited, padded copies; checks
the invariants on the spot, and writes a picture of the per-bucket padding.

Exits 0 if and only if every invariant held; torch and PIL are imported only when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from .common import positive_int, print_summary, seed_arg, bucket_order, format_table
from .plot import draw_buckets

__all__ = ["add_parser", "run_demo"]


def add_parser(sub: Any) -> None:
    """Register the ``demo`` subcommand."""
    p = sub.add_parser("demo", help="run the main job end to end on a generated dataset")
    p.add_argument("--out", default="demo-out", help="directory for the generated data and plot")
    p.add_argument("--world-size", type=positive_int, default=8)
    p.add_argument("--cp-size", type=positive_int, default=2)
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--seed", type=seed_arg, default=1234)
    p.add_argument("--samples", type=positive_int, default=400, help="images to generate")
    p.add_argument("--shards", type=positive_int, default=8, help="shards to write them into")
    p.set_defaults(func=run_demo)


def _make_folder(path: str) -> None:
    """Make the demo's output folder (``--out``), or say why it cannot be used.

    Raises:
        WriteError: it cannot be made, is a file, or does not take new files.
    """
    from ..errors import WriteError

    if os.path.exists(path) and not os.path.isdir(path):
        raise WriteError(f"the demo's output folder {path!r} is a file; give a folder with --out "
                         "(made if missing)")
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(f"{path!r} does not take new files")
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise WriteError(f"the demo's output folder {path!r} cannot be used ({reason}); "
                         "give a writable folder with --out") from exc


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; 0 if every invariant held on the spot, else 1."""
    import warnings

    from .synth import make_image_shards
    from ..stream.dataset import BucketedWebDataset
    from ..stream.loader import Loader
    from ..index.build import build_index
    from ..core.topology import Topology

    out = sys.stdout
    world, cp, bs = args.world_size, args.cp_size, args.batch_size
    Topology(world_size=world, rank=0, cp_size=cp)  # a layout that cannot be, refused before anything is made
    _make_folder(args.out)
    shard_dir = os.path.join(args.out, "shards")
    index_path = os.path.join(args.out, "images.wdsidx")
    t0 = time.perf_counter()
    urls = make_image_shards(shard_dir, samples=args.samples, shards=args.shards, seed=args.seed % 1000)
    out.write(f"1. generated {args.samples} images in {len(urls)} shards under {shard_dir} "
              f"({time.perf_counter() - t0:.2f} s)\n")
    t0 = time.perf_counter()
    index = build_index(urls, "aspect:width,height", output=index_path, progress=None)
    counts = index.bucket_counts()
    out.write(f"2. indexed into {len(counts)} aspect buckets -> {index_path} ({time.perf_counter() - t0:.2f} s): "
              + ", ".join(f"{k}={counts[k]}" for k in bucket_order(counts)) + "\n")
    datasets = []
    for rank in range(world):
        ds = BucketedWebDataset(index, batch_size=bs, topology=Topology(world_size=world, rank=rank, cp_size=cp),
                                seed=args.seed, oversubscribe=True, check_agreement=False)
        datasets.append(ds.decode("pil").to_tuple("png;jpg", "json", "__bucket__", "__pad__", "__key__"))
    out.write(f"3. plan for world size {world}, cp size {cp} (dp size {world // cp}), batch size {bs}:\n\n")
    print_summary(datasets[0].plan(), out)
    out.write("\n4. streaming every rank (decoding images, checking sizes against their JSON):\n\n")
    streams: list[list[tuple[Any, list[str]]]] = []
    rows = []
    t0 = time.perf_counter()
    for rank, ds in enumerate(datasets):
        batches, buckets, padded, decoded = [], set(), 0, 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for images, metas, bucket_col, pads, keys in Loader(ds, num_workers=0):
                for img, meta in zip(images, metas):
                    if img.size != (meta["width"], meta["height"]):
                        raise AssertionError(f"decoded size {img.size} differs from its JSON {meta}")
                    decoded += 1
                bucket = bucket_col[0]
                buckets.add(bucket)
                padded += int(sum(bool(p) for p in pads))
                batches.append((bucket, list(keys)))
        streams.append(batches)
        topo = ds.topology
        rows.append([rank, topo.dp_rank, topo.cp_rank, len(batches), len(buckets), decoded, padded])
    elapsed = time.perf_counter() - t0
    out.write(format_table(["rank", "dp_rank", "cp_rank", "batches", "buckets visited", "images decoded",
                            "padded copies"], rows) + "\n")
    total = sum(r[5] for r in rows)
    out.write(f"\n{total} images streamed and decoded in {elapsed:.2f} s ({total / elapsed:,.0f} images/s)\n")
    equal = len({len(s) for s in streams}) == 1
    same_bucket = all([b for b, _ in s] == [b for b, _ in streams[0]] for s in streams)
    cp_same = all(streams[r] == streams[r - r % cp] for r in range(world))
    seen: dict[str, int] = {}
    for r in range(0, world, cp):
        for _, keys in streams[r]:
            for k in keys:
                seen[k] = seen.get(k, 0) + 1
    covered = len(seen) == len(index)
    out.write(f"5. invariants: equal batch counts {equal}; same bucket at every step {same_bucket}; "
              f"CP peers identical {cp_same}; every sample seen {covered}\n")
    plot_path = os.path.join(args.out, "padding.png")
    draw_buckets(index, {s.bucket: s for s in datasets[0].plan().stats},
                 argparse.Namespace(plot=plot_path, world_size=world, cp_size=cp, batch_size=bs, pad="auto", repeats=0))
    out.write(f"6. per-bucket padding picture written to {plot_path}\n")
    return 0 if equal and same_bucket and cp_same and covered else 1
