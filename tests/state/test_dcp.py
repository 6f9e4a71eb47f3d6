"""torch.distributed.checkpoint with the loader as pasted from docs/resume.md.

DCP keeps one copy of a non-tensor key that every rank saves, so a loader state without
the rank in its keys comes back as one rank's state on every rank. The state holds its
own entry under ``per_rank.rank<r>``: each rank loads its own. Checked with the real DCP
in a two-process gloo job (every sample audited against each rank's plan), and in one
process for the shapes DCP hands back (a deduplicated top level, a load template left in
place after a topology change).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from wds_pad.core.topology import Topology
from wds_pad.errors import TopologyMismatchError
from wds_pad.index.record import Index
from wds_pad.state import load_state_file, save_state_file
from wds_pad.stream.loader import Loader

from data_helpers import batch_keys, image_index, make_dataset, plan_keys
from gloo_jobs import run_gloo_job

pytestmark = pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning")


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Index:
    return image_index(tmp_path_factory.mktemp("dcp-shards"), samples=96, shards=4, seed=3)


def loader_of(index: Index, world: int, rank: int) -> Loader:
    return Loader(make_dataset(index, quiet=True, seed=11, check_agreement=False,
                               topology=Topology(world, rank)))


def test_state_holds_its_own_entry_under_its_rank(index: Index) -> None:
    loader = loader_of(index, 2, 1)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    own = {k: v for k, v in state.items() if k != "per_rank"}
    assert state["per_rank"] == {"rank1": own}
    it.close()


def _at(index: Index, world: int, rank: int, n: int, **kw: Any) -> Loader:
    loader = Loader(make_dataset(index, quiet=True, seed=11, check_agreement=False,
                                 topology=Topology(world, rank), **kw))
    it = iter(loader)
    for _ in range(n):
        next(it)
    it.close()
    return loader


def _dcp_mix(top: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """What a DCP load gives back: the top level from another rank, per_rank from this one."""
    return {**top, "topology": {**own["topology"], "rank": top["topology"]["rank"]},
            "per_rank": own["per_rank"]}


@pytest.mark.parametrize("pad,n0,n1", [("cyclic", 3, 3), ("none", 2, 3)])
def test_deduplicated_top_level_resumes_each_rank_from_its_own_entry(index: Index, pad: str, n0: int,
                                                                     n1: int) -> None:
    """In lockstep every rank is at the same batch; with pad="none" positions may differ."""
    states = [_at(index, 2, r, n, pad=pad).state_dict() for r, n in ((0, n0), (1, n1))]
    fresh = Loader(make_dataset(index, quiet=True, seed=11, check_agreement=False,
                                topology=Topology(2, 1), pad=pad))
    fresh.load_state_dict(_dcp_mix(states[0], states[1]))
    assert fresh.state_dict() == states[1]
    expected = plan_keys(fresh.dataset.plan(0), index)
    assert batch_keys(fresh) == expected[n1:]


def test_an_edited_top_level_is_not_hidden_by_the_entry(index: Index) -> None:
    """In lockstep the ranks' positions agree: a top level at another batch is verified as it is."""
    states = [_at(index, 2, r, n).state_dict() for r, n in ((0, 2), (1, 3))]
    with pytest.raises(TopologyMismatchError, match=r"differs from this rank's entry per_rank\.rank1 in index"):
        loader_of(index, 2, 1).load_state_dict(_dcp_mix(states[0], states[1]))


def test_states_without_per_rank_still_load(index: Index, tmp_path: Path) -> None:
    loader = loader_of(index, 2, 0)
    it = iter(loader)
    next(it)
    it.close()
    state = loader.state_dict()
    bare = {k: v for k, v in state.items() if k != "per_rank"}  # as saved before per_rank existed
    for given in (bare, load_state_file(save_state_file(bare, str(tmp_path), 0), 0),
                  load_state_file(save_state_file(state, str(tmp_path / "b"), 0), 0)):
        fresh = loader_of(index, 2, 0)
        fresh.load_state_dict(given)
        assert fresh.state_dict() == state


def test_another_ranks_state_is_refused_naming_the_fix(index: Index) -> None:
    """One copy for the whole job (Lightning, accelerate): the refusal says gather_state."""
    state = loader_of(index, 2, 0).state_dict()
    with pytest.raises(TopologyMismatchError, match=r"gather_state=True.*save_state_file") as err:
        loader_of(index, 2, 1).load_state_dict(state)
    assert "'rank1'" in str(err.value) and "rank0" in str(err.value)


