"""Resume after preemption on the bucketed path: exactness, O(1) seeks, SIGKILL, elastic,
torch.distributed.checkpoint and torchdata's StatefulDataLoader.

Every check compares the resumed stream with the uninterrupted one batch for batch
(sample keys and pad flags), through tests/resume_harness.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wds_pad.io import ranges as read_mod
from wds_pad.cli.synth import make_image_shards
from wds_pad.stream.dataset import BucketedWebDataset
from wds_pad.stream.loader import Loader
from wds_pad.errors import StateMismatchError, TopologyMismatchError
from wds_pad.index.codec import load_index
from wds_pad.index.record import Index
from wds_pad.index.build import build_index
from wds_pad.state import load_state_file, state_path
from wds_pad.core.topology import Topology

import doc_blocks
from data_helpers import image_index, make_dataset
from resume_harness import check_resume, check_start_mid_boundary, epochs_driver, take

pytestmark = pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Index:
    return image_index(tmp_path_factory.mktemp("shards"), samples=120, shards=4, seed=1)


def batch_key(batch: list[dict[str, Any]]) -> tuple[tuple[str, bool, int, int], ...]:
    return tuple((s["__key__"], bool(s["__pad__"]), s["__epoch__"], s["__step__"]) for s in batch)


def make_ds(index: Index, **kw: Any) -> BucketedWebDataset:
    return make_dataset(index, quiet=True, **{"seed": 11, "check_agreement": False, **kw})


def _drive_and_total(ds: BucketedWebDataset) -> tuple[Any, int | None, list[int]]:
    """epochs mode: epochs 0..1 with the boundary after epoch 0; steps mode: 2.5 epochs."""
    n0 = len(ds.plan(0))
    if ds.spec.mode.value == "epochs":
        return epochs_driver(1), None, [n0]
    return iter, n0 + len(ds.plan(1)) + len(ds.plan(2)) // 2, [n0, n0 + len(ds.plan(1))]


# ------------------------------------------------------------------ exactness, num_workers=0

CONFIGS = st.fixed_dictionaries({
    "mode": st.sampled_from(["epochs", "steps"]),
    "world": st.sampled_from([(1, 0), (2, 1), (4, 3)]),
    "pad": st.sampled_from(["auto", "cyclic", "drop"]),
    "batch_size": st.sampled_from([3, 4]),
    "seed": st.integers(0, 2**31),
})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=CONFIGS, where=st.floats(0, 1), near_boundary=st.sampled_from([None, -1, 0, 1]),
       through_loader=st.booleans())
def test_resume_equals_uninterrupted_remainder(index: Index, cfg: dict[str, Any], where: float,
                                               near_boundary: int | None, through_loader: bool) -> None:
    world, rank = cfg["world"]

    def make() -> Any:
        ds = make_ds(index, mode=cfg["mode"], pad=cfg["pad"], batch_size=cfg["batch_size"], seed=cfg["seed"],
                     topology=Topology(world, rank))
        return Loader(ds) if through_loader else ds

    probe = make_ds(index, mode=cfg["mode"], pad=cfg["pad"], batch_size=cfg["batch_size"], seed=cfg["seed"],
                    topology=Topology(world, rank))
    drive, total, boundaries = _drive_and_total(probe)
    ref = take(drive, make(), total, batch_key)
    stop = round(where * len(ref)) if near_boundary is None else boundaries[0] + near_boundary
    stop = min(max(stop, 0), len(ref))
    state = check_resume(make, stop, drive=drive, key=batch_key, total=total, reference=ref)
    assert state["index"] <= state["batches_in_epoch"]


def test_harness_detects_a_wrong_resume(index: Index) -> None:
    """The harness is not vacuous: a loader that loses one batch on resume fails it."""

    def make() -> BucketedWebDataset:
        return make_ds(index)

    def lossy(obj: BucketedWebDataset, state: dict[str, Any]) -> None:
        obj.load_state_dict(dict(state, index=state["index"] + 1))

    with pytest.raises(AssertionError, match="after resuming"):
        check_resume(make, 3, key=batch_key, load=lossy)


# ------------------------------------------------------------------ workers: fixed cases


@pytest.mark.parametrize("num_workers,mode", [(1, "epochs"), (2, "epochs"), (2, "steps")])
def test_loader_with_workers_resumes_at_start_mid_and_boundary(index: Index, num_workers: int, mode: str) -> None:
    probe = make_ds(index, mode=mode, batch_size=8)
    drive, total, boundaries = _drive_and_total(probe)

    def make() -> Loader:
        return Loader(make_ds(index, mode=mode, batch_size=8), num_workers=num_workers)

    stops = check_start_mid_boundary(make, drive=drive, key=batch_key, boundaries=boundaries[:1], total=total)
    assert boundaries[0] in stops and 0 in stops


def test_loader_state_is_exact_while_workers_prefetch(index: Index) -> None:
    loader = Loader(make_ds(index, batch_size=4), num_workers=2, prefetch_factor=4)
    it = iter(loader)
    for k in range(1, 6):
        next(it)
        assert loader.state_dict()["index"] == k  # not what the workers already made
    it.close()


# ------------------------------------------------------------------ O(1): a seek, not a replay


def test_resume_reads_only_what_the_first_batch_needs(index: Index, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = make_ds(index, batch_size=4)
    plan = ds.plan(0)
    k = len(plan) - 3
    offsets_of = lambda batches: {int(index.offset[i]) for b in batches for i in b.samples}  # noqa: E731
    later = offsets_of(plan[j] for j in range(k, len(plan)))
    earlier_only = offsets_of(plan[j] for j in range(k)) - later
    read: list[int] = []
    original = read_mod.RangeReader.read_many

    def counting(self: Any, ranges: Any) -> Any:
        def spy() -> Any:
            for url, offset, length in ranges:
                read.append(offset)
                yield url, offset, length
        return original(self, spy())

    real_pread = os.pread

    def pread(fd: int, n: int, offset: int) -> bytes:  # the batch-wise local path reads with pread
        read.append(offset)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(read_mod.RangeReader, "read_many", counting)
    monkeypatch.setattr(os, "pread", pread)
    state = make_ds(index, batch_size=4).state_dict()
    resumed = make_ds(index, batch_size=4)
    resumed.load_state_dict(dict(state, index=k))
    first = next(iter(resumed))
    assert batch_key(first) == tuple((index.key(int(i)), bool(p), 0, plan[k].step)
                                     for i, p in zip(plan[k].samples, plan[k].pad))
    assert read and read[0] == int(index.offset[plan[k].samples[0]])
    assert not set(read) & earlier_only, "resuming read samples of batches before the position"
    assert len(read) <= sum(len(plan[j].samples) for j in range(k, len(plan)))


# ------------------------------------------------------------------ SIGKILL mid-epoch

CHILD = textwrap.dedent("""
    import json, os, sys, time, warnings
    warnings.simplefilter("ignore")
    from wds_pad.stream.dataset import BucketedWebDataset
    from wds_pad.state import load_state_file, save_state_file, state_path
    from wds_pad.core.topology import Topology
    index, ckpt, log, delay = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    ds = BucketedWebDataset(index, batch_size=4, seed=5, topology=Topology(2, 1), check_agreement=False)
    if os.path.exists(state_path(ckpt, 1)):
        ds.load_state_dict(load_state_file(state_path(ckpt, 1), rank=1))
    with open(log, "a") as f:
        for batch in ds:
            # log first, then save: a kill in between leaves the log one batch ahead,
            # and the resumed run drops logged batches at or past the saved position
            index_done = ds.state_dict()["index"] - 1
            f.write(json.dumps([index_done, [s["__key__"] for s in batch]]) + "\\n")
            f.flush(); os.fsync(f.fileno())
            time.sleep(delay)
            save_state_file(ds.state_dict(), ckpt, rank=1)
