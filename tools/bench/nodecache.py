"""Benchmark: GETs per shard of one node's processes, the node cache against the per-rank reader.

One node of 4 processes (dp 2 x cp 2, gloo on loopback, started as torchrun starts them), 2
DataLoader workers each, ``locality="shard"``, all with the same ``ReadOptions(cache_dir=...)``,
streams ``--shards`` shards over loopback HTTP behind our FaultProxy, which counts the GETs
(``tools/nodejob.py``; every rank checks every byte). Two readers run in the same run on the
same shards: this tree's node cache, and the per-rank reader it replaced (the tree before
``wds_pad/io/sharddisk.py`` was removed, exported with ``git archive``; ``--baseline REV``
picks another). For each, GETs per shard fetch (every ``block_bytes`` GET of every shard once
= 1.00) in:

* epoch 0, and epoch 1 of the same job (every shard fits ``cache_bytes``);
* a job killed with SIGKILL mid-epoch (after ``--kill-after`` batches on every rank) plus its
  restart from the saved states on the same ``cache_dir``;
* a new job on the warm ``cache_dir`` of the first;
* epochs 0 and 1 with ``cache_bytes`` half the shards' bytes (eviction by next use), beside
  what an optimal cache of that many shards would fetch for the node's reads taken as one
  sequence in step order (Belady: evict the shard used furthest ahead, nothing kept over
  the bound);

and the peak bytes in the cache folder (sampled every 10 ms) against ``cache_bytes``. The
ranks run in lockstep (a barrier after each batch, as a training step's all-reduce makes),
but for the killed job and its restart (each rank resumes where it saved its state).

Usage::

    python tools/bench/nodecache.py [--shards 16] [--samples 640] [--baseline REV]

Needs git (for the baseline) and nginx or the Python fallback; loopback only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import TOOLS, parser, table  # first: tools/ on sys.path

import nodejob  # noqa: E402
from faultproxy import FaultProxy  # noqa: E402
from servers import http_server  # noqa: E402

from wds_pad.cli.synth import make_blob_shards  # noqa: E402
from wds_pad.index.build import build_index  # noqa: E402

NPROCS, CP, WORKERS = 4, 2, 2
ROOT = TOOLS.parent


def baseline_tree(rev: str | None, into: Path) -> tuple[str, Path]:
    """The per-rank reader's tree: ``rev``, else the parent of the commit that removed
    io/sharddisk.py; exported to ``into``."""
    if rev is None:
        gone = subprocess.run(["git", "log", "-1", "--format=%H", "--diff-filter=D", "--", "wds_pad/io/sharddisk.py"],
                              cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        if not gone:
            raise SystemExit("no commit removed wds_pad/io/sharddisk.py here: pass --baseline REV")
        rev = f"{gone}^"
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, "wds_pad"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return rev, into


class Peak:
    """The most bytes of shard files (complete or partial) seen in a folder, every 10 ms."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.peak, self._stop = folder, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            try:
                for p in self.folder.rglob("*"):
                    if p.suffix in (".shard", ".part"):
                        try:
                            total += p.stat().st_size
                        except OSError:
                            pass
            except OSError:
                pass
            self.peak = max(self.peak, total)
            time.sleep(0.01)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def measure(name: str, env: dict[str, str], index: str, reference: Path, root: Path, proxy: FaultProxy, blocks: int,
            block: int, total: int, kill_after: int) -> dict[str, Any]:
    """The GET figures of one reader (``env``: which wds_pad its ranks import)."""
    out: dict[str, Any] = {}

    def args(cache: Path, state: Path, epochs: int, cache_bytes: int = 1 << 40, pause: bool = False,
             lockstep: bool = True) -> list[str]:
        # a job resumed after a kill resumes each rank where it saved: not in lockstep
        return (["--index", index, "--reference", str(reference), "--cache-dir", str(cache), "--state", str(state),
                 "--epochs", str(epochs), "--workers", str(WORKERS), "--cp", str(CP), "--block-bytes", str(block),
                 "--cache-bytes", str(cache_bytes)] + (["--lockstep"] if lockstep else [])
                + (["--pause"] if pause else []))

    def run(run: str, a: list[str]) -> nodejob.Job:
        job = nodejob.Job(a, NPROCS, run=run, env=env, timeout=300).start()
        return job

    def epochs(tag: str, cache: Path, state: Path, cache_bytes: int) -> None:
        peak = Peak(cache)
        proxy.reset_counters()
        job = run(tag, args(cache, state, 2, cache_bytes, pause=True))
        for e in (0, 1):
            while not (state / f"done{e}").exists():
                if any(p.poll() is not None for p in job.procs):
                    raise SystemExit(f"{name}: a rank ended early:\n{job.outputs()}")
                time.sleep(0.02)
            out[f"{tag} {e}"] = proxy.requests_seen / blocks
            proxy.reset_counters()
            (state / f"go{e}").write_text("")
        if job.wait() != [0] * NPROCS:
            raise SystemExit(f"{name}: {tag} failed:\n{job.outputs()}")
        out[f"{tag} peak"] = peak.stop()

    base = root / name
    for sub in ("state", "state2", "state3", "state4"):
        (base / sub).mkdir(parents=True)
    epochs("epoch", base / "cache", base / "state", 1 << 40)
    # killed mid-epoch, then restarted from the states on the same cache_dir
    proxy.reset_counters()
    job = run("killed", args(base / "cache2", base / "state2", 1, lockstep=False))
    while min(len(v) for v in nodejob.logs(base / "state2", NPROCS).values()) < kill_after:
        if any(p.poll() is not None for p in job.procs):
            break
        time.sleep(0.01)
    job.kill_all()
    restart = run("restart", args(base / "cache2", base / "state2", 1, lockstep=False))
    if restart.wait() != [0] * NPROCS:
        raise SystemExit(f"{name}: the restart failed:\n{restart.outputs()}")
    out["restart"] = proxy.requests_seen / blocks
    # a new job on the warm cache_dir of the first
    proxy.reset_counters()
    warm = run("warm", args(base / "cache", base / "state3", 1))
    if warm.wait() != [0] * NPROCS:
        raise SystemExit(f"{name}: the warm job failed:\n{warm.outputs()}")
    out["warm"] = proxy.requests_seen / blocks
    epochs("small", base / "cache4", base / "state4", total // 2)
    wrong = sum(e["wrong"] for s in ("state", "state2", "state3", "state4")
                for v in nodejob.logs(base / s, NPROCS).values() for e in v)
    out["wrong"] = wrong
    return out


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def optimal(index: str, epochs: int, capacity: int) -> list[float]:
    """Fetches per shard, per epoch, of an optimal cache of ``capacity`` shards over the
    node's reads in step order (both DP ranks' batches of a step, then the next step)."""
    from wds_pad import BucketedWebDataset, Topology, load_index

    ix = load_index(index)
    reads: list[int] = []
    ends = []
    for e in range(epochs):
        steps: dict[int, list[int]] = {}
        for d in range(NPROCS // CP):
            ds = BucketedWebDataset(ix, batch_size=4, seed=5, locality="shard", window=2, check_agreement=False,
                                    topology=Topology(NPROCS, d * CP, cp_size=CP))
            plan = ds.plan(e)
            for j in range(len(plan)):
                steps.setdefault(j, []).extend(ix.shard[plan[j].samples].tolist())
        reads += [s for j in sorted(steps) for s in steps[j]]
        ends.append(len(reads))
    later: dict[int, list[int]] = {}
    for i in range(len(reads) - 1, -1, -1):
        later.setdefault(reads[i], []).append(i)  # each shard's read positions, last first
    held: set[int] = set()
    fetched = [0] * epochs
    for i, s in enumerate(reads):
        later[s].pop()
        if s not in held:
            fetched[sum(i >= end for end in ends)] += 1
            if len(held) >= capacity:
                held.remove(max(held, key=lambda x: later[x][-1] if later[x] else 1 << 62))
            held.add(s)
    return [f / len(ix.shards) for f in fetched]


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--samples", type=int, default=640)
    ap.add_argument("--sample-bytes", type=int, default=4000)
    ap.add_argument("--block-bytes", type=int, default=16 * 1024)
    ap.add_argument("--kill-after", type=int, default=8, help="batches every rank receives before the kill")
    ap.add_argument("--baseline", default=None, help="the per-rank reader's git revision")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="wds_pad_nodebench_"))
    try:
        return report(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(args: argparse.Namespace, root: Path) -> int:
    rev, tree = baseline_tree(args.baseline, root / "baseline")
    www = root / "www"
    make_blob_shards(www / "d", samples=args.samples, sample_bytes=args.sample_bytes, shards=args.shards, seed=1)
    names = sorted(p.name for p in (www / "d").glob("*.tar"))
    with http_server(www) as server:
        proxy = FaultProxy(server.host, server.port).start()
        try:
            urls = [f"http://{proxy.host}:{proxy.port}/d/{n}" for n in names]
            index = build_index(urls, "aspect:width,height", output=str(root / "ix.wdsidx"))
            # the per-rank reader reads its own tree's index format (this tree's records more)
            subprocess.run([sys.executable, "-m", "wds_pad", "index", *urls, "-o", str(root / "ix-baseline.wdsidx"),
                            "--bucket-by", "aspect:width,height", "--no-progress"], check=True,
                           stdout=subprocess.DEVNULL, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)})
            blocks = sum(-(-s.size // args.block_bytes) for s in index.shards)
            total = sum(s.size for s in index.shards)
            print(f"{args.samples} samples in {args.shards} shards ({total / 1e6:.1f} MB, {blocks} blocks of "
                  f"at most {_size(args.block_bytes)}) over {server!r}; {NPROCS} processes (dp {NPROCS // CP} x cp {CP}), "
                  f"{WORKERS} workers each; per-rank reader: {rev}\n")
            figures = {
                "node cache": measure("node", {}, str(root / "ix.wdsidx"), www / "d", root, proxy, blocks,
                                      args.block_bytes, total, args.kill_after),
                "per-rank reader": measure("per-rank", {"PYTHONPATH": str(tree)}, str(root / "ix-baseline.wdsidx"), www / "d",
                                           root, proxy, blocks, args.block_bytes, total, args.kill_after),
            }
        finally:
            proxy.stop()
    rows = []
    best = optimal(str(root / "ix.wdsidx"), 2, args.shards // 2)
    for label, key, opt in (("epoch 0", "epoch 0", "1.00"), ("epoch 1, everything fits cache_bytes", "epoch 1", "0.00"),
                            ("killed mid-epoch + restart on the same cache_dir", "restart", "1.00"),
                            ("a new job on the warm cache_dir", "warm", "0.00"),
                            ("cache_bytes = 1/2 of the shards: epoch 0", "small 0", f"{best[0]:.2f}"),
                            ("cache_bytes = 1/2: epoch 1", "small 1", f"{best[1]:.2f}")):
        rows.append([label] + [f"{f[key]:.2f}" for f in figures.values()] + [opt])
    print("GETs per shard fetch (GETs / blocks of all shards; counted at the proxy):")
    print(table(["", *figures, "optimal cache"], rows, align="lrrr"))
    print("\npeak bytes of shard files in the cache folder:")
    print(table(["", *figures], [
        ["cache_bytes above the shards' bytes"] + [f"{f['epoch peak'] / 1e6:.2f} MB" for f in figures.values()],
        [f"cache_bytes = {total // 2 / 1e6:.2f} MB"] + [f"{f['small peak'] / 1e6:.2f} MB" for f in figures.values()]],
        align="lrr"))
    print(f"\nthe shards: {total / 1e6:.2f} MB; wrong bytes: " + ", ".join(f"{k} {f['wrong']}" for k, f in figures.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
