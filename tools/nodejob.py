"""One node's training-like job over remote shards, and a launcher that kills and restarts it.

The job: ``--nprocs`` ranks (gloo on loopback, started as torchrun starts them: ``RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), each streaming its
plan of an index of remote shards with ``locality="shard"`` through a ``Loader`` with
DataLoader workers and one ``ReadOptions(cache_dir=...)``. Every rank checks every
sample's bytes against the shards on local disk, logs each batch it receives (epoch,
batch index, keys, wrong bytes) to ``<state>/log-rank<r>.jsonl`` and saves its loader's
state after each batch (``<state>/rank<r>.json``, atomically); a started rank resumes
from its saved state.

As a library (the tests, ``tools/nodechaos.py`` and ``tools/bench/nodecache.py`` use it):
:class:`Job` starts the ranks, kills one process of them (a rank or one of its DataLoader
workers) with SIGKILL, waits with a deadline (a job that outlives it is a hang);
:func:`check_logs` says whether the logs of every run add up to each rank's plan, each
batch once, every byte right; :func:`cache_left` lists what a cache folder holds.

Run a rank by hand::

    python tools/nodejob.py --index IX --reference DIR --cache-dir D --state S [--epochs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", required=True)
    ap.add_argument("--reference", required=True, help="folder of the same shards on local disk")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--state", required=True, help="folder of the ranks' states and logs")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--budget", type=float, default=0.0, help="a cost budget per batch instead of --batch-size "
                    "(the index must record costs)")
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--block-bytes", type=int, default=64 * 2**20)
    ap.add_argument("--cache-bytes", type=int, default=2 * 2**30)
    ap.add_argument("--locality", choices=["none", "shard", "node"], default="shard")
    ap.add_argument("--local-world-size", type=int, default=0,
                    help="processes per simulated node (0: every process on one node); each node then "
                         "has its own folder under --cache-dir")
    ap.add_argument("--step-ms", type=float, default=0.0, help="a training step's time, slept after each batch")
    ap.add_argument("--lockstep", action="store_true",
                    help="a barrier of every rank after each batch, as a training step's all-reduce makes")
    ap.add_argument("--pause", action="store_true",
                    help="after each epoch, wait (all ranks) for <state>/go<epoch> once <state>/done<epoch> is written")
    return ap


def _same(sample: dict[str, Any], ref: dict[str, Any]) -> bool:
    members = {k for k in ref if not k.startswith("__")}
    return members == {k for k in sample if not k.startswith("__")} and all(sample[k] == ref[k] for k in members)


def rank_main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    stream(args)
    print(json.dumps({"rank": dist.get_rank(), "ok": True}), flush=True)
    return 0


def stream(args: argparse.Namespace) -> None:
    """One run of the job in this rank, its gloo process group made: every epoch of
    ``args`` (see :func:`parser`), logged and checked."""
    import torch.distributed as dist
    import webdataset as wds

    from wds_pad import BucketedWebDataset, DroppedBucketWarning, Loader, ReadOptions
    from wds_pad.io.atomic import atomic_write

    shards = sorted(str(p) for p in Path(args.reference).glob("*.tar"))
    reference = {s["__key__"]: s for s in wds.WebDataset(shards, shardshuffle=False, nodesplitter=lambda x: x)}
    rank = dist.get_rank()
    run = os.environ.get("NODEJOB_RUN", "0")
    if args.local_world_size and args.cache_dir:  # a simulated node: its own folder, as another machine has
        args.cache_dir = os.path.join(args.cache_dir, f"node{rank // args.local_world_size}")
    (Path(args.state) / f"started-{run}-rank{rank}").write_text("")  # past the rendezvous
    opts = ReadOptions(cache_dir=args.cache_dir, block_bytes=args.block_bytes, cache_bytes=args.cache_bytes,
                       max_in_flight=8)
    warnings.simplefilter("ignore", DroppedBucketWarning)
    from wds_pad import Budget
    ds = BucketedWebDataset(args.index, batch_size=Budget(args.budget) if args.budget else args.batch_size, seed=args.seed, locality=args.locality,
                            window=args.window, cp_size=args.cp, read_options=opts, check_agreement=False)
    loader = Loader(ds, num_workers=args.workers)
    state_dir = Path(args.state)
    state = state_dir / f"rank{rank}.json"
    if state.exists():
        loader.load_state_dict(json.loads(state.read_text()))
    with open(state_dir / f"log-rank{rank}.jsonl", "a") as log:
        for epoch in range(loader.epoch, args.epochs):
            loader.set_epoch(epoch)  # the restored epoch keeps its position
            start = time.perf_counter()
            for batch in loader:
                wait = time.perf_counter() - start  # in next(): what the step waited for its data
                wrong = sum(not _same(s, reference[s["__key__"]]) for s in batch)
                log.write(json.dumps({"run": run, "e": batch[0]["__epoch__"], "b": batch[0]["__batch__"],
                                      "keys": [s["__key__"] for s in batch], "wrong": wrong,
                                      "wait": round(wait, 6)}) + "\n")
                log.flush()
                atomic_write(str(state), [json.dumps(loader.state_dict()).encode()])
                if args.step_ms:
                    time.sleep(args.step_ms / 1000)  # the training step
                if args.lockstep:
                    dist.barrier()
                start = time.perf_counter()
            if args.pause:
                dist.barrier()
                if rank == 0:
                    (state_dir / f"done{epoch}").write_text("")
                while not (state_dir / f"go{epoch}").exists():
                    time.sleep(0.02)


# -- the launcher ----------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Hang(AssertionError):
    """A job outlived its deadline (every process of it was killed)."""


class Job:
    """The ranks of one run of the job, each in its own session (its workers with it).

    Args:
        args: the rank's arguments (see :func:`parser`).
        nprocs: ranks, all on this machine (one node).
        run: the run's name, in the logs.
        env: more environment (PYTHONPATH: which wds_pad the ranks import).
        timeout: seconds before the run counts as hung.
        script: what each rank runs (default: this file's :func:`rank_main`); ``args``
            must name a ``--state`` folder, where each rank's output goes.
    """

    def __init__(self, args: Sequence[str], nprocs: int, *, run: str = "0", env: dict[str, str] | None = None,
                 timeout: float = 180.0, script: Path = HERE) -> None:
        self.args, self.nprocs, self.run, self.timeout, self.script = list(args), nprocs, run, timeout, script
        self.env = dict(env or {})
        self.procs: list[subprocess.Popen[bytes]] = []
        self.killed: list[str] = []

    def start(self) -> "Job":
        port = free_port()
        local = int(self._arg("--local-world-size")) if "--local-world-size" in self.args else 0
        base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(self.nprocs),
                "LOCAL_WORLD_SIZE": str(local or self.nprocs), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", "NODEJOB_RUN": self.run, **self.env}
        state = Path(self._arg("--state"))
        for rank in range(self.nprocs):
            out = open(state / f"out-{self.run}-rank{rank}.txt", "wb")  # noqa: SIM115 - the child's
            self.procs.append(subprocess.Popen([sys.executable, str(self.script), *self.args],
                                               env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                               stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               start_new_session=True))
            out.close()
        self._deadline = time.monotonic() + self.timeout
        return self

    def _arg(self, name: str) -> str:
        return self.args[self.args.index(name) + 1]

    def processes(self) -> list[tuple[int, int, str]]:
        """(rank, pid, "rank" or "worker") of every live process of the job."""
        ranks = {p.pid: r for r, p in enumerate(self.procs) if p.poll() is None}
        out = [(r, pid, "rank") for pid, r in ranks.items()]
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            state = stat.rsplit(")", 1)[1].split()[0]
            if ppid in ranks and state != "Z":
                out.append((ranks[ppid], int(entry), "worker"))
        return out

    def started(self) -> bool:
        """Whether every rank of this run is past the rendezvous (its process group made)."""
        state = Path(self._arg("--state"))
        return all((state / f"started-{self.run}-rank{r}").exists() for r in range(self.nprocs))

    def kill_one(self, rng: random.Random, kinds: Sequence[str] = ("rank", "worker")) -> str | None:
        """SIGKILL one process of the job chosen at random (a rank or a DataLoader worker)."""
        live = [p for p in self.processes() if p[2] in kinds]
        if not live:
            return None
        rank, pid, kind = rng.choice(sorted(live))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        what = f"{kind} {pid} of rank {rank}"
        self.killed.append(what)
        return what

    def kill_all(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait()

    def wait(self) -> list[int]:
        """Every rank's exit code (negative: killed by that signal).

        Raises:
            Hang: the run outlived its deadline; every process was killed.
        """
        while any(p.poll() is None for p in self.procs):
            if time.monotonic() > self._deadline:
                self.kill_all()
                raise Hang(f"run {self.run} outlived {self.timeout:.0f} s:\n{self.outputs()}")
            time.sleep(0.05)
        for p in self.procs:  # a rank's workers, if it was killed, go with its session
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return [int(p.returncode) for p in self.procs]

    def outputs(self, limit: int = 3000) -> str:
        state = Path(self._arg("--state"))
        return "\n".join(f"--- rank {r} ---\n" + (state / f"out-{self.run}-rank{r}.txt").read_text(errors="replace")[-limit:]
                         for r in range(self.nprocs))


def logs(state: Path, nprocs: int) -> dict[int, list[dict[str, Any]]]:
    """Every batch each rank logged, over every run, in order."""
    out: dict[int, list[dict[str, Any]]] = {}
    for r in range(nprocs):
        path = state / f"log-rank{r}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        out[r] = [json.loads(line) for line in lines if line.endswith("}")]  # a line cut by SIGKILL: not received
    return out


def check_logs(state: Path, nprocs: int, expected: dict[int, dict[tuple[int, int], list[str]]]) -> dict[str, int]:
    """Whether the runs' logs add up, per rank, to its plan (``expected``: (epoch, batch)
    -> keys): every planned batch received, none but those, a batch received twice (after
    a kill, before its state was saved) the same both times, no wrong byte.

    Returns:
        ``{"batches", "repeated", "wrong", "missing", "unplanned", "differing"}``.
    """
    counts = dict.fromkeys(("batches", "repeated", "wrong", "missing", "unplanned", "differing"), 0)
    for r, entries in logs(state, nprocs).items():
        seen: dict[tuple[int, int], list[str]] = {}
        for e in entries:
            key = (int(e["e"]), int(e["b"]))
            counts["wrong"] += int(e["wrong"])
            if key in seen:
                counts["repeated"] += 1
                counts["differing"] += seen[key] != e["keys"]
                continue
            seen[key] = e["keys"]
            counts["batches"] += 1
            if key not in expected[r]:
                counts["unplanned"] += 1
            elif expected[r][key] != e["keys"]:
                counts["differing"] += 1
        counts["missing"] += len(set(expected[r]) - set(seen))
    return counts


def expected_batches(index: str, nprocs: int, epochs: int, **kw: Any) -> dict[int, dict[tuple[int, int], list[str]]]:
    """Each rank's planned batches: (epoch, batch index) -> sample keys."""
    from wds_pad import BucketedWebDataset, Budget, DroppedBucketWarning, Topology, load_index

    warnings.simplefilter("ignore", DroppedBucketWarning)
    ix = load_index(index)
    out: dict[int, dict[tuple[int, int], list[str]]] = {}
    for r in range(nprocs):
        local = kw.get("local_world_size") or nprocs
        size = Budget(kw["budget"]) if kw.get("budget") else kw["batch_size"]
        ds = BucketedWebDataset(ix, batch_size=size, seed=kw["seed"], locality=kw.get("locality", "shard"),
                                window=kw["window"], topology=Topology(nprocs, r, cp_size=kw["cp"], local_world_size=local),
                                check_agreement=False)
        out[r] = {(e, j): [ix.key(int(i)) for i in ds.plan(e)[j].samples] for e in range(epochs)
                  for j in range(len(ds.plan(e)))}
    return out


def cache_left(folder: Path) -> dict[str, list[str]]:
    """What a cache folder holds, by kind: complete shards, partial ones, temp files,
    done lists, the folder's own files, a complete shard's side files (its checksum, the
    jobs that checked it: "side", each beside its shard), anything else."""
    kinds: dict[str, list[str]] = {k: [] for k in ("shard", "part", "tmp", "done", "own", "side", "other")}
    for p in sorted(folder.iterdir()) if folder.exists() else []:
        if p.name in (".lock", ".users"):
            kinds["own"].append(p.name)
        elif p.suffix in (".sum", ".ok") and (folder / (p.stem + ".shard")).exists():
            kinds["side"].append(p.name)
        elif p.suffix in (".shard", ".part", ".tmp", ".done"):
            kinds[p.suffix[1:]].append(p.name)
        else:
            kinds["other"].append(p.name)
    return kinds


def tmp_state() -> Path:
    return Path(tempfile.mkdtemp(prefix="wds_pad_nodejob_"))


if __name__ == "__main__":
    sys.exit(rank_main())