""")


def test_sigkill_mid_epoch_then_resume_completes_the_epoch_exactly(index: Index, tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    ckpt, log1, log2 = tmp_path / "ckpt", tmp_path / "run1.log", tmp_path / "run2.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script), str(index.path), str(ckpt), str(log1), "0.05"], env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        lines = log1.read_text().splitlines() if log1.exists() else []
        if len(lines) >= 4:
            break
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    saved = load_state_file(state_path(str(ckpt), 1), rank=1)["index"]
    first = [json.loads(line) for line in log1.read_text().splitlines()]
    assert 0 < saved < len(make_ds(index, seed=5, topology=Topology(2, 1)).plan(0)), "the kill was not mid-epoch"
    assert len(first) in (saved, saved + 1)  # the kill may land between logging and saving
    kept = [keys for i, keys in first if i < saved]
    done = subprocess.run([sys.executable, str(script), str(index.path), str(ckpt), str(log2), "0"],
                          env=env, timeout=120)
    assert done.returncode == 0
    second = [keys for _, keys in (json.loads(line) for line in log2.read_text().splitlines())]
    plan = make_ds(index, seed=5, topology=Topology(2, 1)).plan(0)
    expected = [[index.key(int(i)) for i in b.samples] for b in plan]
    assert kept + second == expected


# ------------------------------------------------------------------ elastic


def _rank_streams(index: Index, world: int, **kw: Any) -> list[BucketedWebDataset]:
    return [make_ds(index, topology=Topology(world, r), **kw) for r in range(world)]


def _keys(batches: Any) -> list[str]:
    """The real (not padded) sample keys of ``batches``, sorted."""
    return sorted(s["__key__"] for b in batches for s in b if not s["__pad__"])


def _epoch(index: Index, world: int, **kw: Any) -> list[str]:
    return _keys(b for ds in _rank_streams(index, world, **kw) for b in ds)


@pytest.mark.parametrize("old,new,frac", [(4, 2, 0.5), (4, 1, 0.5), (2, 1, 0.5), (2, 4, 0.3), (3, 4, 0.7)])
def test_elastic_mid_epoch_resume_trains_every_sample_exactly_once(index: Index, old: int, new: int,
                                                                   frac: float) -> None:
    olds = _rank_streams(index, old)
    steps = max(1, round(len(olds[0].plan(0)) * frac))
    consumed: list[Any] = []
    states = []
    for ds in olds:
        it = iter(ds)
        consumed += [next(it) for _ in range(steps)]
        states.append(ds.state_dict())
    rest, lengths = [], set()
    for r, ds in enumerate(_rank_streams(index, new)):
        ds.load_state_dict(states[r * old // new], allow_elastic=True)
        mine = list(ds)
        lengths.add(len(mine))
        rest += mine
        assert len(ds) == len(mine)
    assert len(lengths) == 1, "DP ranks must get equally many batches after an elastic resume"
    assert sorted(_keys(consumed) + _keys(rest)) == _epoch(index, old)


def test_elastic_state_resumes_again_on_the_same_and_on_a_third_layout(index: Index) -> None:
    olds = _rank_streams(index, 4)
    states = []
    consumed: list[Any] = []
    for ds in olds:
        it = iter(ds)
        consumed += [next(it) for _ in range(3)]
        states.append(ds.state_dict())
    twos = _rank_streams(index, 2)
    states2 = []
    for r, ds in enumerate(twos):
        ds.load_state_dict(states[2 * r], allow_elastic=True)
        it = iter(ds)
        consumed += [next(it) for _ in range(2)]
        states2.append(json.loads(json.dumps(ds.state_dict())))
        (seg,) = states2[-1]["elastic"]["segments"]
        assert seg[:2] == [4, 3] and len(seg[2]) == 32  # layout, steps, fingerprint of the rest
    # same layout: continues exactly
    again = make_ds(index, topology=Topology(2, 1))
    again.load_state_dict(states2[1])
    it.close()  # twos[1]'s open iterator would refuse the load
    twos[1].load_state_dict(states2[1])
    assert [batch_key(b) for b in again] == [batch_key(b) for b in twos[1]]
    # a third layout: 4 -> 2 -> 1
    one = make_ds(index, topology=Topology(1, 0))
    one.load_state_dict(states2[0], allow_elastic=True)
    rest = list(one)
    segs = one.state_dict()["elastic"]["segments"]
    assert segs[0] == seg and segs[1][:2] == [2, 2] and segs[1][2] != seg[2]
    assert sorted(_keys(consumed) + _keys(rest)) == _epoch(index, 4)
    # later epochs plan normally
    one.set_epoch(1)
    assert [batch_key(b) for b in one] == [batch_key(b) for b in _with_epoch(make_ds(index, topology=Topology(1, 0)), 1)]


def _with_epoch(ds: BucketedWebDataset, epoch: int) -> BucketedWebDataset:
    ds.set_epoch(epoch)
    return ds


def test_an_edited_elastic_fingerprint_or_an_old_elastic_state_is_refused(index: Index) -> None:
    ds = make_ds(index, topology=Topology(2, 0))
    it = iter(ds)
    next(it)
    one = make_ds(index, topology=Topology(1, 0))
    one.load_state_dict(ds.state_dict(), allow_elastic=True)
    state = one.state_dict()
    (seg,) = state["elastic"]["segments"]
    edited = {**state, "elastic": {"segments": [seg[:2] + ["0" * 32]]}}
    fresh = make_ds(index, topology=Topology(1, 0))
    before = fresh.state_dict()
    with pytest.raises(StateMismatchError, match=r"elastic.segments\[-1\]\[2\] \(the fingerprint\): saved '0000"):
        fresh.load_state_dict(edited)
    old_style = {**state, "elastic": {"segments": [seg[:2]]}}  # as an earlier wds_pad saved it
    with pytest.raises(StateMismatchError, match="'elastic.segments' holds no fingerprint"):
        fresh.load_state_dict(old_style)
    assert fresh.state_dict() == before


def test_elastic_growing_after_one_step_is_exact(index: Index) -> None:
    ds = make_ds(index, topology=Topology(2, 0))
    it = iter(ds)
    consumed = [next(it)]  # one step on 2 ranks: 8 samples of a bucket; a step on 4 ranks is 16
    consumed += [next(iter(make_ds(index, topology=Topology(2, 1))))]
    state = ds.state_dict()
    rest = []
    for r in range(4):
        four = make_ds(index, topology=Topology(4, r))
        four.load_state_dict(state, allow_elastic=True)
        rest += list(four)
    assert sorted(_keys(consumed) + _keys(rest)) == _epoch(index, 2)
    with pytest.raises(TopologyMismatchError, match="topology.world_size: saved 2, now 4"):
        make_ds(index, topology=Topology(4, 0)).load_state_dict(state)


def test_elastic_with_policy_none_uses_every_ranks_entry_or_names_the_missing_ones(index: Index) -> None:
    olds = _rank_streams(index, 2, pad="none")
    its = [iter(ds) for ds in olds]
    consumed = [next(its[0]), next(its[0]), next(its[0]), next(its[1])]  # ranks at 3 and 1
    states = [ds.state_dict() for ds in olds]
    one = make_ds(index, topology=Topology(1, 0), pad="none")
    before = one.state_dict()
    with pytest.raises(TopologyMismatchError, match=r"no entry of dp_rank 1 of the saved dp_size 2 under 'per_rank'"):
        one.load_state_dict(states[0], allow_elastic=True)
    assert one.state_dict() == before
    merged = {**states[0], "per_rank": {**states[0]["per_rank"], **states[1]["per_rank"]}}
    one.load_state_dict(merged, allow_elastic=True)
    rest = list(one)
    assert sorted(_keys(consumed) + _keys(rest)) == _epoch(index, 2, pad="none")
    for it in its:
        list(it)  # finish the epoch: a boundary maps onto any layout
    done = [ds.state_dict() for ds in olds]
    merged = {**done[0], "per_rank": {**done[0]["per_rank"], **done[1]["per_rank"]}}
    one = make_ds(index, topology=Topology(1, 0), pad="none")
    one.load_state_dict(merged, allow_elastic=True)
    assert list(one) == []  # the saved epoch is finished
    one.set_epoch(1)
    assert len(list(one)) == len(one.plan(1)) > 0


def test_elastic_through_loader_with_workers(index: Index) -> None:
    old = make_ds(index, topology=Topology(2, 0))
    it = iter(old)
    consumed = [next(it) for _ in range(4)]
    state = old.state_dict()
    consumed += list(make_ds(index, topology=Topology(2, 1)))[:4]
    loader = Loader(make_ds(index, topology=Topology(1, 0)), num_workers=2)
    loader.load_state_dict(state, allow_elastic=True)
    rest = list(loader)
    assert loader.state_dict()["index"] == len(rest) == loader.state_dict()["batches_in_epoch"]
    assert sorted(_keys(consumed) + _keys(rest)) == _epoch(index, 2)


# ------------------------------------------------------------------ interop


def test_state_round_trips_through_torch_distributed_checkpoint(index: Index, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    def make() -> Loader:
        return Loader(make_ds(index, topology=Topology(1, 0)))

    ref = [batch_key(b) for b in make()]
    # an elastic state exercises the nested, variable-length fields
    old = make_ds(index, topology=Topology(2, 0))
    it = iter(old)
    next(it)
    loader = make()
    loader.load_state_dict(old.state_dict(), allow_elastic=True)
    it = iter(loader)
    head = [batch_key(next(it)) for _ in range(2)]
    saved = loader.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: single process"
        dcp.save({"loader": loader}, checkpoint_id=str(tmp_path / "ckpt"))
        fresh = make()
        dcp.load({"loader": fresh}, checkpoint_id=str(tmp_path / "ckpt"))
    assert fresh.state_dict() == saved
    assert [s[:2] for s in saved["elastic"]["segments"]] == [[2, 1]]
    rest = [batch_key(b) for b in fresh]
    elastic_ref = make()
    elastic_ref.load_state_dict(old.state_dict(), allow_elastic=True)
    assert head + rest == [batch_key(b) for b in elastic_ref]
    assert len(head + rest) < len(ref)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_torchdata_stateful_dataloader_resumes_exactly(index: Index, num_workers: int) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make() -> Any:
        ds = make_ds(index, mode="steps", batch_size=8)
        return StatefulDataLoader(ds, batch_size=None, num_workers=num_workers, collate_fn=lambda b: b)

    total = 3 * len(make_ds(index, mode="steps", batch_size=8).plan(0)) // 2
    ref = take(iter, make(), total, batch_key)
    for stop in (0, 3, 7, total - 1):
        check_resume(make, stop, key=batch_key, total=total, reference=ref, roundtrip=False)


# ---------------------------------------------------------------- the loops of README.md and docs/
class _Preempted(Exception):
    pass


class _Recorder:
    """Stands in for the loader in a documented loop: records each batch the loop receives
    and, after ``stop_after`` of them, saves the loader's state and raises (a preemption)."""

    def __init__(self, loader: Any, stop_after: int | None = None) -> None:
        self.loader, self.stop_after, self.got, self.state = loader, stop_after, [], None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        for batch in self.loader:
            self.got.append(_batch_keys(batch))
            yield batch
            if self.stop_after is not None and len(self.got) == self.stop_after:
                self.state = json.loads(json.dumps(self.loader.state_dict()))
                raise _Preempted


