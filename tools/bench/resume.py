"""Benchmark: time to the first batch after resuming at 0%, 50% and 99% of an epoch.

Builds an epoch of ``--samples`` (default 10^6) samples without writing 10^6 samples:
``make_blob_shards`` writes ``--base`` small real samples (aspect buckets in their
``.json``), ``build_index`` indexes them, and the index rows are repeated ``samples /
base`` times into one synthetic index (``make_index`` / ``write_index``), each row still
pointing at a real byte range, so every read is a real read. Disk: the base shards only.

Contenders, measured in the same run, best of ``--repeat`` (round robin):

* ``wds_pad``: a fresh ``BucketedWebDataset``; time ``load_state_dict(state)`` plus the
  first batch (a seek into the plan, then only that batch's reads);
* ``webdataset``: ``wds.WebDataset`` over the same shards repeated as often (the same
  10^6 samples), resuming the way webdataset users do: iterate and discard the consumed
  samples, then take one batch.

Prints a table with the ratios to resuming at 0%; target: wds_pad at 99% costs at most
1.2x its cost at 0%. Usage::

    python tools/bench/resume.py [--samples 1000000] [--base 10000] [--batch 32] [--repeat 3]
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
import warnings

import numpy as np
from _common import Columns, add_dir, add_repeat, best_of, parser

from wds_pad.cli.synth import make_blob_shards
from wds_pad.stream.dataset import BucketedWebDataset
from wds_pad.index.codec import load_index
from wds_pad.index.record import Index
from wds_pad.index.rows import make_index
from wds_pad.index.output import write_index
from wds_pad.index.build import build_index
from wds_pad.core.topology import Topology


def replicate(base: Index, times: int, path: str) -> Index:
    """``base``'s rows repeated ``times`` (same shards and byte ranges, same keys)."""
    rows = {k: np.tile(np.asarray(base.arrays[k]), times) for k in ("shard", "offset", "length", "exts")}
    rows["bucket"] = np.tile(np.asarray(base.bucket), times)
    keys = [base.key(i) for i in range(len(base))] * times
    index = make_index(base.shards, rows, list(base.buckets), keys, bucket_by=base.bucket_by,
                       exts=base.exts, name="bench")
    write_index(index, path)
    return load_index(path)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--base", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=32)
    add_repeat(ap, 9)
    add_dir(ap)
    ap.add_argument("--skip-webdataset", action="store_true")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    times = max(1, args.samples // args.base)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        urls = make_blob_shards(tmp, samples=args.base, sample_bytes=64, shards=4, seed=0)
        base = build_index(urls, "aspect:width,height", workers=2)
        index = replicate(base, times, os.path.join(tmp, "bench.wdsidx"))
        disk = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
        print(f"epoch: {len(index):,} samples ({len(base):,} real ones x {times}); disk {disk / 2**20:.1f} MiB",
              flush=True)

        def make() -> BucketedWebDataset:
            return BucketedWebDataset(index, batch_size=args.batch, seed=1, topology=Topology(1, 0),
                                      check_agreement=False)

        probe = make()
        n = len(probe)
        template = probe.state_dict()
        # wds_pad at every position first, then the (minutes-long) webdataset replays, so
        # that the sub-millisecond resumes are not measured right after a replay has
        # churned the caches
        fracs = (0.0, 0.5, 0.99)
        pads = []
        for frac in fracs:
            state = dict(template, index=int(frac * n))
            datasets = [make() for _ in range(args.repeat)]  # built outside the timing

            def resume_wds_pad() -> None:
                ds = datasets.pop()
                ds.load_state_dict(state)
                next(iter(ds))

            pads.append(best_of(args.repeat, resume_wds_pad).wall)
            print(f"  measured wds_pad at {frac:.0%}", file=sys.stderr, flush=True)
        rows = []
        for frac, t_pad in zip(fracs, pads):
            k = int(frac * n)
            consumed = k * args.batch
            t_wds = float("nan")
            if not args.skip_webdataset:
                import webdataset as wds

                def resume_webdataset() -> None:
                    stream = iter(wds.WebDataset(urls * times, shardshuffle=False, empty_check=False))
                    for _ in itertools.islice(stream, consumed):
                        pass
                    batch = list(itertools.islice(stream, args.batch))
                    assert len(batch) == args.batch

                t_wds = best_of(1 if consumed > 100_000 else args.repeat, resume_webdataset).wall
                print(f"  measured webdataset at {frac:.0%}", file=sys.stderr, flush=True)
            rows.append((frac, k, consumed, t_pad, t_wds))
    t0_pad, t0_wds = rows[0][3], rows[0][4]
    cols = Columns("{:>10} {:>8} {:>9} | {:>10} {:>8} | {:>11} {:>8} | {:>20}")
    print()
    print(cols.line("resume at", "batch", "samples", "wds_pad", "x at 0%", "webdataset", "x at 0%",
                    "webdataset / wds_pad"))
    for frac, k, consumed, t_pad, t_wds in rows:
        print(cols.line(f"{frac:.0%}", f"{k:,}", f"{consumed:,}", f"{t_pad * 1e3:.2f}ms", f"{t_pad / t0_pad:.2f}",
                        f"{t_wds * 1e3:.1f}ms", f"{t_wds / t0_wds:.1f}", f"{t_wds / t_pad:.0f}"))
    ratio = rows[-1][3] / t0_pad
    print(f"\nwds_pad at 99% / its time at 0%: {ratio:.2f}x (target <= 1.2x)")
    return 0 if ratio <= 1.2 else 1


if __name__ == "__main__":
    sys.exit(main())
