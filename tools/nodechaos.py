"""Chaos run of the node cache: random kill -9 of a rank or a DataLoader worker, then a restart.

One node of ``--nprocs`` processes (default 4: dp 2 x cp 2, 2 DataLoader workers each) streams
``--shards`` shards over loopback HTTP (nginx, or the Python fallback, behind our FaultProxy,
which counts the GETs) with ``locality="shard"`` through one ``cache_dir``, for ``--epochs``
epochs (``tools/nodejob.py``). Over and over: start the job from the ranks' saved states,
wait until every rank is past the rendezvous (half the time: until every rank has received
a batch), then a random moment (0-3 s), SIGKILL one of its processes at random (a rank or
one of its workers), wait for the rest to end; a job that completes is checked, and a new
one starts on an empty ``cache_dir``, so kills fall on downloads as well as on reads.
Every run must end: a run that outlives ``--timeout`` counts as a hang. Then it reports:

* restarts that failed (a rank other than the one hit exited with an error) or hung;
* wrong bytes (every rank compares every sample with the shards on local disk), and batches
  missing, unplanned or differing from each rank's plan, over every job;
* what each job's cache holds at its end beyond what it keeps by design (complete shards
  named by the index, byte for byte the shards): partial files, temp files, done lists,
  anything else;
* GETs per shard fetch per job (every block of every shard once = 1.00).

Usage::

    python tools/nodechaos.py [--kills 30] [--seed 0] [--epochs 2] [--shards 16]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import nodejob  # noqa: E402
from faultproxy import FaultProxy  # noqa: E402
from servers import http_server  # noqa: E402

from wds_pad.cli.synth import make_blob_shards  # noqa: E402
from wds_pad.index.build import build_index  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--samples", type=int, default=640)
    ap.add_argument("--sample-bytes", type=int, default=4000)
    ap.add_argument("--block-bytes", type=int, default=16 * 1024)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds a run may take before it counts as hung")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="wds_pad_chaos_"))
    try:
        www = root / "www"
        make_blob_shards(www / "d", samples=args.samples, sample_bytes=args.sample_bytes, shards=args.shards, seed=1)
        names = sorted(p.name for p in (www / "d").glob("*.tar"))
        with http_server(www) as server:
            proxy = FaultProxy(server.host, server.port).start()
            try:
                index = build_index([f"http://{proxy.host}:{proxy.port}/d/{n}" for n in names], "aspect:width,height",
                                    output=str(root / "ix.wdsidx"))
                blocks = sum(-(-s.size // args.block_bytes) for s in index.shards)
                proxy.reset_counters()
                report = chaos(args, rng, root, str(root / "ix.wdsidx"), www / "d")
                gets = proxy.requests_seen
            finally:
                proxy.stop()
        jobs = report["jobs"]
        print(f"{args.kills} kills ({report['kinds']}) over {report['runs']} runs of {jobs} job(s) of "
              f"{args.epochs} epoch(s): {args.nprocs} ranks (cp {args.cp}) x {args.workers} workers, {args.shards} shards")
        print(f"restarts that failed: {report['failed']}, hung: {report['hung']}")
        print(f"wrong bytes: {report['wrong']} samples; batches missing {report['missing']}, unplanned "
              f"{report['unplanned']}, differing {report['differing']} (received twice, before a state was saved: "
              f"{report['repeated']})")
        print(f"left in the jobs' caches beyond their complete shards: {report['left']}; complete shards "
              f"{report['shards']} of {jobs} x {args.shards}, byte for byte the shards: {report['exact']}")
        print(f"GETs per shard fetch per job: {gets / blocks / jobs:.2f} ({gets} GETs for {jobs} jobs of {blocks} "
              f"blocks; a job without kills makes 1.00)")
        bad = report["failed"] + report["hung"] + report["wrong"] + report["missing"] + report["unplanned"] \
            + report["differing"] + len(report["left"]) + (not report["exact"])
        return 1 if bad else 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


def streaming(job: nodejob.Job, state: Path) -> bool:
    """Whether every rank of the run has received a batch (all are in an epoch)."""
    return job.started() and all(any(e["run"] == job.run for e in entries)
                                 for entries in nodejob.logs(state, job.nprocs).values())


def chaos(args: argparse.Namespace, rng: random.Random, root: Path, index: str, reference: Path) -> dict:
    kw = {"batch_size": 4, "seed": 5, "window": 2, "cp": args.cp}
    expected = nodejob.expected_batches(index, args.nprocs, args.epochs, **kw)
    out = dict.fromkeys(("runs", "failed", "hung", "wrong", "missing", "unplanned", "differing", "repeated"), 0)
    kinds = {"rank": 0, "worker": 0}
    jobs, kills, left, shards, exact = 0, 0, [], 0, True
    state = None
    local = {p.read_bytes() for p in reference.glob("*.tar")}
    while (kills < args.kills or state is not None) and out["runs"] < 3 * args.kills + 10:
        if state is None:  # a new job, on an empty cache_dir: kills fall on downloads too
            jobs += 1
            state, cache = root / f"state{jobs}", root / f"cache{jobs}"
            state.mkdir()
        job_args = ["--index", index, "--reference", str(reference), "--cache-dir", str(cache), "--state", str(state),
                    "--epochs", str(args.epochs), "--workers", str(args.workers), "--cp", str(args.cp),
                    "--batch-size", "4", "--seed", "5", "--window", "2", "--block-bytes", str(args.block_bytes)]
        job = nodejob.Job(job_args, args.nprocs, run=f"r{out['runs']}", timeout=args.timeout).start()
        out["runs"] += 1
        victim = None
        if kills < args.kills:
            # during the epoch (a kill in the rendezvous only stalls gloo's): as shards arrive, or later
            ready = job.started if rng.random() < 0.5 else (lambda: streaming(job, state))
            while not ready() and any(p.poll() is None for p in job.procs):
                time.sleep(0.01)
            until = time.monotonic() + rng.uniform(0.0, 3.0)
            while time.monotonic() < until and any(p.poll() is None for p in job.procs):
                time.sleep(0.01)
            victim = job.kill_one(rng)
            if victim is not None:
                kills += 1
                kinds[victim.split()[0]] += 1
        try:
            codes = job.wait()
        except nodejob.Hang as exc:
            out["hung"] += 1
            print(f"hung: {exc}", file=sys.stderr)
            continue
        hit = int(victim.rsplit(" ", 1)[1]) if victim else -1
        failed = [r for r, c in enumerate(codes) if c != 0 and r != hit]
        if failed:
            out["failed"] += 1
            print(f"run {out['runs']} (killed {victim}): ranks {failed} failed\n{job.outputs()}", file=sys.stderr)
        if all(c == 0 for c in codes) and all((state / f"rank{r}.json").exists() for r in range(args.nprocs)):
            counts = nodejob.check_logs(state, args.nprocs, expected)
            for k in ("wrong", "missing", "unplanned", "differing", "repeated"):
                out[k] += counts[k]
            found = nodejob.cache_left(cache)  # the job completed: what its cache holds
            left += found["part"] + found["tmp"] + found["done"] + found["other"]
            shards += len(found["shard"])
            exact = exact and {(cache / n).read_bytes() for n in found["shard"]} == local
            state = None
    return {**out, "jobs": jobs, "kinds": kinds, "left": left, "shards": shards, "exact": exact}


if __name__ == "__main__":
    sys.exit(main())
