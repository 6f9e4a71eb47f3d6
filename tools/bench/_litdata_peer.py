"""litData as a peer of tools/bench/stream.py: convert the shards once, stream them.

Its own module, not the script: ``litdata.optimize`` pickles the sample function into
spawned worker processes, which must import it from a module (a script's ``__main__``
function hung them here).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["litdata_convert", "litdata_iterate", "litdata_loader", "litdata_stream"]


def _litdata_samples(url: str) -> Any:
    """litdata.optimize's function: the samples of one shard, as webdataset groups them."""
    import webdataset as wds

    for s in wds.WebDataset([url], shardshuffle=False):
        yield {"__key__": s["__key__"], "bin": s["bin"], "json": s["json"]}


def litdata_convert(urls: list[str], out: str) -> float:
    """Convert the shards once with litdata.optimize, in a fresh interpreter (in the
    benchmark's own process, which has already indexed and threaded, its spawned
    workers hung); returns the seconds it took, interpreter start included."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r}); import _litdata_peer, json; "
            f"_litdata_peer._convert(json.loads(sys.argv[1]), sys.argv[2])")
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, json.dumps(urls), out], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def _convert(urls: list[str], out: str) -> None:
    import litdata

    litdata.optimize(fn=_litdata_samples, inputs=urls, output_dir=out, chunk_bytes="64MB",
                     num_workers=min(2, len(urls)))


def litdata_stream(out: str, shuffle: bool, workers: int, batch: int) -> int:
    import litdata

    ds = litdata.StreamingDataset(out, shuffle=shuffle, seed=0)
    n = 0
    if workers == 0:
        for _ in ds:
            n += 1
        return n
    for b in litdata.StreamingDataLoader(ds, batch_size=batch, num_workers=workers, collate_fn=_as_bytes):
        n += len(b)
    return n


def litdata_loader(out: str, workers: int, batch: int) -> Any:
    """A StreamingDataLoader in order whose workers live from one iteration to the next
    (``persistent_workers=True``), for :func:`litdata_iterate`."""
    import litdata

    ds = litdata.StreamingDataset(out, shuffle=False, seed=0)
    return litdata.StreamingDataLoader(ds, batch_size=batch, num_workers=workers, collate_fn=_as_bytes,
                                       persistent_workers=True)


def litdata_iterate(loader: Any) -> int:
    """One epoch of a loader :func:`litdata_loader` made: the samples it gave."""
    n = 0
    for b in loader:
        n += len(b)
    return n


def _as_bytes(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A batch of litData samples that can cross a process boundary: its members are
    memoryviews of the chunk file, which do not pickle (wds_pad's are bytes already)."""
    return [{k: bytes(v) if isinstance(v, memoryview) else v for k, v in s.items()} for s in samples]
