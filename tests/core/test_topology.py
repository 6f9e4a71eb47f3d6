"""Tests of Topology: the record, its validation, detection order, and DeviceMesh reading
(with fake meshes here, and a real 2x2 DeviceMesh in a 4-process gloo job)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wds_pad import ConfigError, Topology, TopologyError

ROOT = Path(__file__).resolve().parents[2]


# -- the record ----------------------------------------------------------------------------

def test_defaults_are_a_single_process() -> None:
    assert Topology().to_dict() == dict(world_size=1, rank=0, cp_size=1, dp_size=1, dp_rank=0, cp_rank=0)


def test_cp_peers_are_consecutive_ranks() -> None:
    t = Topology(world_size=8, rank=5, cp_size=2)
    assert (t.dp_size, t.dp_rank, t.cp_rank) == (4, 2, 1)
    assert t.peers() == [4, 5]


def test_explicit_dp_size_derives_cp_size() -> None:
    t = Topology(world_size=8, rank=5, dp_size=2)
    assert (t.cp_size, t.dp_rank, t.cp_rank) == (4, 1, 1)
    assert Topology(world_size=8, rank=5, dp_size=2, cp_size=4) == t


def test_explicit_ranks_for_other_layouts() -> None:
    # a ("cp", "dp") mesh: rank 1 is dp_rank 1, cp_rank 0 (peers are not consecutive)
    t = Topology(world_size=4, rank=1, cp_size=2, dp_rank=1, cp_rank=0)
    assert (t.dp_size, t.dp_rank, t.cp_rank) == (2, 1, 0)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4).flatmap(lambda cp: st.tuples(st.just(cp), st.integers(1, 64 // cp))))
def test_every_rank_decomposes_into_dp_and_cp(sizes: tuple[int, int]) -> None:
    cp, dp = sizes
    world = cp * dp
    topos = [Topology(world_size=world, rank=r, cp_size=cp) for r in range(world)]
    assert {(t.dp_rank, t.cp_rank) for t in topos} == {(d, c) for d in range(dp) for c in range(cp)}
    for t in topos:
        assert t.dp_size == dp and t.rank == t.dp_rank * cp + t.cp_rank
        assert Topology.from_dict(t.to_dict()) == t
        assert t.rank in t.peers() and all(Topology(world, p, cp_size=cp).dp_rank == t.dp_rank for p in t.peers())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(world_size=0), "world_size must be >= 1, got 0"),
        (dict(world_size=4, rank=4), "rank 4 is out of range for world_size 4"),
        (dict(world_size=4, rank=-1), "rank must be >= 0, got -1"),
        (dict(world_size=6, rank=0, cp_size=4), "world_size 6 is not divisible by cp_size 4"),
        (dict(world_size=8, rank=0, dp_size=3), "world_size 8 is not divisible by dp_size 3"),
        (dict(world_size=8, rank=0, cp_size=2, dp_size=2), r"dp_size 2 x cp_size 2 = 4 does not equal world_size 8"),
        (dict(world_size=4, rank=0, cp_size=2, dp_rank=2), "dp_rank 2 is out of range for dp_size 2"),
        (dict(world_size=4, rank=0, cp_size=2, cp_rank=2), "cp_rank 2 is out of range for cp_size 2"),
        (dict(world_size=True), "world_size must be an int, got True"),
        (dict(world_size=2.0), "world_size must be an int"),
        (dict(world_size=2, rank="1"), "rank must be an int, got '1'"),
        (dict(world_size=2, cp_size=0), "cp_size must be >= 1"),
    ],
)
def test_impossible_topologies_raise(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(TopologyError, match=match) as info:
        Topology(**kwargs)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


def test_record_is_frozen_and_round_trips() -> None:
    t = Topology(world_size=6, rank=3, cp_size=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.rank = 0  # type: ignore[misc]
    assert Topology.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    with pytest.raises(TopologyError, match="lacks field"):
        Topology.from_dict({"world_size": 6, "rank": 3})


# -- detect --------------------------------------------------------------------------------

@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return monkeypatch


def test_detect_single_process_without_env(clean_env: pytest.MonkeyPatch) -> None:
    assert Topology.detect() == Topology(1, 0)


def test_detect_reads_torchrun_env(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "8")
    assert Topology.detect() == Topology(8, 3)
    assert Topology.detect(cp_size=2).to_dict() == dict(world_size=8, rank=3, cp_size=2, dp_size=4,
                                                        dp_rank=1, cp_rank=1)
    assert Topology.detect(dp_size=2).cp_size == 4


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "1"}, "set both"),
        ({"WORLD_SIZE": "4"}, "set both"),
        ({"RANK": "one", "WORLD_SIZE": "4"}, "RANK='one' / WORLD_SIZE='4' are not integers"),
        ({"RANK": "0", "WORLD_SIZE": ""}, "not integers"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "rank 4 is out of range for world_size 4"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "world_size must be >= 1"),
        ({"RANK": "1", "WORLD_SIZE": "6"}, None),  # fine by itself, but not with cp_size 4
    ],
)
def test_detect_malformed_env_raises_never_falls_back(
    clean_env: pytest.MonkeyPatch, env: dict[str, str], match: str | None
) -> None:
    for k, v in env.items():
        clean_env.setenv(k, v)
    with pytest.raises(TopologyError, match=match or "not divisible by cp_size 4"):
        Topology.detect(cp_size=4 if match is None else 1)


# -- DeviceMesh ------------------------------------------------------------------------------

def fake_mesh(names: tuple[str, ...], shape: tuple[int, ...], coord: list[int] | None) -> Any:
    return SimpleNamespace(mesh_dim_names=names, mesh=np.arange(int(np.prod(shape))).reshape(shape),
                           get_coordinate=lambda: coord)


def test_from_mesh_reads_dp_and_replica_dims() -> None:
    mesh = fake_mesh(("pp", "dp", "cp"), (2, 3, 2), [1, 2, 0])
    t = Topology.from_mesh(mesh, dp_dims=("dp",))
    assert (t.world_size, t.dp_size, t.cp_size, t.dp_rank, t.cp_rank) == (12, 3, 4, 2, 2)
    # hybrid sharding: replicate x shard are both data-parallel
    h = Topology.from_mesh(fake_mesh(("replicate", "shard", "tp"), (2, 3, 2), [1, 2, 1]),
                           dp_dims=("replicate", "shard"))
    assert (h.dp_size, h.cp_size, h.dp_rank, h.cp_rank) == (6, 2, 5, 1)


def test_from_mesh_errors() -> None:
    with pytest.raises(TopologyError, match=r"DeviceMesh has dimensions \('dp', 'cp'\), not \['data'\]"):
        Topology.from_mesh(fake_mesh(("dp", "cp"), (2, 2), [0, 0]), dp_dims=("data",))
    with pytest.raises(TopologyError, match="not part of the DeviceMesh"):
        Topology.from_mesh(fake_mesh(("dp", "cp"), (2, 2), None))


# -- a real job: 4 gloo processes on localhost (the session's job, conftest.py) ---------------

@pytest.mark.slow
def test_real_device_mesh_in_four_gloo_processes(gloo_job: list[dict[str, Any]]) -> None:
    results = gloo_job
    for r, res in enumerate(results):
        assert res["dp_cp"] == dict(world_size=4, rank=r, cp_size=2, dp_size=2, dp_rank=r // 2, cp_rank=r % 2)
        # mesh ("cp", "dp"): rank r sits at coordinate (r // 2, r % 2)
        assert res["cp_dp"] == dict(world_size=4, rank=r, cp_size=2, dp_size=2, dp_rank=r % 2, cp_rank=r // 2)
        assert res["all_dp"] == dict(world_size=4, rank=r, cp_size=1, dp_size=4, dp_rank=r, cp_rank=0)
        assert res["detect"] == Topology(4, r, cp_size=2).to_dict()
    assert results[2]["sub"] == Topology(2, 0).to_dict()
    assert results[3]["sub"] == Topology(2, 1).to_dict()
    # planning on the mesh topology: CP peers identical, DP replicas disjoint per step
    assert results[0]["plan"] == results[1]["plan"] and results[2]["plan"] == results[3]["plan"]
    assert len(results[0]["plan"]) == len(results[2]["plan"]) > 0
    for a, b in zip(results[0]["plan"], results[2]["plan"]):
        assert len(a) == len(b) == 2


# -- the node layout ------------------------------------------------------------------------


def test_a_rank_s_node_is_rank_over_local_world_size_as_torchrun_assigns() -> None:
    topo = Topology(world_size=8, rank=5, cp_size=2, local_world_size=4)
    assert (topo.node, topo.nodes) == (1, 2)
    assert topo.node_dp_ranks() == [2, 3] and topo.node_dp_ranks(0) == [0, 1]
    assert Topology(8, 5).nodes == 1 and Topology(8, 5).node == 0


def test_the_node_layout_is_not_part_of_a_saved_topology() -> None:
    topo = Topology(world_size=4, rank=1, local_world_size=2)
    assert topo.to_dict() == Topology(world_size=4, rank=1).to_dict()
    assert "local_world_size" not in topo.to_dict()


def test_a_node_layout_that_does_not_divide_the_job_is_refused_naming_both() -> None:
    with pytest.raises(TopologyError, match="world_size 6 is not divisible by local_world_size 4"):
        Topology(world_size=6, rank=0, local_world_size=4)
    with pytest.raises(TopologyError, match="local_world_size must be >= 1"):
        Topology(world_size=2, rank=0, local_world_size=0)


def test_node_dp_ranks_need_the_node_layout_and_the_default_dp_layout() -> None:
    with pytest.raises(TopologyError, match="no node layout"):
        Topology(4, 0).node_dp_ranks()
    with pytest.raises(TopologyError, match="not the default layout"):
        Topology(4, 0, cp_size=2, dp_rank=1, cp_rank=0, local_world_size=2).node_dp_ranks()


def test_detect_reads_local_world_size_from_torchrun_s_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    topo = Topology.detect()
    assert (topo.local_world_size, topo.node) == (4, 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    with pytest.raises(TopologyError, match="LOCAL_WORLD_SIZE='four'"):
        Topology.detect()


@pytest.mark.parametrize("group", ["world", 0, [0, 1], object()])
def test_a_group_that_is_not_a_process_group_is_refused_naming_what_to_pass(group) -> None:
    """It was an AttributeError (``'str' object has no attribute 'size'``) from torch."""
    import torch.distributed  # noqa: F401 - a group can only be given with torch imported

    with pytest.raises(ConfigError, match=r"group= must be a torch.distributed process group, got .*new_group"):
        Topology.detect(group=group)
