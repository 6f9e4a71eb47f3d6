"""Benchmark: one rank's cost at 10^8-10^9 samples and 10^4-10^5 ranks, and a node of 8 ranks.

Every figure is measured in a fresh subprocess: wall seconds of the measured block and
its extra peak RSS (``_common.PeakRss``: the kernel's high-water mark, reset after the
imports, minus the RSS then; resident pages of the memory-mapped index count). Figures:

- ``rank``: one rank's ``load_index`` + ``plan_epoch`` + ``plan[0]`` over a synthetic
  index (tools/make_index.py) of ``--samples`` samples, ``--buckets`` buckets, at
  ``--world`` ranks; against the previous main (``--old``: a checkout of it, e.g.
  ``git worktree add /tmp/wds_old 11cf43a``; it reads format version 1, so its index of
  the same sizes is written here directly in that format, rows in shard order with
  buckets interleaved as a build writes them) and against
  ``torch.utils.data.DistributedSampler`` (``iter`` + one batch of indices), at the
  sizes it can do within ``--sampler-limit-mb``;
- ``node``: 8 processes (world 8, rank 0..7) started together, each loading the same
  index and making its first batch: wall seconds from a common start (every process
  has imported everything and waits; the parent then releases them all at once) until
  the last holds its first batch, and the PSS summed over the 8 (``smaps_rollup``)
  while they all still hold their plans, beside the index pages they touched (PSS of
  the index mapping, summed: each shared page counted once);
- ``huge``: ``--huge`` samples (10^9) at ``--huge-world`` ranks (10^5): the set-up and
  first batch of one rank from bucket counts alone (a Dataset of ``IdRange`` buckets:
  all the planner reads of an index), the same for the rest of an epoch resumed after a
  third of it on 3/4 and on 3/2 of the ranks (``plan_remainder``, docs/resume.md), and load + plan + first batch over the largest
  real index file generated here (``--real``);
- ``bytes``: bytes per sample on disk per section (``Index.bytes_per_sample()``) of the
  synthetic index, of the version-1 file of the same samples and of an index built
  from real tar shards (tools/make_shards.py).

Usage::

    git worktree add /tmp/wds_old 11cf43a     # the previous main, once
    python tools/bench/scale.py --old /tmp/wds_old
    python tools/bench/scale.py --samples 1e7 --huge 1e8 --real 3e7   # smaller, quicker

The generated indexes (~2.3 GB at 10^8 for version 2, ~4.9 GB for version 1) go to
``--dir`` and are deleted after the run unless ``--keep``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from _common import TOOLS, Columns, PeakRss, mapping_mb, parser, run_json, smaps_rollup_mb

SEED = 20240601
ROOT = TOOLS.parent


# -- the measured blocks (run in a fresh subprocess each) -------------------------------------


def _use_code(code: str | None) -> None:
    """Import wds_pad from ``code`` (a checkout) rather than from this repository."""
    if code:
        sys.path.insert(0, code)


def _load_kwargs(verify: str) -> dict[str, Any]:
    # "default": load_index's own choice (the digest is checked for files up to 256 MiB)
    return {} if verify == "default" else {"verify": False}


def case_rank(code: str | None, path: str, world: int, rank: int, batch: int, verify: str = "default") -> dict[str, Any]:
    _use_code(code)
    import wds_pad
    from wds_pad import Topology, load_index, plan_epoch

    with PeakRss() as mem:
        t0 = time.perf_counter()
        index = load_index(path, **_load_kwargs(verify))
        t1 = time.perf_counter()
        plan = plan_epoch(index, Topology(world, rank), seed=SEED, batch_size=batch, warn=False)
        t2 = time.perf_counter()
        first = plan[0]
        t3 = time.perf_counter()
    return {"code": wds_pad.__file__, "load_s": t1 - t0, "plan_s": t2 - t1, "batch_s": t3 - t2, "wall_s": t3 - t0,
            "extra_mb": mem.extra_mb, "method": mem.method, "batches": len(plan), "first": int(first.samples.size)}


def case_sampler(samples: int, world: int, rank: int, batch: int) -> dict[str, Any]:
    from torch.utils.data import DistributedSampler

    class Sized:
        def __len__(self) -> int:
            return samples

    with PeakRss() as mem:
        t0 = time.perf_counter()
        sampler = DistributedSampler(Sized(), num_replicas=world, rank=rank, shuffle=True, seed=SEED)  # type: ignore[arg-type]
        it = iter(sampler)
        first = [next(it) for _ in range(batch)]
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "extra_mb": mem.extra_mb, "method": mem.method, "batches": -(-len(sampler) // batch),
            "first": len(first)}


def case_ranges(samples: int, buckets: int, world: int, rank: int, batch: int) -> dict[str, Any]:
    from make_index import _bucket_keys, bucket_sizes

    from wds_pad import Dataset, IdRange, Topology, plan_epoch

    sizes = bucket_sizes(samples, buckets)
    keys = _bucket_keys(buckets, "aspect")[0]
    bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    with PeakRss() as mem:
        t0 = time.perf_counter()
        ds = Dataset("huge", {k: IdRange(bounds[b], bounds[b + 1]) for b, k in enumerate(keys)})
        plan = plan_epoch(ds, Topology(world, rank), seed=SEED, batch_size=batch, warn=False)
        t1 = time.perf_counter()
        first = plan[0]
        t2 = time.perf_counter()
    return {"plan_s": t1 - t0, "batch_s": t2 - t1, "wall_s": t2 - t0, "extra_mb": mem.extra_mb, "method": mem.method,
            "batches": len(plan), "first": int(first.samples.size)}


def case_elastic(samples: int, buckets: int, world: int, rank: int, batch: int, shrink: int) -> dict[str, Any]:
    """The rest of an epoch resumed mid-epoch on ``world * shrink // 4`` ranks after a
    third of it on ``world``: ``plan_remainder`` + its first batch, from bucket counts."""
    from make_index import _bucket_keys, bucket_sizes

    from wds_pad import Dataset, IdRange, Topology, plan_epoch
    from wds_pad.core.elastic.remainder import Segment, plan_remainder

    sizes = bucket_sizes(samples, buckets)
    keys = _bucket_keys(buckets, "aspect")[0]
    bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    ds = Dataset("huge", {k: IdRange(bounds[b], bounds[b + 1]) for b, k in enumerate(keys)})
    steps = len(plan_epoch(ds, Topology(world, 0), seed=SEED, batch_size=batch, warn=False)) // 3
    new = max(1, world * shrink // 4)
    with PeakRss() as mem:
        t0 = time.perf_counter()
        plan = plan_remainder(ds, Topology(new, min(rank, new - 1)), [Segment(world, steps=steps)], seed=SEED,
                              epoch=0, batch_size=batch, policy="cyclic").plan
        t1 = time.perf_counter()
        first = plan[0]
        t2 = time.perf_counter()
    return {"plan_s": t1 - t0, "batch_s": t2 - t1, "wall_s": t2 - t0, "extra_mb": mem.extra_mb, "method": mem.method,
            "batches": len(plan), "first": int(first.samples.size)}


def case_node(code: str | None, path: str, world: int, rank: int, batch: int, verify: str = "default") -> None:
    """One rank of ``node``: 'ready' after the imports, work on 'go', a JSON line, exit on 'exit'."""
    _use_code(code)
    from wds_pad import Topology, load_index, plan_epoch

    print("ready", flush=True)
    sys.stdin.readline()
    with PeakRss() as mem:
        t0 = time.perf_counter()
        index = load_index(path, **_load_kwargs(verify))  # held, as a Loader holds it: its pages stay mapped
        plan = plan_epoch(index, Topology(world, rank), seed=SEED, batch_size=batch, warn=False)
        first = plan[0]
        done = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
        wall = time.perf_counter() - t0
    print(json.dumps({"done": done, "wall_s": wall, "extra_mb": mem.extra_mb, "first": int(first.samples.size)}),
          flush=True)
    sys.stdin.readline()
    del plan, index


# -- the runs (in this process) --------------------------------------------------------------


def _child(*args: Any) -> list[str]:
    return [sys.executable, __file__, "--case", *map(str, args)]


def _env(code: str | None) -> dict[str, str]:
    # PYTHONPATH alone would lose to this repository's editable install: --code decides
    return dict(os.environ, PYTHONPATH=str(code or ROOT))


def best(cmd: Sequence[str], repeat: int, cwd: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The fastest (by wall time) of ``repeat`` fresh subprocesses; the largest peak of them."""
    runs = [run_json(cmd, cwd=cwd, env=env, timeout=900) for _ in range(repeat)]
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0]
    out = dict(min(good, key=lambda r: r["wall_s"]))
    out["extra_mb"] = max(r["extra_mb"] for r in good)
    return out


