"""A real gloo job resized mid-epoch twice: 4 processes killed mid-epoch, resumed on 3,
killed again, resumed on 2 to the epoch's end; audited sample by sample.

Each job logs every batch each rank received; a job is killed (SIGKILL, every process
group) after all its ranks saved their state files, while they train on. What counts as
trained is each rank's log up to its saved position; over the three jobs every sample of
the epoch is trained exactly once, every job's ranks get equal batch counts and take the
same bucket at the same step. The jobs are the session's (``resized``, conftest.py): each
world size is one launch for every run of that size.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from dist_helpers import bucket_keys_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.mark.parametrize("locality", ["none", "shard"])
def test_killed_on_4_resumed_on_3_then_on_2_trains_every_sample_once(resized: dict[str, Any], locality: str) -> None:
    run = resized[locality]  # the session's run (conftest.py): batch_size 2, seed 7, that locality
    assert run.common["locality"] == locality and run.common["batch_size"] == 2
    jobs = run.jobs
    assert [w for w, _ in jobs] == [4, 3, 2]
    trained: Counter[str] = Counter()
    for j, (world, extra) in enumerate(jobs):
        logs = run.logs(j)
        if "save_at" in extra:
            logs = [log[:extra["save_at"]] for log in logs]  # trained before the state was saved
            assert all(len(log) == extra["save_at"] for log in logs)
        assert len({len(log) for log in logs}) == 1, f"job {j}: unequal batch counts"
        for i in range(len(logs[0])):
            assert len({(log[i]["step"], log[i]["bucket"]) for log in logs}) == 1, f"job {j} batch {i}: not lockstep"
        trained.update(k for log in logs for b in log for k, pad in zip(b["keys"], b["pad"]) if not pad)
    every = [k for keys in bucket_keys_of(run.info["index"]).values() for k in keys]
    twice = {k: n for k, n in trained.items() if n > 1}
    never = set(every) - set(trained)
    assert not twice and not never, f"trained twice: {sorted(twice)[:10]}, never: {sorted(never)[:10]}"
    assert sorted(trained) == sorted(every)


def test_under_a_budget_killed_on_4_resumed_on_3_then_on_2_trains_every_sample_once(resized: dict[str, Any]) -> None:
    """The same resized job with batches sized by a budget of payload bytes (an index built
    with --cost bytes) and 2 micro-batches per optimizer step: every batch within the
    budget, equal batch counts (a whole number of optimizer steps) and lockstep buckets in
    every job, and every sample of the epoch trained exactly once over the three jobs."""
    run = resized["budget"]  # the session's run (conftest.py)
    cost, budget = run.info["cost"], run.info["budget"]
    assert run.common["budget"] == budget and run.common["accumulation_steps"] == 2
    assert [w for w, _ in run.jobs] == [4, 3, 2]
    trained: Counter[str] = Counter()
    for j, (world, extra) in enumerate(run.jobs):
        logs = run.logs(j)
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
    every = [k for keys in bucket_keys_of(run.info["index"]).values() for k in keys]
    twice = {k: n for k, n in trained.items() if n > 1}
    never = set(every) - set(trained)
    assert not twice and not never, f"trained twice: {sorted(twice)[:10]}, never: {sorted(never)[:10]}"
