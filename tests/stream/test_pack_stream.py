"""Streaming packed batches: BucketedWebDataset and Loader with ``batch_size=Pack(...)``, and pack_collate.

Token shards indexed with ``--cost json:tokens`` stream the plan's batches exactly with 0
and 2 DataLoader workers, each sample carrying its ``__pack__``; ``pack_collate`` lays
each pack's tokens in one row (from ``.npy`` and from raw uint16 bytes alike) with
positions restarting per sample, cu_seqlens and the loss mask; a state saved mid-epoch
resumes at the next batch; a state of another sizing is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from wds_pad import (Budget, BucketedWebDataset, ConfigError, Loader, Pack, StateMismatchError, Topology,
                     pack_collate)
from wds_pad.cli.synth import make_token_shards, token_ids
from wds_pad.index.build import build_index
from wds_pad.index.codec import load_index
from wds_pad.index.record import Index

pytestmark = [pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning"),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]
SOLO = Topology(world_size=1, rank=0)
L = 256


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Index:
    folder = tmp_path_factory.mktemp("token-shards")
    paths = make_token_shards(folder, samples=180, shards=4, seed=3)
    build_index(paths, "json:source", output=str(folder / "tok.wdsidx"), cost="json:tokens")
    return load_index(str(folder / "tok.wdsidx"))


def _ds(index: Index, **kw: Any) -> BucketedWebDataset:
    args: dict[str, Any] = dict(batch_size=Pack(L, packs=2), topology=SOLO, seed=7)
    args.update(kw)
    return BucketedWebDataset(index, **args)


@pytest.mark.parametrize("workers", [0, 2])
def test_packed_samples_stream_the_plan_with_their_pack(index: Index, workers: int) -> None:
    ds = _ds(index)
    got = [[(s["__key__"], s["__pack__"]) for s in b] for b in Loader(ds, num_workers=workers)]
    want = [[(index.key(int(i)), int(p)) for i, p in zip(b.samples, b.pack)] for b in ds.plan(0)]
    assert got == want and len(got) > 3
    assert all(sorted({p for _, p in b}) == [0, 1] for b in got)  # every batch is two packs
    for b in ds.plan(0):
        assert all(index.cost[b.samples[b.pack == p]].sum() <= L for p in (0, 1))


@pytest.mark.parametrize("field,dtype", [("tokens.npy", "int32"), ("tokens.bin", "uint16")])
def test_pack_collate_lays_each_pack_in_a_row_with_positions_and_mask(index: Index, field: str, dtype: str) -> None:
    ds = _ds(index, collation_fn=pack_collate(field, dtype, seq_len=L))
    plan = ds.plan(0)
    batches = list(Loader(ds))
    assert len(batches) == len(plan)
    for out, b in zip(batches, plan):
        assert tuple(out["input_ids"].shape) == (2, L)
        ids, pos = out["input_ids"].numpy(), out["position_ids"].numpy()
        mask, seg = out["loss_mask"].numpy(), out["segment_ids"].numpy()
        cu = out["cu_seqlens"].numpy()
        assert cu[0] == 0 and cu[-1] == 2 * L and np.all(np.diff(cu) > 0)
        for row in range(2):
            members = b.samples[b.pack == row]
            pads = b.pad[b.pack == row]
            at = 0
            for s, (i, pad) in enumerate(zip(members.tolist(), pads.tolist())):
                tok = token_ids(int(index.key(i)), int(index.cost[i]))
                assert ids[row, at:at + tok.size].tolist() == tok.tolist()
                assert pos[row, at:at + tok.size].tolist() == list(range(tok.size))
                assert (seg[row, at:at + tok.size] == s).all()
                assert (mask[row, at:at + tok.size] == (not pad)).all()
                assert row * L + at in cu
                at += tok.size
            assert not mask[row, at:].any() and (ids[row, at:] == 0).all() and (seg[row, at:] == -1).all()


def test_pack_collate_refuses_samples_without_a_pack_or_the_member() -> None:
    collate = pack_collate("tokens.npy", seq_len=8, tensors=False)
    with pytest.raises(ConfigError, match="__pack__"):
        collate([{"__key__": "a", "tokens.npy": b"\x01\x00\x00\x00"}])
    with pytest.raises(ConfigError, match="no member 'tokens.npy'"):
        collate([{"__key__": "a", "__pack__": 0, "txt": b"x"}])
    with pytest.raises(ConfigError, match="seq_len"):
        pack_collate("tokens.npy")
    out = collate([{"__key__": "a", "__pack__": 0, "tokens.npy": np.arange(1, 12)}])  # longer than L: cut
    assert out["input_ids"].tolist() == [list(range(1, 9))] and out["cu_seqlens"].tolist() == [0, 8]


def test_a_packed_state_resumes_at_the_next_batch_and_another_sizing_is_refused(index: Index) -> None:
    ds = _ds(index)
    loader = Loader(ds, num_workers=2)
    seen, state = [], None
    for i, batch in enumerate(loader):
        seen.append([(s["__key__"], s["__pack__"]) for s in batch])
        if i == 1:
            state = loader.state_dict()
            break
    again = Loader(_ds(index), num_workers=2)
    again.load_state_dict(state)
    rest = [[(s["__key__"], s["__pack__"]) for s in b] for b in again]
    assert seen + rest == [[(index.key(int(i)), int(p)) for i, p in zip(b.samples, b.pack)] for b in ds.plan(0)]
    for other in (Pack(L, packs=3), Budget(2 * L)):
        with pytest.raises(StateMismatchError, match="plan.batch_size"):
            Loader(_ds(index, batch_size=other)).load_state_dict(state)