def run_node(code: str | None, path: str, batch: int, cwd: str, procs: int = 8,
             verify: str = "default") -> dict[str, Any]:
    env = _env(code)
    kids = [subprocess.Popen(_child("node", code or "-", path, procs, r, batch, verify), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env, cwd=cwd) for r in range(procs)]
    try:
        for k in kids:
            if k.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                raise RuntimeError(f"a node rank did not start (exit {k.wait()})")
        base_pss = sum(smaps_rollup_mb(k.pid).get("Pss", 0.0) for k in kids)
        t0 = time.monotonic()
        for k in kids:
            k.stdin.write("go\n")  # type: ignore[union-attr]
            k.stdin.flush()  # type: ignore[union-attr]
        lines = [k.stdout.readline() for k in kids]  # type: ignore[union-attr]
        if not all(line.strip() for line in lines):
            return {"error": "a rank died before its first batch (out of memory?)"}
        results = [json.loads(line) for line in lines]
        roll = [smaps_rollup_mb(k.pid) for k in kids]
        index_maps = [mapping_mb(k.pid, path) for k in kids]
        for k in kids:
            k.stdin.write("exit\n")  # type: ignore[union-attr]
            k.stdin.flush()  # type: ignore[union-attr]
    finally:
        for k in kids:
            try:
                k.wait(timeout=60)
            except subprocess.TimeoutExpired:
                k.kill()
    return {"wall_s": max(r["done"] for r in results) - t0, "alone_s": max(r["wall_s"] for r in results),
            "pss_mb": sum(r.get("Pss", 0.0) for r in roll), "pss_anon_mb": sum(r.get("Pss_Anon", 0.0) for r in roll),
            "base_pss_mb": base_pss, "index_pss_mb": sum(m["Pss"] for m in index_maps),
            "index_rss_mb": max(m["Rss"] for m in index_maps), "extra_mb": max(r["extra_mb"] for r in results)}


