"""Tests of wds_pad.stream.agreement: what ranks must agree on, and what ``pad="none"``
lets differ.

The comparison itself runs against a stand-in for torch.distributed (every rank's
gathered values given); ``pad="none"`` streams in a real two-process gloo job with the
default check, with 0 and 2 DataLoader workers.
"""

from __future__ import annotations

import io
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from gloo_jobs import run_gloo_job
from wds_pad import BucketedWebDataset, Topology, build_index, load_index
from wds_pad.errors import StateMismatchError
from wds_pad.stream.agreement import check_agreement

SIZES = {"a": 13, "b": 9}  # batch 4 on 2 ranks: 4 batches on one rank, 3 on the other under "none"


@pytest.fixture(scope="module")
def two_buckets(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One shard of 22 samples, indexed into buckets ``a`` (13 samples) and ``b`` (9)."""
    root = tmp_path_factory.mktemp("agree")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, bucket in enumerate(b for b, n in SIZES.items() for _ in range(n)):
            data = bucket.encode()
            info = tarfile.TarInfo(f"{bucket}{i:02d}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (root / "s.tar").write_bytes(buf.getvalue())
    index = build_index(str(root / "s.tar"), lambda key, d: d["txt"].decode(), members=["txt"],
                        output=str(root / "two.wdsidx"))
    assert index.bucket_counts() == SIZES
    return str(root / "two.wdsidx")


def gathered_as(monkeypatch: pytest.MonkeyPatch, others: list[dict[str, Any]]) -> None:
    """torch.distributed as a job of ``1 + len(others)`` ranks whose other ranks sent ``others``
    (each: this rank's values with some replaced)."""
    world = 1 + len(others)
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)

    def all_gather_object(out: list[Any], mine: dict[str, Any], group: Any = None) -> None:
        out[0] = mine
        for r, changes in enumerate(others, start=1):
            out[r] = {**mine, "rank": r, **changes}

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)


def dataset(index: str, pad: str, **kw: Any) -> BucketedWebDataset:
    return BucketedWebDataset(index, batch_size=4, topology=Topology(world_size=2, rank=0), seed=7, pad=pad, **kw)


def test_none_lets_ranks_differ_in_batch_count(two_buckets: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = dataset(two_buckets, "none")
    gathered_as(monkeypatch, [{"batches": ds.cursor.length(ds.spec) - 1}])
    check_agreement(ds.spec, ds.cursor)  # no error


@pytest.mark.parametrize("pad", ["cyclic", "drop", "auto"])
def test_lockstep_policies_still_compare_batch_counts(two_buckets: str, monkeypatch: pytest.MonkeyPatch,
                                                      pad: str) -> None:
    ds = dataset(two_buckets, pad)
    n = ds.cursor.length(ds.spec)
    gathered_as(monkeypatch, [{"batches": n - 1}])
    with pytest.raises(StateMismatchError, match=f"batches: rank 0 {n} vs rank 1 {n - 1}"):
        check_agreement(ds.spec, ds.cursor)


def test_one_lockstep_rank_among_none_ranks_makes_every_rank_compare_counts(
        two_buckets: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = dataset(two_buckets, "none")
    n = ds.cursor.length(ds.spec)
    gathered_as(monkeypatch, [{"batches": n - 1, "lockstep": True}])
    with pytest.raises(StateMismatchError, match="batches: rank 0"):
        check_agreement(ds.spec, ds.cursor)


@pytest.mark.parametrize(("field", "value"), [("epoch", 1), ("mode", "steps"), ("elastic", "ab12"),
                                              ("fingerprint", "0" * 32)])
def test_none_still_compares_what_must_agree(two_buckets: str, monkeypatch: pytest.MonkeyPatch,
                                             field: str, value: Any) -> None:
    ds = dataset(two_buckets, "none")
    gathered_as(monkeypatch, [{field: value}])
    with pytest.raises(StateMismatchError, match=f"rank 1 differs from rank 0: {field}"):
        check_agreement(ds.spec, ds.cursor)


def test_none_still_names_a_differing_plan_field(two_buckets: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = dataset(two_buckets, "none")
    plan = ds.spec.fingerprint_fields()
    gathered_as(monkeypatch, [{"fingerprint": "f" * 32, "plan": {**plan, "seed_hash": "0" * 16}}])
    with pytest.raises(StateMismatchError, match=r"plan fields differ: seed_hash \(rank 0: "):
        check_agreement(ds.spec, ds.cursor)


_NONE_JOB = r"""
import datetime, json, sys
import torch.distributed as dist
from wds_pad import BucketedWebDataset, Loader, WdsPadError

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
index, rank = sys.argv[1], dist.get_rank()
out = {}
for workers in (0, 2):  # the default check_agreement=True
    ds = BucketedWebDataset(index, batch_size=4, seed=7, pad="none")
    out[f"workers{workers}"] = [[s["__key__"] for s in batch] for batch in Loader(ds, num_workers=workers)]
ds = BucketedWebDataset(index, batch_size=4, seed=7 + rank, pad="none")  # a real difference: the seed
try:
    next(iter(Loader(ds)))
    out["other_seed"] = None
except WdsPadError as exc:
    out["other_seed"] = f"{type(exc).__name__}: {exc}"
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_pad_none_streams_every_sample_once_on_two_gloo_ranks(two_buckets: str, tmp_path: Path) -> None:
    results = run_gloo_job(tmp_path, _NONE_JOB, 2, args=(two_buckets,))
    index = load_index(two_buckets)
    keys = Counter(index.key(i) for i in range(len(index)))
    for workers in ("workers0", "workers2"):
        per_rank = [r[workers] for r in results]
        assert sorted(len(batches) for batches in per_rank) == [3, 4]  # uneven, as "none" is documented
        streamed = Counter(k for batches in per_rank for batch in batches for k in batch)
        assert streamed == keys  # every sample exactly once over both ranks
        for batches in per_rank:
            assert all(len({k[0] for k in batch}) == 1 for batch in batches)  # one bucket per batch
    for r in results:
        assert r["other_seed"].startswith("StateMismatchError: ranks disagree on the plan before the first "
                                          "batch: rank 1 differs from rank 0: plan fields differ: seed_hash")
