"""Probe: wds_pad.tar.scan.scan_tar against a tarfile-based scan of the same shards.

Generates two shards with webdataset's TarWriter (1000 samples of ~10 KB: random
``.jpg`` bytes plus a small ``.json``; 200 samples of ~500 KB), then times, interleaved
and best-of-N in CPU time (so other load on the machine skews both sides alike):

* ``tarfile``: ``tarfile.open(path, "r:")`` over the members, webdataset's
  ``base_plus_ext`` grouping, reading every ``.json`` payload;
* ``scan seek``: ``scan_tar(f, url, want=("json",))`` on a local file;
* ``scan stream``: the same through a non-seekable wrapper, against a plain
  ``read(1 MiB)`` loop over the file;
* ``parse_sample`` per sample on its recorded byte range.

Prints ratios, never a bare pass/fail on absolute times::

    PYTHONPATH=. python tools/bench/index_scan_probe.py [--repeat 9] [--dir /tmp/probe]
"""

from __future__ import annotations

import io
import json
import os
import random
import tarfile
import tempfile
from pathlib import Path

import webdataset as wds
from _common import add_repeat, parser, round_robin
from webdataset.tariterators import base_plus_ext

from wds_pad.tar.scan import parse_sample, scan_tar

SHARDS = {"10KB": (1000, 10_000), "500KB": (200, 500_000)}


class _Stream(io.RawIOBase):
    """A non-seekable view of a file, as an HTTP body would be."""

    def __init__(self, f: io.BufferedReader) -> None:
        self._f = f

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
        return self._f.readinto(b)


def make_shard(path: Path, n: int, size: int) -> None:
    rng = random.Random(0)
    with wds.TarWriter(str(path)) as w:
        for i in range(n):
            meta = {"width": rng.randrange(64, 2048), "height": rng.randrange(64, 2048), "i": i}
            w.write({"__key__": f"sample{i:06d}", "jpg": rng.randbytes(size), "json": json.dumps(meta).encode()})


def tarfile_scan(path: Path) -> int:
    keys = 0
    with tarfile.open(path, "r:") as tf:
        last = None
        for ti in tf:
            if not ti.isreg():
                continue
            key, ext = base_plus_ext(ti.name)
            if key is None:
                continue
            if key != last:
                keys, last = keys + 1, key
            if ext.lower() == "json":
                tf.extractfile(ti).read()  # type: ignore[union-attr]
    return keys


def ours(path: Path, seekable: bool) -> int:
    with open(path, "rb") as f:
        src = f if seekable else io.BufferedReader(_Stream(f), 1 << 20)
        return sum(1 for s in scan_tar(src, str(path), want=("json",), seekable=seekable) if s.data)


def read_all(path: Path) -> int:
    """The peer of stream mode: read the same non-seekable stream in 1 MiB chunks."""
    n = 0
    with open(path, "rb") as f:
        src = io.BufferedReader(_Stream(f), 1 << 20)
        while chunk := src.read(1 << 20):
            n += len(chunk)
    return n


def main() -> None:
    ap = parser(__doc__)
    add_repeat(ap, 9)
    ap.add_argument("--dir", type=Path, default=None, help="keep shards here (default: a temp dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for label, (n, size) in SHARDS.items():
            path = root / f"probe-{label}.tar"
            if not path.exists():
                make_shard(path, n, size)
            assert tarfile_scan(path) == ours(path, True) == ours(path, False) == n
            with open(path, "rb") as f:
                blob = f.read()
                ranges = [(s.offset, s.key, blob[s.offset : s.offset + s.length]) for s in scan_tar(f, str(path))]
            best = round_robin(  # interleaved, so load changes hit every side
                {
                    "tarfile": lambda: tarfile_scan(path),
                    "seek": lambda: ours(path, True),
                    "stream": lambda: ours(path, False),
                    "read": lambda: read_all(path),
                    "parse": lambda: [parse_sample(b, str(path), o, k) for o, k, b in ranges],
                },
                args.repeat,
            )
            t = {name: b.cpu for name, b in best.items()}  # CPU seconds, best of --repeat
            print(
                f"{label:>5} ({n} samples, {os.path.getsize(path) / 1e6:.1f} MB): "
                f"tarfile/scan-seek {t['tarfile'] / t['seek']:.1f}x, "
                f"tarfile/scan-stream {t['tarfile'] / t['stream']:.1f}x, "
                f"scan-stream/plain-read {t['stream'] / t['read']:.2f}x, "
                f"parse_sample {t['parse'] / n * 1e6:.1f} us/sample "
                f"(tarfile {t['tarfile'] / n * 1e6:.1f} us/sample)"
            )


if __name__ == "__main__":
    main()
