"""Tests of wds_pad.stream.dataset and stream.loader: BucketedWebDataset and Loader.

Every order test compares the streamed keys with the plan (``plan[j].samples`` mapped
through ``index.key``); byte tests compare with ``wds.WebDataset``'s own reading.
Multi-rank behaviour is simulated in one process with explicit topologies.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pickle
import re
import shutil
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import webdataset as wds

from wds_pad.cli.synth import make_image_shards
from wds_pad.stream.dataset import BucketedWebDataset
from wds_pad.stream.loader import Loader
from wds_pad.stream.shardstream import ShardStream
from wds_pad.errors import ConfigError, DroppedBucketWarning, StaleShardError, StateMismatchError
from wds_pad.index.codec import load_index
from wds_pad.index.record import Index
from wds_pad.index.build import build_index
from wds_pad.io.options import ReadOptions
from wds_pad.core.topology import Topology

from data_helpers import open_descriptors

SOLO = Topology(world_size=1, rank=0)
pytestmark = [pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning"),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]


def _build(shard_dir: Path, seed: int = 0) -> Index:
    paths = make_image_shards(shard_dir, samples=120, shards=4, seed=seed)
    return build_index(paths, "aspect:width,height", output=str(shard_dir / "index.wdsidx"))


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Index:
    return load_index(_build(tmp_path_factory.mktemp("shards")).path)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference(index: Index) -> dict[str, dict[str, Any]]:
    return {s["__key__"]: s for s in wds.WebDataset(list(index.urls), shardshuffle=False)}


def _ds(index: Index | str, **kw: Any) -> BucketedWebDataset:
    args: dict[str, Any] = dict(batch_size=4, topology=SOLO, seed=11)
    args.update(kw)
    return BucketedWebDataset(index, **args)


def _plan_keys(ds: BucketedWebDataset, index: Index, epoch: int | None = None) -> list[list[str]]:
    return [[index.key(int(i)) for i in b.samples] for b in ds.plan(epoch)]


def _keys(batches: Any) -> list[list[str]]:
    return [[s["__key__"] for s in b] for b in batches]


def _image_size(sample: dict[str, Any]) -> tuple[int, int]:
    return (sample.get("png") or sample.get("jpg")).size


def _label(meta: dict[str, Any]) -> int:
    return int(meta["label"])


# ---------------------------------------------------------------- order and bytes


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_loader_order_equals_plan(index: Index, num_workers: int) -> None:
    ds = _ds(index)
    got = _keys(Loader(ds, num_workers=num_workers))
    assert got == _plan_keys(ds, index)
    assert len(got) == len(ds) and all(len(b) == 4 for b in got)


def test_dataset_iterated_directly_equals_plan_and_set_epoch(index: Index) -> None:
    ds = _ds(index)
    assert _keys(ds) == _plan_keys(ds, index, 0)
    assert _keys(ds) == _plan_keys(ds, index, 0)  # a finished epoch iterates again
    ds.set_epoch(1)
    e1 = _keys(ds)
    assert e1 == _plan_keys(ds, index, 1) and e1 != _plan_keys(ds, index, 0)


def test_streamed_bytes_equal_webdataset(index: Index, reference: dict[str, dict[str, Any]]) -> None:
    ds = _ds(index)
    n = 0
    for batch in ds:
        for s in batch:
            ref = reference[s["__key__"]]
            members = {k for k in ref if not k.startswith("__")}
            assert members == {k for k in s if not k.startswith("__")}
            assert all(s[k] == ref[k] for k in members)
            assert s["__url__"] == ref["__url__"]
            n += 1
    assert n == sum(b.samples.size for b in ds.plan())


def test_sample_dict_carries_plan_metadata(index: Index) -> None:
    ds = _ds(index)
    plan = ds.plan()
    for j, batch in enumerate(ds):
        for s, pad in zip(batch, plan[j].pad.tolist()):
            assert s["__bucket__"] == plan[j].bucket
            assert s["__dataset__"] == plan[j].dataset
            assert s["__epoch__"] == 0 and s["__step__"] == plan[j].step and s["__pad__"] is pad


# ---------------------------------------------------------------- composition


def test_fluid_decode_to_tuple_map(index: Index) -> None:
    ds = _ds(index).decode("pil").to_tuple("jpg;png", "json", "__key__").map(
        lambda t: (t[0].size, t[1], t[2]))
    plan_keys = _plan_keys(ds, index)
    batches = list(ds)
    assert len(batches) == len(plan_keys)
    for batch, keys in zip(batches, plan_keys):
        sizes, metas, got_keys = batch  # collated as webdataset's batched() would
        assert list(got_keys) == keys
        assert [tuple(x) for x in sizes] == [(m["width"], m["height"]) for m in metas]
        assert len({m["ratio"] for m in metas}) == 1  # one bucket per batch


def test_collation_matches_webdataset_batched(index: Index) -> None:
    ds = _ds(index).decode("pil").to_tuple("json", "__key__").map_tuple(_label, None)
    first = next(iter(ds))
    samples = [(int(k) % 10, k) for k in _plan_keys(ds, index)[0]]
    expected = wds.filters.default_collation_fn(samples)
    assert isinstance(first[0], np.ndarray) and first[0].tolist() == expected[0].tolist()
    assert list(first[1]) == list(expected[1])


def _mixed_batch(ds: BucketedWebDataset, index: Index) -> int:
    """The first plan batch whose samples mix jpg and png (the generator makes both)."""
    exts = {k: ext for k, ext in ((s["__key__"], "jpg" if "jpg" in s else "png")
                                   for s in wds.WebDataset(list(index.urls), shardshuffle=False))}
    for j, keys in enumerate(_plan_keys(ds, index)):
        if len({exts[k] for k in keys}) == 2:
            return j
    raise AssertionError("no batch mixes jpg and png: the test data changed")


@pytest.mark.parametrize("workers", [None, 2])
def test_decode_does_not_change_what_a_batch_is(index: Index, workers: int | None) -> None:
    plain, decoded = _ds(index), _ds(index).decode("pil").map(lambda s: {**s, "seen": True})
    _mixed_batch(plain, index)  # the data really mixes members inside a batch
    for ds in (plain, decoded):
        batches = list(ds if workers is None else Loader(ds, num_workers=workers))
        assert all(isinstance(b, list) and all(isinstance(s, dict) for s in b) for b in batches)
        assert _keys(batches) == _plan_keys(ds, index)
    assert all(s["seen"] and ("jpg" in s) != ("png" in s) for b in decoded for s in b)


def test_collating_samples_with_different_members_names_the_sample_and_the_fix(index: Index) -> None:
    ds = _ds(index).decode("pil").batched()  # webdataset's collation: one dict of columns
    j = _mixed_batch(ds, index)
    with pytest.raises(ConfigError) as info:
        list(ds)
    message = str(info.value)
    keys = _plan_keys(ds, index)[j]
    assert re.search(r"sample '(\d+)' of '.*shard-\d+\.tar' has members \['(jpg|json)', '(json|png)'\]", message)
    assert re.search(r"sample '(\d+)'", message).group(1) in keys
    assert "rename(image='jpg;png')" in message and "collation_fn=None" in message
    assert not isinstance(info.value, AssertionError)
    # the fix the message names works: one member 'image', collated into columns
    folded = list(_ds(index).decode("pil").rename(image="jpg;png").batched())
    assert len(folded) == len(ds)
    for b, keys in zip(folded, _plan_keys(ds, index)):
        assert list(b["__key__"]) == keys and len(b["image"]) == 4 and "jpg" not in b and "png" not in b


def test_stacking_tensors_of_different_shapes_names_the_sample(index: Index) -> None:
    ds = _ds(index).decode("torchrgb").to_tuple("jpg;png", "json")  # one bucket, several sizes
    with pytest.raises(ConfigError, match=r"sample '\d+' of '.*': field 0 has shape \(3, \d+, \d+\) but .*"
                                          r"resize each sample to its bucket's shape"):
        list(ds)


def test_transform_dropping_samples_is_refused(index: Index) -> None:
    ds = _ds(index).select(lambda s: False)
    with pytest.raises(ConfigError, match="one sample to one"):
        next(iter(ds))


def test_batched_with_other_size_is_refused(index: Index) -> None:
    with pytest.raises(ConfigError, match="follow the plan.s batch 4;"):
        _ds(index).batched(8)
    sizes = [len(b) for b in _ds(index).to_tuple("json").batched(collation_fn=None)]
    assert set(sizes) == {4}


def test_pickled_configured_dataset_streams_identically(index: Index) -> None:
    ds = _ds(index).decode("pil").map(_image_size).batched(collation_fn=None)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.spec.fingerprint() == ds.spec.fingerprint()
    assert list(clone) == list(ds)
    assert len(list(clone)) == len(ds)


def test_composed_dataset_through_workers(index: Index) -> None:
    ds = _ds(index).decode("pil").to_tuple("json", "__key__")
    got = [list(b[1]) for b in Loader(ds, num_workers=2)]
    assert got == _plan_keys(ds, index)


# ---------------------------------------------------------------- simulated ranks


def test_simulated_ranks_agree(index: Index) -> None:
    runs = {}
    for r in range(8):
        ds = _ds(index, topology=Topology(world_size=8, rank=r, cp_size=2), batch_size=2)
        runs[r] = [[(s["__key__"], s["__bucket__"], s["__step__"], s["__pad__"]) for s in b] for b in ds]
    counts = {len(v) for v in runs.values()}
    assert len(counts) == 1 and counts.pop() > 0
    for j in range(len(runs[0])):
        assert len({(b[j][0][1], b[j][0][2]) for b in runs.values()}) == 1  # same bucket, same step
        assert all(len(runs[r][j]) == 2 for r in runs)
        assert all(len({s[1] for s in runs[r][j]}) == 1 for r in runs)  # never mixes buckets
    for r in range(0, 8, 2):
        assert runs[r] == runs[r + 1]  # CP peers identical
    # over the DP ranks: every kept sample once unpadded, padded copies marked
    flat = [s for r in range(0, 8, 2) for b in runs[r] for s in b]
    real = Counter(s[0] for s in flat if not s[3])
    assert set(real.values()) == {1}
    kept = {k for k, v in index.bucket_counts().items() if v >= 8}
    assert len(real) == sum(index.bucket_counts()[k] for k in kept)
    padded = [s for s in flat if s[3]]
    assert padded and all(s[0] in real for s in padded)
    assert len(padded) == sum(-index.bucket_counts()[k] % 8 for k in kept)


def test_steps_mode_crosses_epochs(index: Index) -> None:
    ds = _ds(index, mode="steps")
    n0, n1 = len(ds.plan(0)), len(ds.plan(1))
    got = list(itertools.islice(ds, n0 + n1 + 2))
    expected = _plan_keys(ds, index, 0) + _plan_keys(ds, index, 1) + _plan_keys(ds, index, 2)[:2]
    assert _keys(got) == expected
    assert [b[0]["__epoch__"] for b in got[n0 - 1 : n0 + 1]] == [0, 1]
    assert ds.state_dict()["epoch"] == 2 and ds.state_dict()["index"] == 2


def test_steps_mode_through_workers(index: Index) -> None:
    ds = _ds(index, mode="steps")
    n0 = len(ds.plan(0))
    loader = Loader(ds, num_workers=2)
    it = iter(loader)
    got = [next(it) for _ in range(n0 + 3)]
    assert _keys(got) == _plan_keys(ds, index, 0) + _plan_keys(ds, index, 1)[:3]
    state = loader.state_dict()
    assert (state["epoch"], state["index"]) == (1, 3)


# ---------------------------------------------------------------- bad samples


def _copy(index: Index, tmp_path: Path) -> Index:
    dst = tmp_path / "copy"
    shutil.copytree(Path(index.urls[0]).parent, dst, ignore=shutil.ignore_patterns("*.wdsidx"))
    return build_index(sorted(glob.glob(str(dst / "*.tar"))), "aspect:width,height",
                       output=str(dst / "index.wdsidx"))


def _break_header(index: Index, i: int) -> None:
    """Bit rot the file's size and mtime do not show: the first bytes of the header right
    before the sample's first payload (its name, which the fast path compares with the key,
    after any PAX header; the checksum no longer matches either, which the exact path
    reports)."""
    stat = os.stat(index.url(i))
    first = int(index.arrays["member_start"][i])
    head = int(index.member_offsets(np.array([first]), np.array([1]))[0]) - 512
    with open(index.url(i), "r+b") as f:
        f.seek(int(index.offset[i]) + head)
        f.write(b"\xff\xfe")
    os.utime(index.url(i), ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_bad_sample_default_raises_naming_url_offset_key(index: Index, tmp_path: Path) -> None:
    broken = _copy(index, tmp_path)
    ds = _ds(broken.path)
    victim = int(ds.plan()[3].samples[2])
    _break_header(broken, victim)
    with pytest.raises(StaleShardError) as err:
        list(ds)
    msg = str(err.value)
    assert broken.url(victim) in msg and str(int(broken.offset[victim])) in msg
    assert broken.key(victim) in msg


@pytest.mark.parametrize("handler", [wds.warn_and_continue, lambda e: True])
def test_bad_sample_substitute_keeps_ranks_equal(index: Index, tmp_path: Path, handler: Any) -> None:
    broken = _copy(index, tmp_path)
    victim = int(_ds(broken.path, topology=Topology(world_size=2, rank=0)).plan()[1].samples[0])
    _break_header(broken, victim)

    def run(rank: int) -> tuple[list[list[str]], BucketedWebDataset]:
        ds = _ds(broken.path, topology=Topology(world_size=2, rank=rank), handler=handler)
        return [[s["__key__"] for s in b] for b in Loader(ds, num_workers=0)], ds

    with pytest.warns(UserWarning) if handler is wds.warn_and_continue else contextlib.nullcontext():
        got0, ds0 = run(0)
    got1, _ = run(1)
    again, ds_again = run(0)
    assert again == got0  # deterministic substitute
    planned = [_plan_keys(ds0, broken)[j] for j in range(len(got0))]
    assert len(got0) == len(got1) == len(ds0.plan())
    assert [len(b) for b in got0] == [len(b) for b in planned] == [len(b) for b in got1]
    assert broken.key(victim) not in {k for b in got0 for k in b}
    hits = sum(k == broken.key(victim) for b in planned for k in b)
    assert ds0.counters.substituted == ds_again.counters.substituted == hits >= 1
    assert broken.key(victim) in ds0.counters.failures[0]
    stand_in = next(g for p, g in zip(itertools.chain(*planned), itertools.chain(*got0)) if p != g)
    keys = {broken.key(i): i for i in range(len(broken))}
    assert broken.bucket[keys[stand_in]] == broken.bucket[victim]


def test_substitute_through_workers_same_as_in_process(index: Index, tmp_path: Path) -> None:
    broken = _copy(index, tmp_path)
    ds = _ds(broken.path, handler=lambda e: True)
    victim = int(ds.plan()[5].samples[1])
    _break_header(broken, victim)
    assert _keys(Loader(ds, num_workers=2)) == _keys(Loader(ds, num_workers=0))


def test_changed_shard_is_detected(index: Index, tmp_path: Path) -> None:
    broken = _copy(index, tmp_path)
    ds = _ds(broken.path)
    first = int(ds.plan()[0].samples[0])
    shard = int(broken.shard[first])
    other = make_image_shards(tmp_path / "other", samples=120, shards=4, seed=5)
    shutil.copyfile(other[shard], broken.urls[shard])  # rewritten with other content
    with pytest.raises(StaleShardError) as err:
        list(ds)
    msg = str(err.value)
    assert broken.urls[shard] in msg
    m = re.search(r"offset (\d+)", msg)
    assert m is not None and int(m.group(1)) in set(broken.offset[broken.shard == shard].tolist())


def test_truncated_shard_is_detected(index: Index, tmp_path: Path) -> None:
    broken = _copy(index, tmp_path)
    ds = _ds(broken.path)
    last = int(np.argmax(broken.offset * (broken.shard == 0)))
    with open(broken.urls[0], "r+b") as f:
        f.truncate(int(broken.offset[last]) + 100)
    with pytest.raises(StaleShardError, match=re.escape(broken.urls[0])):
        list(ds)


def _change_shard(index: Index, shard: int, how: str) -> None:
    """Change a shard so that every indexed byte range still parses: bytes appended, a
    payload byte edited in place (same size, new mtime), or another file put in its place."""
    path = index.urls[shard]
    stat = os.stat(path)
    first = int(np.flatnonzero(index.shard == shard)[0])
    payload = int(index.offset[first]) + 512  # the first member's data, after its header
    if how == "append":
        with open(path, "ab") as f:
            f.write(b"\0" * 10240)
        return
    data = bytearray(open(path, "rb").read())
    data[payload] ^= 0xFF
    if how == "edit":
        with open(path, "r+b") as f:
            f.seek(payload)
            f.write(data[payload:payload + 1])
    else:  # replaced by another shard with the same members at the same offsets
        with open(f"{path}.new", "wb") as f:
            f.write(data)
        os.replace(f"{path}.new", path)
    # a distinct mtime even if the filesystem's clock has not ticked since indexing
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))


CHANGES = ["append", "edit", "replace"]


@pytest.mark.parametrize("how", CHANGES)
@pytest.mark.parametrize("workers", [None, 0, 2])
def test_shard_changed_since_indexing_is_refused(index: Index, tmp_path: Path, how: str,
                                                 workers: int | None) -> None:
    changed = _copy(index, tmp_path)
    ds = _ds(changed.path)
    shard = int(changed.shard[int(ds.plan()[2].samples[0])])
    url, (size, stamp) = changed.urls[shard], (changed.shards[shard].size, changed.shards[shard].stamp)
    _change_shard(changed, shard, how)
    with pytest.raises(StaleShardError) as err:
        list(ds if workers is None else Loader(ds, num_workers=workers))
    msg = str(err.value)
    assert url in msg and f"the index records {size} bytes, {stamp}" in msg
    assert "wds-pad index" in msg and "--update" in msg
    assert f"now has {os.path.getsize(url)} bytes, mtime=" in msg


@pytest.mark.parametrize("how", CHANGES)
def test_changed_shard_with_a_handler_that_continues_gets_substitutes(index: Index, tmp_path: Path,
                                                                      how: str) -> None:
    changed = _copy(index, tmp_path)
    ds = _ds(changed.path, handler=lambda e: True)
    shard = int(changed.shard[int(ds.plan()[1].samples[0])])
    _change_shard(changed, shard, how)
    got = _keys(Loader(ds, num_workers=0))
    planned = _plan_keys(ds, changed)
    assert [len(b) for b in got] == [len(b) for b in planned]
    in_shard = {changed.key(i) for i in np.flatnonzero(changed.shard == shard)}
    hits = sum(k in in_shard for b in planned for k in b)
    assert hits >= 1 and ds.counters.substituted == hits
    assert not in_shard & {k for b in got for k in b}  # nothing of the changed shard streams
    for want, have in zip(itertools.chain(*planned), itertools.chain(*got)):
        assert have == want or want in in_shard  # the unchanged shards stream as before
    assert "--update" in ds.counters.failures[0]
    assert _keys(Loader(ds, num_workers=2)) == got  # the same substitutes in workers


# ---------------------------------------------------------------- state (smoke)


def test_state_dict_roundtrip_num_workers_0(index: Index) -> None:
    ds = _ds(index)
    full = _plan_keys(ds, index)
    loader = Loader(ds, num_workers=0)
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    state = loader.state_dict()
    assert (state["epoch"], state["index"]) == (0, 3)
    fresh = Loader(_ds(index), num_workers=0)
    fresh.load_state_dict(state)
    assert _keys(head) + _keys(fresh) == full

    direct = _ds(index)
    dit = iter(direct)
    next(dit)
    next(dit)
    saved = direct.state_dict()
    other = _ds(index)
    other.load_state_dict(saved)
    assert _keys(other) == full[2:]


def test_state_from_another_seed_is_refused(index: Index) -> None:
    state = _ds(index, seed=1).state_dict()
    ds = _ds(index, seed=2)
    with pytest.raises(StateMismatchError):
        ds.load_state_dict(state)
    assert _keys(ds) == _plan_keys(ds, index)  # nothing changed


@pytest.mark.parametrize("flag", ["zero_copy", "check_agreement", "oversubscribe"])
@pytest.mark.parametrize("value", ["false", "yes", 0, None])
def test_a_flag_that_is_not_a_bool_is_refused_naming_it(index: Index, flag: str, value: Any) -> None:
    """A flag read from a config file as a str ("false" is truthy) is never taken as one."""
    with pytest.raises(ConfigError, match=rf"^{flag} must be True or False, got {type(value).__name__} "):
        _ds(index, **{flag: value})
    _ds(index, **{flag: np.bool_(True)})  # a numpy bool is a bool


@pytest.mark.parametrize("kw,match", [
    (dict(handler="warn"), r"BucketedWebDataset: handler must be a callable or None, got str 'warn'"),
    (dict(collation_fn="list"), r"BucketedWebDataset: collation_fn must be a callable or None, got str 'list'"),
    (dict(read_options={"max_in_flight": 2}), r"read_options must be a wds_pad.ReadOptions or None, got dict"),
    (dict(storage_options="anon"), r"storage_options must be a dict of fsspec options or None, got str"),
])
def test_a_hook_or_options_of_the_wrong_type_is_refused_when_the_dataset_is_made(
        index: Index, kw: dict[str, Any], match: str) -> None:
    """Not at the first bad sample or batch, deep in a training run."""
    with pytest.raises(ConfigError, match=match):
        _ds(index, **kw)
    with pytest.raises(ConfigError, match="batched: collation_fn must be a callable or None, got str 'list'"):
        _ds(index).batched(collation_fn="list")
    with pytest.raises(ConfigError, match="storage_options must be a dict of fsspec options or None, got str"):
        ShardStream(index, topology=SOLO, seed=1, storage_options="anon")


def test_a_non_bool_allow_elastic_or_gather_state_is_refused_and_changes_nothing(index: Index) -> None:
    ds = _ds(index)
    state = ds.state_dict()
    for target in (ds, Loader(_ds(index))):
        with pytest.raises(ConfigError, match="allow_elastic must be True or False, got str 'no'"):
            target.load_state_dict(state, allow_elastic="no")
        assert _keys(target) == _plan_keys(ds, index)  # nothing changed
    with pytest.raises(ConfigError, match="Loader: gather_state must be True or False, got str 'true'"):
        Loader(ds, gather_state="true")
    kept = Loader(ds, num_workers=1, persistent_workers=np.bool_(True), pin_memory=np.bool_(False))
    assert kept.persistent_workers is True and kept.kwargs["pin_memory"] is False  # numpy bools are bools


def test_loader_batches_have_the_same_types_for_any_num_workers(index: Index) -> None:
    ds = _ds(index).decode("pil").to_tuple("json").map_tuple(_label)
    out = {n: list(Loader(ds, num_workers=n)) for n in (0, 2)}
    assert all(isinstance(b[0], np.ndarray) for b in out[0] + out[2])
    assert [b[0].tolist() for b in out[0]] == [b[0].tolist() for b in out[2]]


def test_read_stats_count_what_the_last_iteration_read(tmp_path) -> None:
    from wds_pad import BucketedWebDataset, Topology, build_index
    from wds_pad.cli.synth import make_image_shards

    urls = make_image_shards(str(tmp_path / "s"), samples=40, shards=2, seed=3)
    ds = BucketedWebDataset(build_index(urls), batch_size=4, topology=Topology(1, 0), seed=1,
                            check_agreement=False)
    assert ds.read_stats is None
    batches = list(ds)
    stats = ds.read_stats
    assert stats is not None and stats.ranges == sum(len(b) for b in batches) == 40
    assert stats.bytes == sum(int(ds.spec.indexes[0].length[i]) for i in range(40))


@pytest.mark.parametrize("bad", [{"batch_size": 4}, {"shuffle": True}, {"persistent_workers": True},
                                 {"sampler": [0]}])
def test_loaders_refuse_dataloader_arguments_that_break_exactness(tmp_path, bad) -> None:
    from wds_pad import BucketedWebDataset, ConfigError, Loader, ShardLoader, ShardStream, Topology, build_index
    from wds_pad.cli.synth import make_image_shards

    index = build_index(make_image_shards(str(tmp_path / "s"), samples=20, shards=2, seed=1))
    ds = BucketedWebDataset(index, batch_size=2, topology=Topology(1, 0), seed=1, check_agreement=False)
    key = next(iter(bad))
    if key != "persistent_workers":  # Loader keeps its workers itself (test_persistent_workers.py)
        with pytest.raises(ConfigError, match=f"Loader does not take {key}="):
            Loader(ds, **bad)
    with pytest.raises(ConfigError, match=f"ShardLoader does not take {key}="):
        ShardLoader(ShardStream(index, topology=Topology(1, 0), seed=1), **bad)
    with pytest.raises(ConfigError, match="num_workers must be an int >= 0"):
        Loader(ds, num_workers=-1)
    assert Loader(ds, batch_size=None).kwargs.get("batch_size") is None  # falsy values are dropped


# ---------------------------------------------------------------- large samples


def _mixed_index(out: Path, samples: int = 48, shards: int = 3) -> Index:
    """Shards mixing samples of 256 KB and more (read ahead by threads) with small ones."""
    from wds_pad.stream.fetch import BIG_SAMPLE

    rng = np.random.default_rng(1)
    out.mkdir(parents=True, exist_ok=True)
    urls, i = [], 0
    for s in range(shards):
        url = str(out / f"mixed-{s:03d}.tar")
        with wds.TarWriter(url, encoder=False) as writer:
            for _ in range(samples // shards):
                size = int(rng.integers(BIG_SAMPLE, BIG_SAMPLE + 100_000)) if rng.random() < 0.6 \
                    else int(rng.integers(100, 5_000))
                w, h = [(1, 1), (4, 3)][int(rng.integers(2))]
                writer.write({"__key__": f"{i:06d}", "bin": rng.bytes(size),
                              "json": f'{{"width": {64 * w}, "height": {64 * h}}}'.encode()})
                i += 1
        urls.append(url)
    return build_index(urls, "aspect:width,height", output=str(out / "index.wdsidx"))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Index:
    return load_index(_mixed_index(tmp_path_factory.mktemp("mixed")).path)  # type: ignore[arg-type]


def _read_ahead_threads() -> list[Any]:
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("wds_pad-local-read")]


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_large_samples_through_workers_keep_plan_order_and_bytes(mixed: Index, num_workers: int) -> None:
    ds = _ds(mixed, batch_size=2)
    reference = {s["__key__"]: s["bin"] for s in wds.WebDataset(list(mixed.urls), shardshuffle=False)}
    batches = list(Loader(ds, num_workers=num_workers))
    assert _keys(batches) == _plan_keys(ds, mixed)
    assert all(s["bin"] == reference[s["__key__"]] for b in batches for s in b)


def test_dropped_iterator_leaves_no_threads_and_epochs_leak_no_descriptors(mixed: Index) -> None:
    import gc
    import os
    import time

    from wds_pad.io import shardmaps

    def shard_fds() -> int:  # the shards' descriptors only (sockets of earlier tests close on their own
        # time), but for the process's kept mappings' own (io/shardmaps.py)
        return open_descriptors(mixed.urls) - sum(u in shardmaps._MAPS for u in mixed.urls)

    ds = _ds(mixed, batch_size=2)
    list(ds)
    gc.collect()
    fds = shard_fds()
    for _ in range(3):  # whole epochs, then one abandoned half way
        assert len(list(ds)) == len(ds)
    ids = np.concatenate([b.samples for b in ds.plan()])
    stats = ds.read_stats
    assert stats is not None and stats.ranges == stats.requests == ids.size
    assert stats.bytes == int(mixed.length[ids].sum())
    it = iter(ds)
    next(it), next(it)
    assert not _read_ahead_threads()  # large local samples are read inline: no thread to stop
    del it
    gc.collect()
    deadline = time.monotonic() + 5
    while _read_ahead_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _read_ahead_threads()
    assert shard_fds() == fds  # each epoch's reader closed its shards


# ---------------------------------------------------------------- DataLoader arguments


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_workers=1, prefetch_factor=0), r"prefetch_factor must be a positive int .* got 0"),
        (dict(num_workers=1, prefetch_factor=-2), "prefetch_factor must be a positive int"),
        (dict(num_workers=1, prefetch_factor=2.0), "prefetch_factor must be a positive int"),
        (dict(num_workers=1, prefetch_factor=True), "prefetch_factor must be a positive int"),
        (dict(num_workers=0, prefetch_factor=2), r"prefetch_factor=2 needs num_workers > 0"),
        (dict(num_workers=1.0), "num_workers must be an int >= 0, got 1.0; use 0"),
        (dict(num_workers=True), "num_workers must be an int >= 0"),
        (dict(num_workers=1, timeout=-1), "timeout must be a finite number of seconds >= 0"),
        (dict(num_workers=1, timeout=float("inf")), "timeout must be a finite number"),
        (dict(num_workers=1, timeout="5"), "timeout must be a finite number"),
        (dict(num_workers=0, multiprocessing_context="fork"), "multiprocessing_context='fork' needs num_workers > 0"),
        (dict(num_workers=1, multiprocessing_context="forq"), "'forq' is not a start method here; use one of"),
        (dict(num_workers=1, multiprocessing_context=3), "must be a start method name"),
        (dict(num_workers=1, pin_memory="yes"), "pin_memory must be True or False"),
        (dict(num_workers=1, worker_init_fn=5), "worker_init_fn must be a callable or None"),
        (dict(num_workers=1, drop_last=True), "does not take drop_last=True"),
        (dict(num_workers=1, prefetch=2), "unknown DataLoader argument"),
    ],
)
def test_loader_refuses_dataloader_arguments_torch_checks_late_or_by_assert(tmp_path, kwargs, match) -> None:
    from wds_pad import BucketedWebDataset, ConfigError, Loader, Topology, build_index
    from wds_pad.cli.synth import make_image_shards

    index = build_index(make_image_shards(str(tmp_path / "s"), samples=8, shards=1, seed=1))
    ds = BucketedWebDataset(index, batch_size=2, topology=Topology(1, 0), seed=1, check_agreement=False)
    with pytest.raises(ConfigError, match=rf"^Loader\b.*{match}"):
        Loader(ds, **kwargs)


def test_loader_with_a_positive_prefetch_factor_and_timeout_still_streams(tmp_path) -> None:
    from wds_pad import BucketedWebDataset, Loader, Topology, build_index
    from wds_pad.cli.synth import make_image_shards

    index = build_index(make_image_shards(str(tmp_path / "s"), samples=8, shards=1, seed=1))
    ds = BucketedWebDataset(index, batch_size=2, topology=Topology(1, 0), seed=1, check_agreement=False)
    loader = Loader(ds, num_workers=1, prefetch_factor=1, timeout=60, multiprocessing_context="fork",
                    pin_memory=False, in_order=True)
    assert sum(len(b) for b in loader) == 8


@pytest.mark.parametrize("threads", [0, 2])
def test_changed_shard_of_large_samples_is_refused_or_substituted(tmp_path: Path, threads: int) -> None:
    """Large local samples are read on the read-ahead path: the shard is checked there too."""
    mixed = _mixed_index(tmp_path / "mixed")
    ds = _ds(mixed.path, batch_size=2, read_options=ReadOptions(local_threads=threads))
    big = next(int(i) for b in ds.plan() for i in b.samples if mixed.length[i] >= 256 * 1024)
    shard = int(mixed.shard[big])
    _change_shard(mixed, shard, "append")
    with pytest.raises(StaleShardError, match=re.escape(mixed.urls[shard])):
        list(ds)
    kept = _ds(mixed.path, batch_size=2, read_options=ReadOptions(local_threads=threads),
               handler=lambda e: True)
    got = _keys(kept)
    assert [len(b) for b in got] == [len(b.samples) for b in kept.plan()]
    in_shard = {mixed.key(i) for i in np.flatnonzero(mixed.shard == shard)}
    assert kept.counters.substituted >= 1 and not in_shard & {k for b in got for k in b}


def test_dropped_bucket_warning_points_at_the_users_line(index: Index) -> None:
    counts = index.bucket_counts()
    batch = max(counts.values())  # every smaller bucket is below one global step
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", DroppedBucketWarning)
        _ds(index, batch_size=batch)  # planned here, in the constructor
        dropped = [w for w in record if issubclass(w.category, DroppedBucketWarning)]
    assert dropped and {w.filename for w in dropped} == {__file__}
    small = sum(c for c in counts.values() if c < batch)
    assert f"they hold {small} of the epoch's {len(index)} samples" in str(dropped[0].message)
