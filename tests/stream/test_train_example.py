"""examples/train_ddp.py under preemption: SIGKILL mid-epoch, restart, audit every sample.

One job story, four launches (each with a hard timeout that kills its processes):

A. 4 ranks train (epochs 0-1), checkpointing every 4 steps; the whole job is SIGKILLed
   mid-epoch 1, some batches after its last complete checkpoint;
B. restarted on 2 ranks: every rank refuses the checkpoint with the topology error;
C. restarted on 4 ranks: resumes at the checkpoint and finishes both epochs;
D. restarted under torchrun on 2 ranks with ``--epochs 3 --allow-elastic``: resumes from
   the epoch-boundary checkpoint and trains epoch 2 on the new layout.

The audit reads the per-rank sample logs: the batches a run logged after the checkpoint
the next run resumed from must be replayed identically; with them counted once, every
epoch is exactly the padded plan over all ranks (tests/dist_helpers.check_epoch) and every
rank took the same number of steps.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from data_helpers import plan_keys
from dist_helpers import EXAMPLE, Job, JobFailed, bucket_keys_of, check_epoch, format_outputs, launch, session_dataset

from wds_pad import Topology, plan_epoch
from wds_pad.index.codec import load_index

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
BATCH, EVERY = 4, 4


def read_log(out: Path, rank: int) -> list[list[dict[str, Any]]]:
    """A rank's sample log split into runs: each run is [start event, batch, batch, ...]."""
    runs: list[list[dict[str, Any]]] = []
    for line in (out / f"samples-rank{rank:05d}.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "start":
            runs.append([record])
        elif "event" not in record:
            runs[-1].append(record)
    return runs


def latest_step(out: Path) -> int | None:
    try:
        return int((out / "ckpt" / "latest").read_text().strip().split("-")[1])
    except FileNotFoundError:
        return None


def logged_step(out: Path, rank: int) -> int:
    path = out / f"samples-rank{rank:05d}.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.endswith("}")]
    return max(steps, default=0)


def test_preempted_job_resumes_exactly_and_refuses_another_topology(tmp_path: Path, tmp_path_factory: Any) -> None:
    data = session_dataset(tmp_path_factory)
    out = tmp_path / "run"
    base = [sys.executable, str(EXAMPLE), "--data", data["dir"], "--out", str(out), "--batch-size", str(BATCH),
            "--ckpt-every", str(EVERY), "--num-workers", "1"]

    # A: 4 ranks, killed mid-epoch 1 (17 steps per epoch on this dataset and layout)
    job = Job(base + ["--step-delay", "0.1"], 4, timeout=150).start()
    try:
        while min(logged_step(out, r) for r in range(4)) < 26:
            if not job.running():
                pytest.fail(f"the job ended before it was killed:\n{format_outputs(job.collect())}")
            job.check_deadline()
            time.sleep(0.02)
        job.kill(signal.SIGKILL)
    finally:
        job.close()
    resume_at = latest_step(out)
    assert resume_at is not None and 17 < resume_at < 34, f"latest checkpoint step {resume_at} is not mid-epoch 1"

    # B: another number of processes is refused on every rank, with the topology error
    refused = launch(base, 2, timeout=120, expect_ok=False)
    for r in refused:
        assert r.returncode == 2, format_outputs(refused)
        assert f"rank {r.rank}: cannot resume from" in r.stderr and "TopologyMismatchError" in r.stderr, r.stderr
        assert "world_size: saved 4, now 2" in r.stderr, r.stderr
    assert latest_step(out) == resume_at  # the refused job changed nothing

    # C: the same 4 ranks resume and finish epochs 0-1
    launch(base, 4, timeout=150)

    # D: torchrun, 2 ranks, elastic from the epoch-boundary checkpoint, one more epoch
    job = Job([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
               "127.0.0.1", "--master_port", "{port}", *base[1:], "--epochs", "3", "--allow-elastic"],
              1, timeout=150)
    with job:
        results = job.wait()
    if results[0].returncode != 0:
        raise JobFailed(f"torchrun job failed:\n{format_outputs(results)}")

    # -- audit --------------------------------------------------------------------------
    bucket_keys = bucket_keys_of(data["index"])
    worlds = {0: 4, 1: 4, 2: 2}
    streams: dict[int, dict[int, list[dict[str, Any]]]] = {e: {} for e in worlds}
    totals = {}
    for rank in range(4):
        runs = read_log(out, rank)
        assert [run[0]["world_size"] for run in runs] == ([4, 4, 2] if rank < 2 else [4, 4])
        assert runs[1][0]["resumed_from"] == f"step-{resume_at:06d}" and runs[1][0]["step"] == resume_at
        assert len({run[0]["seed"] for run in runs}) == 1  # the drawn seed is reused on resume
        effective: list[dict[str, Any]] = []
        for run, following in zip(runs, runs[1:] + [None]):
            batches = run[1:]
            if following is not None:
                cut = following[0]["step"]
                kept = [b for b in batches if b["step"] <= cut]
                replayed = [b for b in batches if b["step"] > cut]
                again = following[1:1 + len(replayed)]
                strip = lambda bs: [{k: v for k, v in b.items() if k != "loss"} for b in bs]  # noqa: E731
                assert strip(replayed) == strip(again), f"rank {rank}: the replay after step {cut} differs"
                batches = kept
            effective.extend(batches)
        assert [b["step"] for b in effective] == list(range(1, len(effective) + 1)), f"rank {rank}: steps skip"
        totals[rank] = len(effective)
        for b in effective:
            streams[b["epoch"]].setdefault(rank, []).append(
                {"step": b["plan_step"], "bucket": b["bucket"], "keys": b["keys"], "pad": b["pad"]})
    first = read_log(out, 0)[0]
    assert any(b["step"] > resume_at for b in first[1:]), "nothing was logged after the checkpoint: no replay tested"
    assert totals[0] == totals[1] and totals[2] == totals[3] == 34, totals
    assert totals[0] == 34 + len(streams[2][0]), totals
    index, seed = load_index(data["index"]), read_log(out, 0)[0][0]["seed"]
    for epoch, world in worlds.items():
        assert sorted(streams[epoch]) == list(range(world)), f"epoch {epoch} ran on ranks {sorted(streams[epoch])}"
        topologies = {r: Topology(world_size=world, rank=r).to_dict() for r in range(world)}
        check_epoch(streams[epoch], topologies, bucket_keys, batch_size=BATCH, epoch=epoch)
        for rank in range(world):  # and exactly the pure planner's batches for the job's seed
            plan = plan_epoch(index, Topology(world_size=world, rank=rank), seed=seed, epoch=epoch,
                              batch_size=BATCH, oversubscribe=True, warn=False)
            assert [b["keys"] for b in streams[epoch][rank]] == plan_keys(plan, index), (epoch, rank)


