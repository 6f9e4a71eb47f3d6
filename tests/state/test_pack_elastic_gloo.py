"""A real gloo job of packed batches under gradient accumulation, killed on 4 ranks and
resumed on 3 to the epoch's end; audited sample by sample.

The index records each sample's payload bytes as its cost (``--cost bytes``); batches are
``Pack(L, packs=2)`` with 2 micro-batches per optimizer step. The 4-rank job is killed
(SIGKILL) after every rank saved its state mid-epoch; the 3-rank job resumes it with
``allow_elastic=True``. In both jobs every rank gets the same number of batches (whole
optimizer steps in the finished one), all take the same bucket at each step, every
batch is two packs each within L (a sample costlier than L alone); over the two jobs
every sample of the epoch is trained exactly once, each with the seed derived from
(seed, epoch, dataset, sample) whatever the job that trained it, and every padded copy
with a seed of its own. The jobs are the session's (``resized``, conftest.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from dist_helpers import bucket_keys_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_packed_under_accumulation_killed_on_4_resumed_on_3_trains_every_sample_once(resized: dict[str, Any]) -> None:
    import numpy as np

    from wds_pad.core.sampleseed import sample_seeds

    run = resized["pack"]  # the session's run (conftest.py)
    index, cost, seq_len = run.info["index"], run.info["cost"], run.info["seq_len"]
    assert run.common["pack"] == {"seq_len": seq_len, "packs": 2, "oversize": "alone"}
    assert run.common["seed"] == 7 and run.common["accumulation_steps"] == 2
    jobs = run.jobs
    assert jobs == [(4, {"save_at": 4}), (3, {"old_world": 4})]
    trained: Counter[str] = Counter()
    for j, (world, extra) in enumerate(jobs):
        logs = run.logs(j)
        if "save_at" in extra:
            logs = [log[:extra["save_at"]] for log in logs]  # trained before the state was saved
            assert all(len(log) == extra["save_at"] for log in logs)
        else:
            assert all(len(log) % 2 == 0 and log for log in logs), f"job {j}: not whole optimizer steps"
        assert len({len(log) for log in logs}) == 1, f"job {j}: unequal batch counts"
        for i in range(len(logs[0])):
            assert len({(log[i]["step"], log[i]["bucket"]) for log in logs}) == 1, f"job {j} batch {i}: not lockstep"
        for log in logs:
            for b in log:
                assert sorted(set(b["pack"])) == [0, 1], f"job {j}: a batch is not two packs"
                for p in (0, 1):
                    keys = [k for k, q in zip(b["keys"], b["pack"]) if q == p]
                    assert len(keys) == 1 or sum(cost[k] for k in keys) <= seq_len, f"job {j}: a pack over L"
        trained.update(k for log in logs for b in log for k, pad in zip(b["keys"], b["pad"]) if not pad)
        for b in (b for log in logs for b in log):
            real = [i for i, pad in enumerate(b["pad"]) if not pad]
            want = sample_seeds(7, 0, b["dataset"], np.asarray([b["ids"][i] for i in real]), 0).tolist()
            assert [b["seeds"][i] for i in real] == want, f"job {j}: a sample's seed depends on the job"
            for i, pad in enumerate(b["pad"]):
                if pad:
                    assert b["seeds"][i] != sample_seeds(7, 0, b["dataset"], np.asarray([b["ids"][i]]), 0)[0], (
                        f"job {j}: a padded copy shares its sample's seed")
    every = [k for keys in bucket_keys_of(index).values() for k in keys]
    twice = {k: n for k, n in trained.items() if n > 1}
    never = set(every) - set(trained)
    assert not twice and not never, f"trained twice: {sorted(twice)[:10]}, never: {sorted(never)[:10]}"
