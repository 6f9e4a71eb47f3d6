"""Fixtures of the core tests: one real 4-process gloo job, run once per session, whose
ranks record what the collectives (test_collective.py), the shared seed (test_seed.py)
and the DeviceMesh topologies (test_topology.py) gave them. Starting the processes and
their rendezvous costs far more than the checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gloo_jobs import run_gloo_job

_JOB = r"""
import datetime, json, os
import numpy as np
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
import wds_pad.core.collective as seed_mod
from wds_pad import Dataset, Topology, plan_epoch, shared_seed
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
# the shared seed, over the default group and the subgroup [1, 2]
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
if rank in (1, 2):
    res["drawn_sub"] = shared_seed(group=sub)
# the topology of a DeviceMesh, and of an initialised group over the environment
dp_cp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
res["dp_cp"] = Topology.from_mesh(dp_cp, dp_dims=("dp",)).to_dict()
res["cp_dp"] = Topology.from_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "dp"))).to_dict()
res["all_dp"] = Topology.from_mesh(dp_cp, dp_dims=("dp", "cp")).to_dict()
plan = plan_epoch(Dataset("d", {"a": np.arange(13), "b": np.arange(100, 109)}), Topology.from_mesh(dp_cp),
                  seed=5, batch_size=2, oversubscribe=True)
res["plan"] = [b.samples.tolist() for b in plan]
mesh_sub = dist.new_group([2, 3])
os.environ["RANK"] = "garbage"          # an initialised group must win over the environment
os.environ["WORLD_SIZE"] = "1000"
res["detect"] = Topology.detect(cp_size=2).to_dict()
if rank in (2, 3):
    res["sub"] = Topology.detect(group=mesh_sub).to_dict()
dist.barrier()
dist.destroy_process_group()
print(json.dumps(res))
"""


@pytest.fixture(scope="session")
def gloo_job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's record, in rank order, of one 4-process gloo job on localhost."""
    return run_gloo_job(Path(tmp_path_factory.mktemp("gloo-job")), _JOB, world=4)