def test_a_second_run_on_the_same_folder_is_refused_until_the_first_is_killed(tmp_path: Path,
                                                                               tmp_path_factory: Any) -> None:
    data = session_dataset(tmp_path_factory)
    out = tmp_path / "run"
    base = [sys.executable, str(EXAMPLE), "--data", data["dir"], "--out", str(out), "--batch-size", str(BATCH),
            "--ckpt-every", str(EVERY), "--epochs", "1"]

    first = Job(base + ["--step-delay", "0.5"], 2, timeout=150).start()
    try:
        while min(logged_step(out, r) for r in range(2)) < 1:  # training: the folder is held
            if not first.running():
                pytest.fail(f"the first run ended early:\n{format_outputs(first.collect())}")
            first.check_deadline()
            time.sleep(0.02)
        logs = {r: (out / f"samples-rank{r:05d}.jsonl").read_text().count('"event": "start"') for r in range(2)}

        # a second run against the same folder: refused on every rank, naming the holder
        refused = launch(base, 2, timeout=120, expect_ok=False)
        for r in refused:
            assert r.returncode == 3, format_outputs(refused)
            assert f"rank {r.rank}: {out / 'ckpt'} is in use by another run (pid {first.procs[0].pid} on " in r.stderr
            assert "'Stopping a job'" in r.stderr and "A run that was killed holds no lock" in r.stderr
        assert first.running()
        assert {r: (out / f"samples-rank{r:05d}.jsonl").read_text().count('"event": "start"')
                for r in range(2)} == logs == {0: 1, 1: 1}  # the refused run wrote nothing
        first.kill(signal.SIGKILL)
    finally:
        first.close()
    assert (out / "ckpt" / ".lock").exists()  # the killed run left its lock file, not its lock

    # after SIGKILL nothing is stuck: a new run takes the folder and finishes the epoch
    done = launch(base, 2, timeout=150)
    assert all(r.returncode == 0 for r in done)
    assert all(read_log(out, r)[-1][0]["event"] == "start" for r in range(2))
    assert len(read_log(out, 0)) == 2 and read_log(out, 0)[-1][-1]["epoch"] == 0
