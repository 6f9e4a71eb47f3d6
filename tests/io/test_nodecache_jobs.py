"""One node's processes share one copy of each shard: GET counts and kill -9, in real jobs.

A node of 4 processes (dp 2 x cp 2, gloo on loopback, started as torchrun starts them),
each with 2 DataLoader workers, streams 16 shards with ``locality="shard"`` over loopback
HTTP through one ``ReadOptions(cache_dir=...)`` (``tools/nodejob.py``). GETs are counted at
the FaultProxy in front of the server; a shard is several ``block_bytes`` GETs, so the
figures are GETs per shard fetch (all blocks of every shard = 1.0). Every rank checks
every sample's bytes against the shards on local disk, and the logs of all runs must add
up to each rank's plan, each batch once. Without a cache_dir the job shares a folder of its
own in the temporary directory, gone when it ends. The runs that need no kill and no exit
of their own are the session's, in one launch (``job_runs``, ``tests/nodejob_runs.py``).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

import nodechaos  # tools/ is on sys.path (tests/conftest.py)
import nodejob
import nodejob_runs
from data_helpers import serve_dir
from wds_pad import load_index
from wds_pad.index.build import build_index

pytest_plugins = ["conftest_servers"]
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

NPROCS, CP, WORKERS, SHARDS, EPOCHS = 4, 2, 2, 16, 2
BLOCK = 16 * 1024
KW = {"batch_size": 4, "seed": 5, "window": 2, "cp": CP}


@pytest.fixture(scope="module")
def shard_dir(job_shards: Path) -> Path:
    assert len(list(job_shards.glob("*.tar"))) == SHARDS
    return job_shards


@pytest.fixture
def served(nginx_server: Any, shard_dir: Path, fault_proxy: Any, tmp_path: Path) -> tuple[Any, str, int]:
    base = serve_dir(nginx_server, shard_dir, "node-train")
    proxy = fault_proxy(nginx_server)
    url = base.replace(f"{nginx_server.host}:{nginx_server.port}", f"{proxy.host}:{proxy.port}")
    names = sorted(p.name for p in shard_dir.glob("*.tar"))
    index = build_index([f"{url}/{n}" for n in names], "aspect:width,height", output=str(tmp_path / "ix.wdsidx"))
    proxy.reset_counters()
    return proxy, str(tmp_path / "ix.wdsidx"), sum(-(-s.size // BLOCK) for s in index.shards)


def job_args(index: str, reference: Path, cache: Path, state: Path, **extra: Any) -> list[str]:
    args = ["--index", index, "--reference", str(reference), "--cache-dir", str(cache), "--state", str(state),
            "--epochs", str(extra.get("epochs", EPOCHS)), "--workers", str(WORKERS), "--cp", str(CP),
            "--batch-size", str(KW["batch_size"]), "--seed", str(KW["seed"]), "--window", str(KW["window"]),
            "--block-bytes", str(BLOCK)]
    return args + (["--pause"] if extra.get("pause") else [])


def finished(job: nodejob.Job) -> None:
    codes = job.wait()
    assert codes == [0] * NPROCS, job.outputs()


def settled(proxy: Any, quiet: float = 0.3) -> int:
    """The proxy's request count once no request has arrived for ``quiet`` seconds (those a
    killed process sent just before it died are counted too)."""
    seen, since = proxy.requests_seen, time.monotonic()
    while time.monotonic() - since < quiet:
        time.sleep(0.05)
        if proxy.requests_seen != seen:
            seen, since = proxy.requests_seen, time.monotonic()
    return seen


def blocks_on_disk(folder: Path) -> int:
    """The ``BLOCK`` GETs the copies in ``folder`` hold: every block of a complete shard, the
    whole blocks of a ``.part`` (a restart fetches the rest from its last byte)."""
    return (sum(-(-p.stat().st_size // BLOCK) for p in folder.glob("*.shard"))
            + sum(p.stat().st_size // BLOCK for p in folder.glob("*.part")))


def logged(state: Path) -> int:
    return min(len(v) for v in nodejob.logs(state, NPROCS).values())


def test_one_node_fetches_each_shard_once_keeps_it_and_a_restart_or_warm_job_fetches_nothing_again(
        job_runs: Any, served: tuple[Any, str, int], shard_dir: Path, tmp_path: Path) -> None:
    # epoch 0, then epoch 1 of the same job: every shard fits cache_bytes (the session's run
    # "one-node" of tests/nodejob_runs.py: these options, each epoch's requests counted apart)
    first, index = job_runs.runs["one-node"], job_runs.index
    assert [first.arg(a) for a in ("--cp", "--locality", "--epochs", "--workers")] == [str(CP), "shard", "2", "2"]
    assert "--local-world-size" not in first.args  # one node of the 4 processes
    blocks = sum(-(-s.size // BLOCK) for s in load_index(index).shards)
    expected = nodejob.expected_batches(index, NPROCS, EPOCHS, **KW)
    batches = sum(len(v) for v in expected.values())
    epoch0, epoch1 = first.requests
    assert nodejob.check_logs(first.state, NPROCS, expected) == {
        "batches": batches, "repeated": 0, "wrong": 0, "missing": 0, "unplanned": 0, "differing": 0}
    assert epoch0 == blocks  # each shard once over the node: 1.0 per shard, CP peers and workers included
    assert epoch1 == 0
    left = first.left
    assert len(left["shard"]) == SHARDS and not left["part"] + left["tmp"] + left["done"] + left["other"]

    # a job killed with SIGKILL mid-epoch, restarted from its states on the same cache_dir
    proxy, index, blocks = served
    expected = nodejob.expected_batches(index, NPROCS, EPOCHS, **KW)
    cache2, state2 = tmp_path / "cache2", tmp_path / "state2"
    state2.mkdir()
    proxy.reset_counters()
    job = nodejob.Job(job_args(index, shard_dir, cache2, state2, epochs=1), NPROCS, run="killed").start()
    while logged(state2) < 6:
        assert all(p.poll() is None for p in job.procs), job.outputs()
        time.sleep(0.02)
    job.kill_all()
    killed_at = settled(proxy)
    done = blocks_on_disk(cache2)  # what the killed run left: the GETs it had in flight are lost
    finished(nodejob.Job(job_args(index, shard_dir, cache2, state2, epochs=1), NPROCS, run="restart").start())
    restart = proxy.requests_seen
    one = {r: {k: v for k, v in e.items() if k[0] == 0} for r, e in expected.items()}
    counts = nodejob.check_logs(state2, NPROCS, one)
    assert counts["wrong"] == counts["missing"] == counts["unplanned"] == counts["differing"] == 0, counts
    print(f"GETs per shard: epoch 0 {epoch0 / blocks:.2f}, epoch 1 {epoch1 / blocks:.2f}, killed run "
          f"{killed_at / blocks:.2f} ({done / blocks:.2f} on disk) + restart {(restart - killed_at) / blocks:.2f}")
    heads = sum(r.method == "HEAD" for r in proxy.requests)
    assert heads <= SHARDS  # the restart is another job: one HEAD per shard it found cached, at most
    print(f"restart: HEADs per shard {heads / SHARDS:.2f}")
    assert killed_at >= done  # every block on disk was fetched once
    assert restart - killed_at - heads <= blocks - done + 0.05 * blocks  # the restart fetches what is not there

    # a new job on the warm cache_dir of the first (the session's run "one-node-warm")
    warm, index = job_runs.runs["one-node-warm"], job_runs.index
    assert warm.arg("--cache-dir") == first.arg("--cache-dir") and warm.arg("--epochs") == "1"
    heads, requests = warm.heads[0], warm.requests[0]
    assert heads <= SHARDS  # each cached shard checked against the store once per job, by one process
    print(f"warm job: GETs per shard fetch {(requests - heads) / blocks:.2f}, HEADs per shard {heads / SHARDS:.2f}")
    assert requests - heads <= 0.05 * blocks
    one = {r: {k: v for k, v in e.items() if k[0] == 0}
           for r, e in nodejob.expected_batches(index, NPROCS, EPOCHS, **KW).items()}
    assert nodejob.check_logs(warm.state, NPROCS, one)["missing"] == 0


@pytest.mark.parametrize("kills", [3])
def test_random_kills_of_ranks_and_workers_never_break_a_restart_nor_the_bytes_nor_the_cache(
        served: tuple[Any, str, int], shard_dir: Path, tmp_path: Path, kills: int) -> None:
    """kill -9 of a random process (a rank or one of its DataLoader workers) at a random
    moment of a run, then a restart from the saved states: no restart fails or hangs, no
    byte is wrong, every planned batch arrives, and the cache holds exactly the complete
    shards, each byte for byte the shard."""
    _, index, _ = served
    expected = nodejob.expected_batches(index, NPROCS, EPOCHS, **KW)
    cache, state = tmp_path / "cache", tmp_path / "state"
    state.mkdir()
    rng = random.Random(11)
    for k in range(kills):
        job = nodejob.Job(job_args(index, shard_dir, cache, state), NPROCS, run=f"kill{k}", timeout=240).start()
        while not nodechaos.streaming(job, state) and any(p.poll() is None for p in job.procs):
            time.sleep(0.02)  # during the epoch (a rank killed in the rendezvous stalls gloo, not the cache)
        deadline = time.monotonic() + rng.uniform(0.0, 2.0)
        while time.monotonic() < deadline and any(p.poll() is None for p in job.procs):
            time.sleep(0.02)
        victim = job.kill_one(rng)
        codes = job.wait()  # a hang raises nodejob.Hang
        hit = int(victim.rsplit(" ", 1)[1]) if victim else -1
        assert all(c == 0 for r, c in enumerate(codes) if r != hit), (victim, codes, job.outputs())
    finished(nodejob.Job(job_args(index, shard_dir, cache, state), NPROCS, run="last", timeout=240).start())
    counts = nodejob.check_logs(state, NPROCS, expected)
    assert counts["wrong"] == counts["missing"] == counts["unplanned"] == counts["differing"] == 0, counts
    left = nodejob.cache_left(cache)
    assert not left["part"] + left["tmp"] + left["done"] + left["other"], left
    assert len(left["shard"]) == SHARDS
    sizes = sorted(os.path.getsize(cache / n) for n in left["shard"])
    assert sizes == sorted(os.path.getsize(p) for p in shard_dir.glob("*.tar"))
    local = {p.read_bytes() for p in shard_dir.glob("*.tar")}
    assert {(cache / n).read_bytes() for n in left["shard"]} == local
    shutil.rmtree(cache)


def test_a_torchrun_job_without_cache_dir_shares_a_folder_of_its_own_and_removes_it_at_its_end(
        served: tuple[Any, str, int], shard_dir: Path, tmp_path: Path) -> None:
    """No cache_dir: the node's processes share ``wds_pad-node-<digest>`` in the temporary
    directory (named after the job's MASTER_ADDR:MASTER_PORT here), one fetch per shard,
    and the last process to leave removes it."""
    proxy, index, blocks = served
    tmp, state = tmp_path / "tmp", tmp_path / "state"
    tmp.mkdir()
    state.mkdir()
    args = job_args(index, shard_dir, tmp_path / "unused", state, epochs=1)
    at = args.index("--cache-dir")
    del args[at:at + 2]
    job = nodejob.Job(args, NPROCS, run="default", env={"TMPDIR": str(tmp)}).start()
    seen: set[str] = set()
    while any(p.poll() is None for p in job.procs):
        # a process that loses the race to make the folder drops its ``<name>.<rand>.tmp``:
        # count the folders themselves; the check after the job catches any leftover
        seen |= {p.name for p in tmp.iterdir() if re.fullmatch(r"wds_pad-node-[0-9a-f]{16}", p.name)}
        time.sleep(0.02)
    assert job.wait() == [0] * NPROCS, job.outputs()
    assert len(seen) == 1  # one folder for the node's 4 ranks and 8 workers
    assert proxy.requests_seen == blocks
    assert not [p for p in tmp.iterdir() if p.name.startswith("wds_pad-node-")]
    one = {r: {k: v for k, v in e.items() if k[0] == 0}
           for r, e in nodejob.expected_batches(index, NPROCS, 1, **KW).items()}
    counts = nodejob.check_logs(state, NPROCS, one)
    assert counts["wrong"] == counts["missing"] == counts["unplanned"] == counts["differing"] == 0, counts


@pytest.mark.parametrize("sizing", ["batch", "budget"])
def test_two_nodes_with_node_locality_fetch_nothing_again_after_the_first_epoch(job_runs: Any, sizing: str) -> None:
    """2 simulated nodes x 2 ranks (LOCAL_WORLD_SIZE=2, each node its own cache_dir),
    ``locality="node"``, a fixed batch or a cost budget: a node keeps its shards, and the
    other nodes' shards it reads (even a sample of one read once an epoch), every epoch, so
    epochs 1 and 2 make no GET at all; bytes exact. (The session's 3-epoch runs of
    ``tests/nodejob_runs.py``, which test_simulate_jobs.py checks too.)"""
    run, index = job_runs.runs[nodejob_runs.epoch_run("node", sizing, 2)], job_runs.index
    blocks = sum(-(-s.size // nodejob_runs.BLOCK) for s in load_index(index).shards)
    kw = {**KW, "cp": 1, "locality": "node", "local_world_size": 2}
    if sizing == "budget":  # 4000-byte samples of widths 16..1024: a few to a batch
        kw = {**kw, "budget": nodejob_runs.BUDGET}
    expected = nodejob.expected_batches(index, NPROCS, 3, **kw)
    counts = nodejob.check_logs(run.state, NPROCS, expected)
    assert counts["wrong"] == counts["missing"] == counts["repeated"] == counts["unplanned"] == 0, counts
    seen = run.requests
    print(f"GETs, two nodes, {sizing}: per epoch {seen} ({blocks} blocks in the shards)")
    assert len(seen) == 3
    assert seen[0] <= 2 * blocks  # each node its own shards, and a few of the other's
    assert seen[1] == seen[2] == 0
    assert sorted(p.name for p in Path(run.arg("--cache-dir")).iterdir()) == ["node0", "node1"]
