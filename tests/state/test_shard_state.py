"""Tests of wds_pad.state.shards: the shard-level path's state (kind "shards").

Its plan block and both fingerprints are computed as they always were (a saved state
keeps verifying), a state round-trips through a Cursor, and a malformed workers block
is a StateError naming the fields.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from wds_pad import StateError, StateMismatchError, Topology
from wds_pad.core.seed import stable_digest
from wds_pad.state.cursor import Cursor, ShardProgress, WorkerPosition
from wds_pad.state.schema import fingerprint_of
from wds_pad.state.shards import ORDER, make_shard_state, restore_shards, shard_plan_fields, shard_progress

SHARDS = [["/data/a.tar", 1000, "mtime=1.5", 3], ["/data/b.tar", 2048, "etag=x", 5]]
TOPO = Topology(world_size=4, rank=3)


def _fields() -> tuple[dict[str, Any], str]:
    fields = shard_plan_fields(7, SHARDS, 8, TOPO.dp_size)
    return fields, fingerprint_of(fields)


def test_the_plan_block_and_the_fingerprint_are_the_ones_saved_states_hold() -> None:
    fields, fp = _fields()
    shards = hashlib.blake2b(json.dumps(SHARDS).encode(), digest_size=16).hexdigest()
    want = {"order": ORDER, "seed_hash": stable_digest(7, size=8).hex(), "shards": shards, "num_shards": 2,
            "samples": 8}
    assert fields == {**want, "dp_size": 4} and list(fields) == [*want, "dp_size"]
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    assert fp == hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    assert ORDER == "split_by_node/1"


def test_a_state_round_trips_through_a_pinned_cursor() -> None:
    fields, fp = _fields()
    progress = ShardProgress((WorkerPosition(1, 512, 4), WorkerPosition(0, 0, 2)), 1, False)
    state = make_shard_state(Cursor(2, shards=progress), TOPO, fp, fields)
    assert (state["kind"], state["epoch"], state["index"], state["num_workers"], state["next_worker"]) == \
        ("shards", 2, 6, 2, 1)
    assert state["workers"][0] == {"shard": 1, "offset": 512, "yielded": 4}
    assert state["per_rank"]["rank3"]["workers"] == state["workers"]
    back = restore_shards(state, topology=TOPO, fingerprint=fp, fields=fields)
    assert back == Cursor(2, shards=progress, pinned=True)
    other = shard_plan_fields(8, SHARDS, 8, TOPO.dp_size)
    with pytest.raises(StateMismatchError, match="seed_hash"):
        restore_shards(state, topology=TOPO, fingerprint=fingerprint_of(other), fields=other)


@pytest.mark.parametrize("damage", [
    {"num_workers": 3}, {"next_worker": 2}, {"next_worker": "0"}, {"workers": {}},
    {"workers": [{"shard": 0, "offset": 0}, {"shard": 0, "offset": 0, "yielded": 0}]},
    {"workers": [{"shard": 0, "offset": -1, "yielded": 0}, {"shard": 0, "offset": 0, "yielded": 0}]},
])
def test_a_malformed_workers_block_is_a_state_error(damage: dict[str, Any]) -> None:
    state = {"workers": [{"shard": 0, "offset": 0, "yielded": 0}] * 2, "num_workers": 2, "next_worker": 0}
    assert shard_progress(state) == ShardProgress((WorkerPosition(),) * 2, 0, False)
    with pytest.raises(StateError, match="'workers'|'offset'"):
        shard_progress({**state, **damage})
