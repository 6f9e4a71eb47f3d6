"""A ``locality="node"`` state resumed on another node layout: refused by field, or re-dealt
exactly once with ``allow_elastic=True``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from wds_pad import BucketedWebDataset, Loader, Topology, TopologyMismatchError
from wds_pad.cli.synth import make_image_shards
from wds_pad.index.build import build_index
from wds_pad.index.codec import load_index

pytestmark = pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning")


def _ds(index: str, world: int, rank: int, local: int) -> BucketedWebDataset:
    return BucketedWebDataset(index, batch_size=2, seed=3, locality="node", window=2, oversubscribe=True,
                              topology=Topology(world, rank, local_world_size=local), check_agreement=False)


def test_a_node_state_on_another_node_layout_is_refused_or_re_dealt_exactly_once(tmp_path: Path) -> None:
    paths = make_image_shards(tmp_path, samples=160, shards=8, seed=2)
    index = str(tmp_path / "ix.wdsidx")
    build_index(paths, "aspect:width,height", output=index)
    ix = load_index(index)
    # 4 ranks on 2 nodes of 2: take 3 batches each, save
    loaders = [Loader(_ds(index, 4, r, 2)) for r in range(4)]
    trained: Counter[str] = Counter()
    states = []
    for loader in loaders:
        it = iter(loader)
        for _ in range(3):
            trained.update(s["__key__"] for s in next(it) if not s["__pad__"])
        states.append(loader.state_dict())
        it.close()
    # the same 4 ranks on 1 node of 4: another node layout
    with pytest.raises(TopologyMismatchError, match="node_ranks"):
        Loader(_ds(index, 4, 0, 4)).load_state_dict(states[0])
    rest = [Loader(_ds(index, 4, r, 4)) for r in range(4)]
    for r, loader in enumerate(rest):
        loader.load_state_dict(states[r], allow_elastic=True)
    counts = [0] * 4
    for r, loader in enumerate(rest):
        for batch in loader:
            counts[r] += 1
            trained.update(s["__key__"] for s in batch if not s["__pad__"])
    assert len(set(counts)) == 1
    assert trained == Counter(ix.key(i) for i in range(len(ix)))