def _batch_keys(batch: Any) -> tuple[Any, ...]:
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], dict):
        return tuple((s["__key__"], bool(s["__pad__"])) for s in batch)
    return tuple(str(k) for k in batch[0])  # a to_tuple batch: keys first


def _doc_loop(path: str, first_line: str) -> str:
    """The code of a documented loop, as written: from ``first_line`` to the end of its block."""
    for block in (b.text for b in doc_blocks.blocks(ROOT / path) if b.lang == "python"):
        lines = block.splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith(first_line)]
        if starts:
            return "\n".join(lines[starts[0]:])
    raise AssertionError(f"{path} has no python block with a line starting {first_line!r}")


def _run_doc_loop(code: str, loader: Any, stop_after: int | None, tmp_path: Path, **names: Any) -> _Recorder:
    rec = _Recorder(loader, stop_after)
    scope = {"loader": rec, "torch": __import__("torch"), **names}
    cwd = os.getcwd()
    os.chdir(tmp_path)  # a loop may save files into the working directory
    try:
        exec(compile(code, "<doc loop>", "exec"), scope)
        assert stop_after is None, "the loop ended before the preemption point"
    except _Preempted:
        pass
    finally:
        os.chdir(cwd)
    return rec


DOC_LOOPS = {
    "README": ("README.md", "for epoch in range(loader.epoch, epochs):", dict(epochs=3)),
    "streaming": ("docs/streaming.md", "for epoch in range(", {}),
    "resume": ("docs/resume.md", "epoch = loader.epoch", dict(
        EPOCHS=3, EVERY=7, step=0, model=None, opt=None, train_step=lambda model, opt, batch: 0.0,
        save=lambda step: None)),
}