# -- the version-1 index of the previous main ------------------------------------------------

_V1 = {"shard": np.int32, "offset": np.int64, "length": np.int64, "bucket": np.int32, "exts": np.uint64,
       "key_offsets": np.int64, "keys": np.uint8}


def write_v1(path: str, synth: Any, name: str) -> None:
    """The previous main's format (version 1: every column int64/int32, rows in shard
    order, the shard table in the header) of ``synth``'s sizes: its bucket x shard counts
    and length table, each shard's samples in a random bucket order (as a build of
    unsorted shards writes them). The digest is computed while writing and patched in."""
    from make_index import _digits

    counts, n, shards = synth.counts, synth.n, synth.shards
    per_shard = synth.shard_samples
    w, pd = synth.key_width, synth.pos_digits
    sdig = _digits(np.arange(shards, dtype=np.int64), w - pd)
    pdig = _digits(np.arange(max(int(per_shard.max()), 1), dtype=np.int64), pd)

    def shard_rows(s: int, what: str) -> np.ndarray:
        k = int(per_shard[s])
        if what == "shard":
            return np.full(k, s, np.int32)
        if what == "bucket":
            b = np.repeat(np.arange(counts.shape[0], dtype=np.int32), counts[:, s])
            return np.random.default_rng([SEED, 5, s]).permutation(b)
        if what == "exts":
            draw = np.random.default_rng([SEED, 7, s]).integers(0, 256, k, dtype=np.uint8)
            return np.where(draw < 8, 0b1110, 0b1011).astype(np.uint64)
        if what == "keys":
            return np.concatenate([np.broadcast_to(sdig[s], (k, w - pd)), pdig[:k]], axis=1).ravel()
        ln = synth.length_table[np.random.default_rng([SEED, 6, s]).integers(0, 1 << 16, k, dtype=np.uint16)]
        ln = ln.astype(np.int64)
        return ln if what == "length" else np.cumsum(ln) - ln

    sizes = [-(-(int(shard_rows(s, "length").sum()) + 1024) // 10240) * 10240 for s in range(shards)]
    shard_table = [{"url": f"synthetic/shard-{s:06d}.tar", "size": sizes[s], "stamp": "synthetic",
                    "samples": int(per_shard[s]), "error": None} for s in range(shards)]
    counts_of = {"shard": n, "offset": n, "length": n, "bucket": n, "exts": n, "key_offsets": n + 1, "keys": n * w}
    layout, pos = {}, 0
    for k, dt in _V1.items():
        layout[k] = {"dtype": np.dtype(dt).str, "offset": pos, "count": counts_of[k]}
        pos += -(-(counts_of[k] * np.dtype(dt).itemsize) // 64) * 64
    header = {"format": "wds_pad.index", "version": 1, "name": name, "samples": n, "shards": shard_table,
              "buckets": list(synth.keys), "bucket_by": synth.bucket_by, "exts": ["jpg", "json", "png", "txt"],
              "excluded": {"samples": [], "shards": [], "count": 0}, "digest": "0" * 32, "arrays": layout}
    h = hashlib.blake2b(digest_size=16)
    head = {"shards": [[s["url"], s["size"], s["stamp"], s["samples"]] for s in shard_table],
            "buckets": header["buckets"], "exts": header["exts"]}
    h.update(json.dumps(head, sort_keys=True).encode())

    def raw_header() -> bytes:
        return json.dumps(header, sort_keys=True).encode("utf-8")

    raw = raw_header()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(b"\0" * 24)
        f.write(raw)
        f.write(b"\0" * (-(24 + len(raw)) % 64))
        for k, dt in _V1.items():
            if k == "key_offsets":
                chunks: Any = (np.arange(lo, min(lo + (1 << 22), n + 1), dtype=np.int64) * w
                               for lo in range(0, n + 1, 1 << 22))
            else:
                chunks = (shard_rows(s, k) for s in range(shards))
            written = 0
            for c in chunks:
                data = np.ascontiguousarray(c, dtype=dt)
                h.update(data.data)
                f.write(data.data)
                written += data.nbytes
            f.write(b"\0" * (-written % 64))
        header["digest"] = h.hexdigest()
        final = raw_header()
        assert len(final) == len(raw)
        f.seek(0)
        f.write(b"WDSPADIX" + np.uint32(1).tobytes() + np.uint32(zlib.crc32(final)).tobytes()
                + np.uint64(len(final)).tobytes())
        f.write(final)
    os.replace(tmp, path)


# -- main -------------------------------------------------------------------------------------


def _count(text: str) -> int:
    return int(float(text))


def _fmt(r: dict[str, Any], key: str, spec: str) -> str:
    return "-" if "error" in r or key not in r else format(r[key], spec)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--samples", type=_count, default=10**8)
    p.add_argument("--shards", type=_count, default=10**4)
    p.add_argument("--buckets", type=_count, default=1000)
    p.add_argument("--world", type=_count, default=10**4, help="ranks of the one-rank figure")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--huge", type=_count, default=10**9, help="samples of the bucket-counts-only figure")
    p.add_argument("--huge-world", type=_count, default=10**5)
    p.add_argument("--real", type=_count, default=3 * 10**8, help="samples of the largest real index file")
    p.add_argument("--old", default=None, help="a checkout of the previous main (git worktree add DIR 11cf43a)")
    p.add_argument("--node-peer-samples", type=_count, default=10**7,
                   help="samples of the 8-process comparison with the previous main (0: none)")
    p.add_argument("--node-batch-sizes", type=lambda t: [int(x) for x in t.split(",") if x], default=[32],
                   help="more per-rank batch sizes for the node figure (fewer global steps to schedule)")
    p.add_argument("--sampler-sizes", default="1e6,1e7,1e8")
    p.add_argument("--sampler-limit-mb", type=float, default=6000.0,
                   help="skip a DistributedSampler size whose predicted peak is larger")
    p.add_argument("--repeat", type=int, default=3, help="fresh subprocesses per one-rank figure, fastest kept")
    p.add_argument("--dir", default=None, help="where the indexes go (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the generated indexes")
    p.add_argument("--skip", default="", help="comma-separated figures to skip: rank,node,huge,bytes")
    p.add_argument("--case", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        kind, *rest = args.case
        if kind == "rank":
            print(json.dumps(case_rank(None if rest[0] == "-" else rest[0], rest[1], *map(int, rest[2:5]), *rest[5:])))
        elif kind == "sampler":
            print(json.dumps(case_sampler(*map(int, rest))))
        elif kind == "ranges":
            print(json.dumps(case_ranges(*map(int, rest))))
        elif kind == "elastic":
            print(json.dumps(case_elastic(*map(int, rest))))
        elif kind == "node":
            case_node(None if rest[0] == "-" else rest[0], rest[1], *map(int, rest[2:5]), *rest[5:])
        return 0

    import make_index

    skip = set(filter(None, args.skip.split(",")))
    work = args.dir or tempfile.mkdtemp(prefix="wds_pad_scale-")
    os.makedirs(work, exist_ok=True)
    made: list[str] = []
    old = os.path.abspath(args.old) if args.old else None
    rank = args.world // 2 + 7  # any rank: every rank does the same work

    def synthetic(samples: int, shards: int, version: int = 2) -> str:
        path = os.path.join(work, f"v{version}-{samples}-{shards}-{args.buckets}.wdsidx")
        made.append(path)
        if os.path.exists(path):  # kept by an earlier run (--keep): the same sizes, the same seed
            print(f"  reusing {path}", flush=True)
            return path
        t = time.perf_counter()
        synth = make_index.SyntheticIndex(samples, shards, args.buckets, seed=1, name=f"v{version}")
        if version == 2:
            synth.write(path)
        else:
            write_v1(path, synth, "v1")
        print(f"  wrote {path}: {samples:.0e} samples, format v{version}, {os.path.getsize(path) / 2**30:.2f} GiB "
              f"in {time.perf_counter() - t:.1f} s ({'tools/make_index.py' if version == 2 else 'write_v1'})",
              flush=True)
        return path

    print(f"scale benchmark: {args.samples:.0e} samples, {args.shards} shards, {args.buckets} buckets "
          f"(log-normal sizes), batch {args.batch_size}, policy auto; each figure a fresh subprocess "
          f"(one-rank figures: fastest of {args.repeat}); extra MB = peak RSS over the RSS after imports "
          f"(VmHWM reset by /proc/self/clear_refs)\n", flush=True)
    v2 = v1 = None
    if {"rank", "node", "bytes"} - skip:
        v2 = synthetic(args.samples, args.shards)
    if old and {"rank", "bytes"} - skip:
        v1 = synthetic(args.samples, args.shards, version=1)
    notes: list[str] = []
    old_rank_mb = None
    try:
        if "rank" not in skip:
            print(f"\n[rank] one rank ({rank} of {args.world}): load_index + plan_epoch + plan[0], {args.samples:.0e} "
                  "samples", flush=True)
            cols = Columns("{:<34} {:>10} {:>8} {:>8} {:>8} {:>8} {:>9} {:>8}")
            print(cols.header("contender", "samples", "load s", "plan s", "batch s", "total s", "extra MB", "batches"))
            new = best(_child("rank", "-", v2, args.world, rank, args.batch_size), args.repeat, work, _env(None))
            rows = [("this main (v2, IdRange buckets)", args.samples, new)]
            if old and v1:
                rows.append(("previous main 11cf43a (v1)", args.samples,
                             best(_child("rank", old, v1, args.world, rank, args.batch_size), args.repeat, work,
                                  _env(old))))
            if len(rows) > 1 and "error" not in rows[1][2]:
                old_rank_mb = rows[1][2]["extra_mb"]
            last: tuple[int, float] | None = None
            for s in [_count(x) for x in args.sampler_sizes.split(",") if x]:
                if last and last[1] * s / last[0] > args.sampler_limit_mb:
                    notes.append(f"DistributedSampler stops before {s:.0e} samples here: predicted peak "
                                 f"{last[1] * s / last[0]:,.0f} MB > --sampler-limit-mb {args.sampler_limit_mb:,.0f} "
                                 "(randperm of every sample, then a Python list of them, in every rank)")
                    break
                r = best(_child("sampler", s, args.world, rank, args.batch_size), max(1, args.repeat - 1), work)
                rows.append(("torch DistributedSampler", s, r))
                if "error" not in r:
                    last = (s, max(r["extra_mb"], 1.0))
            for label, s, r in rows:
                if "error" in r:
                    print(cols.line(label, f"{s:.0e}", r["error"]))
                    continue
                print(cols.line(label, f"{s:.0e}", _fmt(r, "load_s", ".3f"), _fmt(r, "plan_s", ".3f"),
                                _fmt(r, "batch_s", ".4f"), f"{r['wall_s']:.3f}", f"{r['extra_mb']:.1f}",
                                r["batches"]))
            for label, s, r in rows[1:]:
                if "error" not in r and "error" not in new and s == args.samples:
                    print(f"  {label} at {s:.0e} / this main at {args.samples:.0e}: {r['wall_s'] / new['wall_s']:.1f}x "
                          f"time, {r['extra_mb'] / max(new['extra_mb'], 0.1):.1f}x extra peak memory")
            print(f"  this main: {_fmt(new, 'wall_s', '.3f')} s, {_fmt(new, 'extra_mb', '.1f')} MB extra peak "
                  "(target <= 0.3 s and <= 64 MB)")

        if "node" not in skip:
            print(f"\n[node] 8 processes (world 8) started together on this {os.cpu_count()}-core machine, each "
                  f"load_index + plan_epoch + plan[0] of the same {args.samples:.0e}-sample index; wall from a common "
                  "start after imports until the last holds its first batch", flush=True)
            cols = Columns("{:<34} {:>8} {:>8} {:>9} {:>8} {:>9} {:>12} {:>12} {:>9}")
            print(cols.header("contender", "samples", "wall s", "slowest s", "PSS MB", "PSS anon", "index pages",
                              "PSS imports", "bound MB"))
            nodes = [(f"this main (v2), batch {args.batch_size}", args.samples,
                      run_node(None, v2, args.batch_size, work))]
            for bs in args.node_batch_sizes:
                nodes.append((f"this main (v2), batch {bs}", args.samples, run_node(None, v2, bs, work)))
            peer = args.node_peer_samples
            if old and peer:  # the previous main holds every id in every process: 8 x ~23 B/sample at once
                small_shards = max(1, peer * args.shards // args.samples)
                nodes.append((f"this main (v2), batch {args.batch_size}", peer,
                              run_node(None, synthetic(peer, small_shards), args.batch_size, work, verify="off")))
                nodes.append((f"previous 11cf43a (v1), batch {args.batch_size}", peer,
                              run_node(old, synthetic(peer, small_shards, version=1), args.batch_size, work,
                                       verify="off")))
            for label, s, r in nodes:
                if "error" in r:
                    print(cols.line(label, f"{s:.0e}", r["error"]))
                    continue
                bound = r["index_pss_mb"] + 8 * 64
                print(cols.line(label, f"{s:.0e}", f"{r['wall_s']:.3f}", f"{r['alone_s']:.3f}", f"{r['pss_mb']:.0f}",
                                f"{r['pss_anon_mb']:.0f}", f"{r['index_pss_mb']:.1f}", f"{r['base_pss_mb']:.0f}",
                                f"{bound:.0f}"))
            if old and peer and not any("error" in r for _, _, r in nodes[-2:]):
                a, b = nodes[-2][2], nodes[-1][2]
                print(f"  previous / this main at {peer:.0e} (both load_index(verify=False): the same work): "
                      f"{b['wall_s'] / a['wall_s']:.1f}x wall, {b['pss_mb'] / a['pss_mb']:.1f}x PSS")
                if old_rank_mb:
                    print(f"  (the previous main runs 8 at {peer:.0e}, not {args.samples:.0e}: one of its ranks took "
                          f"+{old_rank_mb:,.0f} MB at {args.samples:.0e} (above), 8 of them {8 * old_rank_mb / 1024:.1f} GB)")
            a = nodes[0][2]
            if "error" not in a:
                steps = -(-args.samples // (8 * args.batch_size))
                print(f"  world 8 means ~{steps:,} global steps at batch {args.batch_size}: a plan is O(buckets + steps), "
                      f"so its set-up grows with samples / (8 x batch), as the batch {args.node_batch_sizes} rows show")
            print("  PSS MB: summed over the 8 while they hold their plans (imports included: 'PSS imports' is the sum "
                  "before the start); index pages: PSS of the index mapping summed (each shared page once); "
                  "bound = index pages + 8 x 64 MB")
            if "error" not in a:
                print(f"  this main: {a['wall_s']:.3f} s, PSS {a['pss_mb']:.0f} MB "
                      f"(target <= 1 s and PSS <= bound = {a['index_pss_mb'] + 512:.0f} MB)")

        if "huge" not in skip:
            print(f"\n[huge] {args.huge:.0e} samples, {args.huge_world:.0e} ranks, one rank: set-up + plan[0]", flush=True)
            cols = Columns("{:<44} {:>10} {:>8} {:>8} {:>8} {:>9} {:>8}")
            print(cols.header("input", "samples", "load s", "plan s", "total s", "extra MB", "batches"))
            hrank = args.huge_world // 2 + 7
            r = best(_child("ranges", args.huge, args.buckets, args.huge_world, hrank, args.batch_size),
                     args.repeat, work, _env(None))
            print(cols.line("bucket counts alone (Dataset of IdRange)", f"{args.huge:.0e}", "-", _fmt(r, "plan_s", ".3f"),
                            _fmt(r, "wall_s", ".3f"), _fmt(r, "extra_mb", ".1f"), r.get("batches", r.get("error"))))
            for shrink, label in ((3, "elastic: rest of epoch on 3/4 of the ranks"), (6, "elastic: ... on 3/2 of them")):
                r = best(_child("elastic", args.huge, args.buckets, args.huge_world, hrank, args.batch_size, shrink),
                         args.repeat, work, _env(None))
                print(cols.line(label, f"{args.huge:.0e}", "-", _fmt(r, "plan_s", ".3f"), _fmt(r, "wall_s", ".3f"),
                                _fmt(r, "extra_mb", ".1f"), r.get("batches", r.get("error"))))
            real = synthetic(args.real, max(1, args.real * args.shards // args.samples))
            for world in (args.huge_world, args.world):
                rr = best(_child("rank", "-", real, world, world // 2 + 7, args.batch_size), args.repeat, work, _env(None))
                print(cols.line(f"index file ({os.path.getsize(real) / 2**30:.1f} GiB), {world:.0e} ranks",
                                f"{args.real:.0e}", _fmt(rr, "load_s", ".3f"), _fmt(rr, "plan_s", ".3f"),
                                _fmt(rr, "wall_s", ".3f"), _fmt(rr, "extra_mb", ".1f"),
                                rr.get("batches", rr.get("error"))))
            if not args.keep:
                os.remove(real)
            print("  target: <= 1 s and <= 128 MB extra")

        if "bytes" not in skip:
            from wds_pad import build_index, load_index

            print("\n[bytes] bytes per sample on disk, per section (Index.bytes_per_sample())", flush=True)
            shards_dir = os.path.join(work, "tars")
            subprocess.run([sys.executable, str(TOOLS / "make_shards.py"), "images", shards_dir, "--samples", "3000",
                            "--shards", "6"], check=True, capture_output=True)
            tar_index = build_index(sorted(str(x) for x in Path(shards_dir).glob("*.tar")), bucket_by="aspect",
                                    name="tars")
            tables = [(f"synthetic {args.samples:.0e}", load_index(v2).bytes_per_sample()),
                      ("real tars (make_shards images, 3000)", tar_index.bytes_per_sample())]
            keys = list(dict.fromkeys(k for _, t in tables for k in t if k != "total")) + ["total"]
            cols = Columns("{:<38}" + " {:>9}" * len(keys))
            short = {"bucket_offsets": "bkt_offs", "shards+excluded": "json", "key_offsets": "key_offs",
                     "member_start": "mem_start", "member_ext": "mem_ext", "member_size": "mem_size", "member_offset": "mem_off"}
            print(cols.header("index", *[short.get(k, k) for k in keys]))
            for label, t in tables:
                print(cols.line(label, *(f"{t[k]:.2f}" if k in t else "-" for k in keys)))
            if v1:
                print(f"  the same synthetic samples in format v1 (previous main): "
                      f"{os.path.getsize(v1) / args.samples:.2f} bytes per sample, v2: "
                      f"{os.path.getsize(v2) / args.samples:.2f}")
            shutil.rmtree(shards_dir)
    finally:
        for note in notes:
            print("note:", note)
        if not args.keep:
            for path in made:
                if os.path.exists(path):
                    os.remove(path)
            if not args.dir:
                shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