def test_edited_top_level_of_this_rank_is_still_verified(index: Index) -> None:
    state = loader_of(index, 2, 1).state_dict()
    with pytest.raises(Exception, match="position 1000000 is past the end"):
        loader_of(index, 2, 1).load_state_dict({**state, "index": 10**6})


def test_topology_change_through_dcp_names_the_dcp_key_and_the_fix(index: Index, tmp_path: Path) -> None:
    """Saved on one rank, loaded as rank 1 of 2: DCP has no key for rank 1."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    saved = loader_of(index, 1, 0)
    it = iter(saved)
    for _ in range(2):
        next(it)
    it.close()
    ckpt = str(tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: single process"
        dcp.save({"loader": saved}, checkpoint_id=ckpt)
        # DCP's own refusal (a CheckpointException, which is a BaseException)
        with pytest.raises(BaseException, match=r"Missing key in checkpoint state_dict: loader\.per_rank\.rank1\."):
            dcp.load({"loader": loader_of(index, 2, 1)}, checkpoint_id=ckpt)
        target = loader_of(index, 2, 1)
        sd: dict[str, Any] = {"loader": target.state_dict()}
        dcp.load(sd, checkpoint_id=ckpt, planner=DefaultLoadPlanner(allow_partial_load=True))
    # the load template's own entry stayed in place: it must not be taken for the saved one
    with pytest.raises(TopologyMismatchError, match=r"per_rank\.rank1.*allow_partial_load.*allow_elastic"):
        target.load_state_dict(sd["loader"])
    assert target.state_dict()["index"] == 0


def test_gather_state_without_a_process_group_is_the_own_entry(index: Index) -> None:
    loader = Loader(loader_of(index, 1, 0).dataset, gather_state=True)
    assert set(loader.state_dict()["per_rank"]) == {"rank0"}


_DCP_JOB = r"""
import json, sys, warnings
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from wds_pad import BucketedWebDataset, Loader

index, ckpt, phase, stop = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
dist.init_process_group("gloo")
rank = dist.get_rank()
warnings.simplefilter("ignore")
torch.manual_seed(0)  # a replicated model, as under DDP: DCP keeps one copy
model = torch.nn.Linear(2, 2)
loader = Loader(BucketedWebDataset(index, batch_size=4, seed=11), num_workers=1)
keys = []
if phase == "save":
    for batch in loader:
        keys.append([s["__key__"] for s in batch])
        with torch.no_grad():
            model.weight.add_(1.0)
        if len(keys) == stop:
            break
    dcp.save({"model": model, "loader": loader}, checkpoint_id=ckpt)   # as in docs/resume.md
else:
    with torch.no_grad():
        model.weight.zero_()
    dcp.load({"model": model, "loader": loader}, checkpoint_id=ckpt)
    for batch in loader:
        keys.append([s["__key__"] for s in batch])
out = [None] * dist.get_world_size()
dist.all_gather_object(out, {"rank": rank, "keys": keys, "weight": float(model.weight.sum())})
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_dcp_save_mid_epoch_and_load_resume_every_rank_exactly(index: Index, tmp_path: Path) -> None:
    """The docs' snippet as pasted, two gloo ranks, real DCP: no loss, no duplicate."""
    stop = 3
    ckpt = str(tmp_path / "ckpt")
    first = run_gloo_job(tmp_path, _DCP_JOB, 2, args=(str(index.path), ckpt, "save", str(stop)))[0]
    second = run_gloo_job(tmp_path, _DCP_JOB, 2, args=(str(index.path), ckpt, "load", "0"))[0]
    seen: list[str] = []
    for rank in (0, 1):
        expected = plan_keys(loader_of(index, 2, rank).dataset.plan(0), index)
        assert stop < len(expected), "the save was not mid-epoch"
        assert first[rank]["keys"] == expected[:stop]
        assert second[rank]["keys"] == expected[stop:], f"rank {rank} did not continue exactly"
        assert second[rank]["weight"] == first[rank]["weight"]  # the model came back too
        seen += [k for b in first[rank]["keys"] + second[rank]["keys"] for k in b]
    assert plan_keys(loader_of(index, 2, 0).dataset.plan(0), index) != plan_keys(
        loader_of(index, 2, 1).dataset.plan(0), index)
    # over both ranks: each planned sample exactly as often as the two plans hold it
    planned = [k for r in (0, 1) for b in plan_keys(loader_of(index, 2, r).dataset.plan(0), index) for k in b]
    assert sorted(seen) == sorted(planned)
