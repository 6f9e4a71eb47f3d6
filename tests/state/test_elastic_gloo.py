"""A real gloo job resized mid-epoch twice: 4 processes killed mid-epoch, resumed on 3,
killed again, resumed on 2 to the epoch's end; audited sample by sample.

Each job logs every batch each rank received; a job is killed (SIGKILL, every process
group) after all its ranks saved their state files, while they train on. What counts as
trained is each rank's log up to its saved position; over the three jobs every sample of
the epoch is trained exactly once, every job's ranks get equal batch counts and take the
same bucket at the same step.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from dist_helpers import Job, bucket_keys_of, format_outputs, launch, session_dataset

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
HELPERS = Path(__file__).resolve().parents[1] / "dist_helpers.py"
# the ranks import this checkout's wds_pad (not another one an editable install points at)
ENV = {"PYTHONPATH": str(HELPERS.parents[1])}


def _run(world: int, out: Path, params: dict[str, Any], kill: bool) -> None:
    out.mkdir(parents=True)
    params = {**params, "log": str(out)}
    argv = [sys.executable, str(HELPERS), str(out), json.dumps([{"scenario": "elastic_phase", **params}])]
    if not kill:
        launch(argv, world, timeout=150, env=ENV)
        return
    with Job(argv, world, timeout=150, env=ENV) as job:
        deadline = time.monotonic() + 150
        while not all((out / f"saved{r}").exists() for r in range(world)):
            assert job.running() and time.monotonic() < deadline, format_outputs(job.collect())
            time.sleep(0.1)
        job.kill(signal.SIGKILL)


def _log(out: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("locality", ["none", "shard"])
def test_killed_on_4_resumed_on_3_then_on_2_trains_every_sample_once(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, locality: str) -> None:
    data = session_dataset(tmp_path_factory)
    common = {"index": data["index"], "batch_size": 2, "seed": 7, "locality": locality}
    jobs = [(4, {"save_at": 7}), (3, {"save_at": 5, "old_world": 4}), (2, {"old_world": 3})]
    trained: Counter[str] = Counter()
    for j, (world, extra) in enumerate(jobs):
        params = {**common, **extra, "state_dir": str(tmp_path / f"state{j}")}
        if j:
            params["resume_from"] = str(tmp_path / f"state{j - 1}")
        _run(world, tmp_path / f"job{j}", params, kill="save_at" in extra)
        logs = [_log(tmp_path / f"job{j}", r) for r in range(world)]
        if "save_at" in extra:
            logs = [log[:extra["save_at"]] for log in logs]  # trained before the state was saved
            assert all(len(log) == extra["save_at"] for log in logs)
        assert len({len(log) for log in logs}) == 1, f"job {j}: unequal batch counts"
        for i in range(len(logs[0])):
            assert len({(log[i]["step"], log[i]["bucket"]) for log in logs}) == 1, f"job {j} batch {i}: not lockstep"
        trained.update(k for log in logs for b in log for k, pad in zip(b["keys"], b["pad"]) if not pad)
    every = [k for keys in bucket_keys_of(data["index"]).values() for k in keys]
    twice = {k: n for k, n in trained.items() if n > 1}
    never = set(every) - set(trained)
    assert not twice and not never, f"trained twice: {sorted(twice)[:10]}, never: {sorted(never)[:10]}"
    assert sorted(trained) == sorted(every)


def test_under_a_budget_killed_on_4_resumed_on_3_then_on_2_trains_every_sample_once(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """The same resized job with batches sized by a budget of payload bytes (an index built
    with --cost bytes) and 2 micro-batches per optimizer step: every batch within the
    budget, equal batch counts (a whole number of optimizer steps) and lockstep buckets in
    every job, and every sample of the epoch trained exactly once over the three jobs."""
    from wds_pad import build_index, load_index

    data = session_dataset(tmp_path_factory)
    index = str(tmp_path / "costed.wdsidx")
    build_index(list(load_index(data["index"]).urls), "aspect:width,height", output=index, cost="bytes")
    ix = load_index(index)
    cost = {ix.key(i): float(ix.cost[i]) for i in range(len(ix))}
    budget = 4 * float(sorted(cost.values())[len(cost) // 2])
    common = {"index": index, "batch_size": 0, "budget": budget, "seed": 7, "accumulation_steps": 2}
    jobs = [(4, {"save_at": 6}), (3, {"save_at": 4, "old_world": 4}), (2, {"old_world": 3})]
    trained: Counter[str] = Counter()
    for j, (world, extra) in enumerate(jobs):
        params = {**common, **extra, "state_dir": str(tmp_path / f"state{j}")}
        if j:
            params["resume_from"] = str(tmp_path / f"state{j - 1}")
        _run(world, tmp_path / f"job{j}", params, kill="save_at" in extra)
        logs = [_log(tmp_path / f"job{j}", r) for r in range(world)]
        if "save_at" in extra:
            logs = [log[:extra["save_at"]] for log in logs]
        else:
            assert all(len(log) % 2 == 0 for log in logs), f"job {j}: not whole optimizer steps"
        assert len({len(log) for log in logs}) == 1, f"job {j}: unequal batch counts"
        for i in range(len(logs[0])):
            assert len({(log[i]["step"], log[i]["bucket"]) for log in logs}) == 1, f"job {j} batch {i}: not lockstep"
        for log in logs:
            for b in log:
                assert len(b["keys"]) == 1 or sum(cost[k] for k in b["keys"]) <= budget, f"job {j}: over the budget"
        trained.update(k for log in logs for b in log for k, pad in zip(b["keys"], b["pad"]) if not pad)
    every = [k for keys in bucket_keys_of(index).values() for k in keys]
    twice = {k: n for k, n in trained.items() if n > 1}
    never = set(every) - set(trained)
    assert not twice and not never, f"trained twice: {sorted(twice)[:10]}, never: {sorted(never)[:10]}"