def _doc_dataset(index: Index) -> BucketedWebDataset:
    return make_ds(index).to_tuple("__key__", "__pad__")


@pytest.mark.parametrize("where", ["mid first epoch", "end of first epoch", "mid second epoch"])
@pytest.mark.parametrize("doc", list(DOC_LOOPS))
def test_documented_loops_resume_exactly(index: Index, tmp_path: Path, doc: str, where: str) -> None:
    path, first_line, names = DOC_LOOPS[doc]
    code = _doc_loop(path, first_line)
    epochs = names.get("epochs", names.get("EPOCHS", 10))
    if doc == "streaming":  # range(loader.epoch, 10): stop after three epochs
        code = code.replace("range(loader.epoch, 10)", "range(loader.epoch, 3)")
        assert "range(loader.epoch, 3)" in code, code
        epochs = 3
    per_epoch = len(make_ds(index))
    stop = {"mid first epoch": 5, "end of first epoch": per_epoch, "mid second epoch": per_epoch + 3}[where]

    def fresh() -> Loader:
        ds = _doc_dataset(index)
        return Loader(ds)

    full = _run_doc_loop(code, fresh(), None, tmp_path, dataset=fresh().dataset, **dict(names))
    assert len(full.got) == epochs * per_epoch
    first = _run_doc_loop(code, fresh(), stop, tmp_path, dataset=fresh().dataset, **dict(names))
    resumed = fresh()
    resumed.load_state_dict(first.state)
    second = _run_doc_loop(code, resumed, None, tmp_path, dataset=resumed.dataset, **dict(names))
    assert first.got + second.got == full.got  # nothing twice, nothing lost


