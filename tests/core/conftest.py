"""Fixtures of the core tests: one real 3-process gloo job, run once per session, whose
ranks record what the shared seed (test_seed.py) and the collectives (test_collective.py)
gave them. Starting the processes and their rendezvous costs far more than the checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gloo_jobs import run_gloo_job

_JOB = r"""
import datetime, json
import torch.distributed as dist
import wds_pad.core.collective as seed_mod
from wds_pad import shared_seed
from wds_pad.core.collective import all_gather, broadcast, group_size

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
sub = dist.new_group([1, 2])
# the collectives, over the default group and the subgroup [1, 2]
res = {"group_size": group_size(), "gathered": all_gather({"rank": rank}), "broadcast": broadcast(f"from {rank}")}
if rank in (1, 2):
    res["sub_size"] = group_size(sub)
    res["sub_gathered"] = all_gather(rank * 10, sub)
    res["sub_broadcast"] = broadcast(rank, sub)
# the shared seed
res.update({"drawn": [shared_seed(), shared_seed()], "configured": shared_seed(42)})
real_randbits = seed_mod.secrets.randbits
def tagged(bits):  # every rank would draw its own value: the result shows who drew
    assert bits == 63
    return 1000 + rank
seed_mod.secrets.randbits = tagged
res["tagged_default"] = shared_seed()
if rank in (1, 2):
    res["tagged_sub"] = shared_seed(group=sub)
    seed_mod.secrets.randbits = real_randbits
    res["drawn_sub"] = shared_seed(group=sub)
dist.barrier()
dist.destroy_process_group()
print(json.dumps(res))
"""


@pytest.fixture(scope="session")
def gloo_job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's record, in rank order, of one 3-process gloo job on localhost."""
    return run_gloo_job(Path(tmp_path_factory.mktemp("gloo-job")), _JOB, world=3)
