"""Several runs of ``tools/nodejob.py``'s job in one launch: the ranks start and meet once.

Starting a real job (4 Python processes importing torch, a gloo rendezvous) costs more
than streaming the tests' 16 small shards, so the tests that compare configurations of
the job run them all in one process tree. Each rank runs the configurations in turn, each
with its own ``--state`` and ``--cache-dir`` folders, its ``LOCAL_WORLD_SIZE`` and a job
name of its own (``TORCHELASTIC_RUN_ID``, as torchrun names a job: a run on the cache
folders another run left is another job to them, which checks the copies it finds).
Every run pauses after each of its epochs (``--pause``): the launcher counts the requests
of each epoch of each run at the proxy apart, then lets the ranks go on.

As a library: :func:`run_all` launches the runs and returns what each epoch asked of the
proxy. As a script, it is each rank::

    python tests/nodejob_runs.py --state DIR --runs '{"name": [nodejob args...], ...}'
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
if str(HERE.parents[1] / "tools") not in sys.path:  # as a rank; under pytest tests/conftest.py puts it there
    sys.path.insert(0, str(HERE.parents[1] / "tools"))

import nodejob  # noqa: E402


@dataclass
class Run:
    """One run of the job: its nodejob arguments (``--state`` and ``--pause`` added), and
    what its epochs asked of the proxy, once :func:`run_all` has run it.

    Attributes:
        args: nodejob's arguments, without ``--state`` (see :func:`nodejob.parser`).
        state: the run's state folder (logs, saved states, pause files).
        requests: per epoch, every request the proxy saw (HEADs included).
        heads: per epoch, the HEAD requests among them.
        left: what its ``--cache-dir`` held at its end (:func:`nodejob.cache_left`).
    """

    args: list[str]
    state: Path = Path()
    requests: list[int] = field(default_factory=list)
    heads: list[int] = field(default_factory=list)
    left: dict[str, list[str]] = field(default_factory=dict)

    def arg(self, name: str) -> str:
        return self.args[self.args.index(name) + 1]


def rank_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state", required=True, help="the launch's folder (each rank's output)")
    ap.add_argument("--runs", required=True, help="JSON: run name -> nodejob arguments")
    opts = ap.parse_args(argv)
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    for name, args in json.loads(opts.runs).items():
        parsed = nodejob.parser().parse_args(args)
        os.environ.update(LOCAL_WORLD_SIZE=str(parsed.local_world_size or dist.get_world_size()),
                          TORCHELASTIC_RUN_ID=name, NODEJOB_RUN=name)
        nodejob.stream(parsed)
    print(json.dumps({"rank": dist.get_rank(), "ok": True}), flush=True)
    return 0


def run_all(runs: dict[str, Run], nprocs: int, proxy: Any, folder: Path, timeout: float = 480.0) -> None:
    """Runs ``runs`` in order in one launch of ``nprocs`` ranks, each in ``folder/<name>``
    (its ``state`` set), counting each epoch's requests at ``proxy`` (reset in between).

    Raises:
        AssertionError: a rank failed (every rank's output in the message).
        nodejob.Hang: the launch outlived ``timeout`` (every process was killed).
    """
    for name, run in runs.items():
        run.state = folder / name
        run.state.mkdir(parents=True)
        run.args = [*run.args, "--state", str(run.state), "--pause"]
    job = nodejob.Job(["--state", str(folder), "--runs", json.dumps({n: r.args for n, r in runs.items()})],
                      nprocs, run="runs", timeout=timeout, script=HERE)
    proxy.reset_counters()
    job.start()
    deadline = time.monotonic() + timeout
    for run in runs.values():
        for e in range(int(run.arg("--epochs"))):
            while not (run.state / f"done{e}").exists():
                assert all(p.poll() is None for p in job.procs), job.outputs()
                if time.monotonic() > deadline:
                    job.kill_all()
                    raise nodejob.Hang(f"runs outlived {timeout:.0f} s:\n{job.outputs()}")
                time.sleep(0.02)
            run.requests.append(proxy.requests_seen)  # the ranks wait: nothing is in flight
            run.heads.append(sum(r.method == "HEAD" for r in proxy.requests))
            proxy.reset_counters()
            if e == int(run.arg("--epochs")) - 1:  # its workers are gone, the ranks wait
                run.left = nodejob.cache_left(Path(run.arg("--cache-dir")))
            (run.state / f"go{e}").write_text("")
    assert job.wait() == [0] * nprocs, job.outputs()


# -- the runs tests/io shares -------------------------------------------------------------------
#: 4 ranks read 16 shards in blocks of 16 KiB; plans of seed 5, window 2, cp 1, 4 samples a batch
#: (or a budget of 2048 of cost "json:width"); the epoch runs have 3 epochs, the cold and warm ones 1.
NPROCS, EPOCHS, BLOCK, SEED, WINDOW, BUDGET = 4, 3, 16 * 1024, 5, 2, 2048.0
LOCALITIES, SIZINGS, PER_NODE = ("none", "shard", "node"), ("batch", "budget"), (4, 2)
#: (locality, processes per node) of the jobs run twice on one cache: cold, then warm
WARM = (("node", 2), ("shard", 4))


def epoch_run(locality: str, sizing: str, per_node: int) -> str:
    """The name of the 3-epoch run of these options."""
    return f"{locality}-{sizing}-{per_node}"


def io_runs(index: str, reference: Path, caches: Path) -> dict[str, Run]:
    """What tests/io runs once per session: a 3-epoch run per locality, sizing and node
    size (:func:`epoch_run`), each on a cache folder of its own; then for each of
    :data:`WARM` a 1-epoch run (``cold-<locality>-<per node>``) and another one
    (``warm-...``) on the cache folders the first left; then ``one-node``, 2 epochs of one
    node of dp 2 x cp 2 with ``locality="shard"``, and ``one-node-warm``, 1 epoch on its
    cache folder."""
    def args(cache: Path, epochs: int, locality: str, sizing: str, per_node: int, cp: int = 1) -> list[str]:
        return ["--index", index, "--reference", str(reference), "--cache-dir", str(cache), "--epochs", str(epochs),
                "--workers", "2", "--cp", str(cp), "--batch-size", "4", "--seed", str(SEED), "--window", str(WINDOW),
                "--block-bytes", str(BLOCK), "--locality", locality] + (
                    ["--local-world-size", str(per_node)] if per_node else []) + (
                    ["--budget", str(BUDGET)] if sizing == "budget" else [])

    runs = {epoch_run(lo, si, pn): Run(args(caches / epoch_run(lo, si, pn), EPOCHS, lo, si, pn))
            for lo in LOCALITIES for si in SIZINGS for pn in PER_NODE}
    for locality, per_node in WARM:
        for kind in ("cold", "warm"):
            runs[f"{kind}-{locality}-{per_node}"] = Run(args(caches / f"warm-{locality}-{per_node}", 1, locality,
                                                             "batch", per_node))
    runs["one-node"] = Run(args(caches / "one-node", 2, "shard", "batch", 0, cp=2))
    runs["one-node-warm"] = Run(args(caches / "one-node", 1, "shard", "batch", 0, cp=2))
    return runs


if __name__ == "__main__":
    sys.exit(rank_main())