def test_readme_loop_resumes_exactly_with_workers(index: Index, tmp_path: Path) -> None:
    path, first_line, names = DOC_LOOPS["README"]
    code = _doc_loop(path, first_line).replace("range(loader.epoch, epochs)", "range(loader.epoch, 2)")
    per_epoch = len(make_ds(index))
    full = _run_doc_loop(code, Loader(_doc_dataset(index), num_workers=2), None, tmp_path)
    first = _run_doc_loop(code, Loader(_doc_dataset(index), num_workers=2), per_epoch + 5, tmp_path)
    resumed = Loader(_doc_dataset(index), num_workers=2)
    resumed.load_state_dict(first.state)
    second = _run_doc_loop(code, resumed, None, tmp_path)
    assert first.got + second.got == full.got


def test_shards_doc_loop_resumes_exactly(index: Index, tmp_path: Path) -> None:
    import wds_pad
    from wds_pad.stream.shardstream import ShardLoader, ShardStream

    code = _doc_loop("docs/shards.md", "if resuming:")

    def fresh() -> ShardLoader:
        stream = ShardStream(index, seed=1234, topology=Topology(1, 0))
        return ShardLoader(stream.to_tuple("__key__", "__pad__").batched(4))

    names: dict[str, Any] = dict(wds_pad=wds_pad, rank=0, step=1)
    full = _run_doc_loop(code, fresh(), None, tmp_path, resuming=False, **names)
    first = _run_doc_loop(code, fresh(), 4, tmp_path, resuming=False, **names)
    wds_pad.save_state_file(first.state, str(tmp_path / "ckpt"), 0)  # the loop loads "ckpt/" (cwd: tmp_path)
    second = _run_doc_loop(code, fresh(), None, tmp_path, resuming=True, **names)
    assert first.got + second.got == full.got


def test_set_epoch_after_a_restore_keeps_its_epoch_and_moves_to_another(index: Index) -> None:
    whole = [batch_key(b) for b in make_ds(index)]
    epoch1 = [batch_key(b) for b in make_ds(index, epoch=1)]
    ds = make_ds(index)
    it = iter(ds)
    head = [batch_key(next(it)) for _ in range(4)]
    state = ds.state_dict()
    it.close()
    for make_loader in (lambda d: d, Loader):
        again = make_loader(make_ds(index))
        again.load_state_dict(state)
        again.set_epoch(0)  # the restored epoch: the position stays
        again.set_epoch(0)
        assert head + [batch_key(b) for b in again] == whole
        moved = make_loader(make_ds(index))
        moved.load_state_dict(state)
        moved.set_epoch(1)  # another epoch: deliberately its first batch
        assert [batch_key(b) for b in moved] == epoch1
        moved.set_epoch(1)  # not restored any more: set_epoch starts the epoch again
        assert [batch_key(b) for b in moved] == epoch1


# ---------------------------------------------------------------- load_state_dict while iterating
@pytest.mark.parametrize("num_workers", [0, 2])
def test_loading_while_a_loader_iterator_is_open_is_refused(index: Index, num_workers: int) -> None:
    from wds_pad.errors import StateError

    other = make_ds(index)
    o = iter(other)
    next(o), next(o), next(o)
    state = other.state_dict()
    o.close()
    loader = Loader(make_ds(index), num_workers=num_workers)
    it = iter(loader)
    got = [batch_key(next(it)) for _ in range(5)]
    before = loader.state_dict()
    with pytest.raises(StateError, match="(?i)load the state before iterating"):
        loader.load_state_dict(state)
    with pytest.raises(StateError, match="an iterator of this loader is still open"):
        loader.dataset.load_state_dict(state)
    assert loader.state_dict() == before  # never a mix
    got += [batch_key(b) for b in it]  # the open iterator goes on with its own plan
    assert got == [batch_key(b) for b in make_ds(index)]
    loader.load_state_dict(state)  # closed (finished): now it loads
    assert [batch_key(b) for b in loader] == [batch_key(b) for b in make_ds(index)][3:]


def test_loading_while_a_dataset_iterator_is_open_is_refused(index: Index) -> None:
    from wds_pad.errors import StateError

    ds = make_ds(index)
    state = ds.state_dict()
    it = iter(ds)
    next(it)
    with pytest.raises(StateError, match="(?i)load the state before iterating"):
        ds.load_state_dict(state)
    with pytest.raises(StateError, match="still open"):
        Loader(ds).load_state_dict(state)
    it.close()
    ds.load_state_dict(state)
    unstarted = iter(ds)  # created but not started: it starts where the state says
    ds.load_state_dict(state)
    assert [batch_key(b) for b in unstarted] == [batch_key(b) for b in make_ds(index)]
