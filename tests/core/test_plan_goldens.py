"""Plans are a fixed function of their inputs: a matrix of configurations, each hashed.

Every configuration (count and budget sizing, each padding policy, locality none, shard
and node, context parallelism, accumulation, weights and repeats, several epochs,
oversubscription, steps mode, elastic remainders reached through saved states) is planned
on every rank of its world and reduced to a sha256 of its canonical form: each rank's
batches (step, dataset, bucket, sample ids, padded flags), the bucket statistics, and for
a remainder its fingerprint and the saved state's layout fields. The hashes in
``plan_goldens.json`` were recorded once; a change to any plan shows up here as the name
of the configuration whose batches moved.

What is hashed never includes an index's digest (nor a fingerprint derived from it): the
shards and their indexes are generated in ``tmp_path`` and the samples planned are what
must not move. ``WDS_PAD_WRITE_GOLDENS=1`` rewrites the file from the current code.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from wds_pad import Budget, Dataset, Topology, plan_epoch
from wds_pad.cli.app import main as cli_main
from wds_pad.core.local.locality import shard_map_of
from wds_pad.core.elastic.remainder import Segment, plan_remainder
from wds_pad.index.build import build_index
from wds_pad.index.codec import load_index
from wds_pad.index.record import Index
from wds_pad.state.cursor import Cursor
from wds_pad.stream.dataset import BucketedWebDataset
from wds_pad.cli.synth import make_image_shards

GOLDENS = Path(__file__).with_name("plan_goldens.json")
WORLD = 4


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _plan_form(plan: Any) -> dict[str, Any]:
    batches = [[b.step, b.index, b.dataset, repr(b.bucket), b.samples.tolist(), b.pad.tolist()] for b in plan]
    stats = [[s.dataset, repr(s.bucket), s.samples, s.repeats, s.length, s.padded_length, s.padded_copies,
              s.truncated, s.dropped, s.oversubscribed, s.steps] for s in plan.stats]
    return {"batches": batches, "stats": stats, "steps": plan.steps, "len": len(plan),
            "batch_size": plan.batch_size, "policy": plan.policy.value}


def _outcome(make: Callable[[], Any]) -> Any:
    """``make()``'s canonical form, or the error class it raised (its message may be reworded)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return make()
    except Exception as exc:  # noqa: BLE001 - a refused configuration is part of the golden
        return {"error": type(exc).__name__}


def _masked(fields: dict[str, Any]) -> dict[str, Any]:
    """A state's ``plan`` block without the index digests (they depend on the index file)."""
    out = dict(fields)
    out["datasets"] = [{k: v for k, v in d.items() if k != "index_digest"} for d in fields["datasets"]]
    return out


def _state_form(state: dict[str, Any]) -> dict[str, Any]:
    """A saved state without what depends on the index file (digests, the fingerprint)."""
    def strip(body: dict[str, Any]) -> dict[str, Any]:
        return {k: (_masked(v) if k == "plan" else v) for k, v in body.items()
                if k not in ("fingerprint", "per_rank")}
    return {**strip(state), "per_rank": {r: strip(v) for r, v in state.get("per_rank", {}).items()}}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Index]:
    out = {}
    for name, samples, shards, seed in (("a", 240, 12, 3), ("b", 96, 6, 4)):
        folder = tmp_path_factory.mktemp(f"golden-{name}")
        paths = make_image_shards(folder, samples=samples, shards=shards, seed=seed)
        built = build_index(paths, "aspect:width,height", output=str(folder / f"{name}.wdsidx"), cost="image:pixels")
        out[name] = load_index(built.path)
    return out


def _synthetic() -> Dataset:
    sizes = {"empty": 0, "one": 1, "three": 3, "seven": 7, "big": 61, "mid": 22}
    buckets, at = {}, 0
    for key, n in sizes.items():
        buckets[key] = np.arange(at, at + n, dtype=np.int64)
        at += n
    rng = np.random.default_rng(11)
    return Dataset(name="syn", buckets=buckets, repeats=1, cost=rng.integers(1, 50, at).astype(np.float64))


def _sources(ix: dict[str, Index], *, locality: str, costs: bool, two: bool, repeats: int = 0) -> list[Any]:
    chosen = [("a", 1.0), ("b", 2.5)] if two else [("a", 1.0)]
    out = []
    for name, weight in chosen:
        ds = ix[name].to_dataset(name=name, repeats=repeats, weight=weight, costs=costs)
        out.append(shard_map_of(ix[name], ds) if locality != "none" else ds)
    return out


def _budget(ix: dict[str, Index], model: str = "sum", factor: float = 3.0, max_samples: int | None = None) -> Budget:
    return Budget(factor * float(np.median(np.asarray(ix["a"].cost))), model, max_samples)


def _all_ranks(sources: list[Any], world: int, *, cp: int = 1, lws: int | None = None, epochs: tuple[int, ...] = (0,),
               **kw: Any) -> Any:
    out = []
    for epoch in epochs:
        for rank in range(world):
            topo = Topology(world_size=world, rank=rank, cp_size=cp, local_world_size=lws)
            out.append(_plan_form(plan_epoch(sources, topo, epoch=epoch, **kw)))
    return out


def _configs(ix: dict[str, Index]) -> Iterator[tuple[str, Callable[[], Any]]]:
    sizings = {"count4": lambda: 4, "count3": lambda: 3, "budget-sum": lambda: _budget(ix),
               "budget-max8": lambda: _budget(ix, "max", 4.0, 8)}
    for sname, sizing in sizings.items():
        costs = sname.startswith("budget")
        for policy in ("cyclic", "drop", "none", "auto"):
            for locality in ("none", "shard", "node"):
                name = f"{sname}/{policy}/{locality}"

                def make(sizing: Any = sizing, policy: str = policy, locality: str = locality, costs: bool = costs) -> Any:
                    src = _sources(ix, locality=locality, costs=costs, two=False)
                    return _all_ranks(src, WORLD, lws=2, epochs=(0, 1), seed=7, batch_size=sizing(), policy=policy,
                                      locality=locality, window=2)
                yield name, make
            # context parallelism, accumulation, two weighted datasets with repeats
            yield f"{sname}/{policy}/cp2", lambda sizing=sizing, policy=policy, costs=costs: _all_ranks(
                _sources(ix, locality="none", costs=costs, two=False), WORLD, cp=2, seed=9,
                batch_size=sizing(), policy=policy)
            for locality in ("none", "shard", "node"):
                yield f"{sname}/{policy}/{locality}/accum2", \
                    lambda sizing=sizing, policy=policy, locality=locality, costs=costs: _all_ranks(
                        _sources(ix, locality=locality, costs=costs, two=False), WORLD, lws=2, seed=5,
                        batch_size=sizing(), policy=policy, locality=locality, window=3, accumulation_steps=2)
                yield f"{sname}/{policy}/{locality}/weights-repeats", \
                    lambda sizing=sizing, policy=policy, locality=locality, costs=costs: _all_ranks(
                        _sources(ix, locality=locality, costs=costs, two=True, repeats=1), 3, lws=3,
                        epochs=(0, 2), seed=13, batch_size=sizing(), policy=policy, locality=locality, window=2)
        for locality in ("none", "shard"):
            yield f"{sname}/pad-to-rank/{locality}", lambda sizing=sizing, locality=locality, costs=costs: _all_ranks(
                _sources(ix, locality=locality, costs=costs, two=False), WORLD, seed=3, batch_size=sizing(),
                policy="cyclic", pad_to="rank", locality=locality, window=2)
            yield f"{sname}/steps/{locality}", lambda sizing=sizing, locality=locality, costs=costs: _all_ranks(
                _sources(ix, locality=locality, costs=costs, two=False), WORLD, seed=3, batch_size=sizing(),
                mode="steps", locality=locality, window=2, epochs=(0, 3))
        # a synthetic dataset: empty, tiny and uneven buckets, with and without oversubscription
        for over in (False, True):
            for policy in ("cyclic", "drop", "none", "auto"):
                syn_sizing = (lambda: Budget(60.0)) if costs else sizing
                yield f"{sname}/synthetic/{policy}/over{int(over)}", \
                    lambda s=syn_sizing, policy=policy, over=over: _all_ranks(
                        [_synthetic()], 8, cp=2, epochs=(0, 1), seed=21, batch_size=s(), policy=policy,
                        oversubscribe=over)
    # the elastic remainder, planned from segments
    for sname, sizing in (("count4", lambda: 4), ("budget-sum", lambda: _budget(ix))):
        costs = sname != "count4"
        for locality in ("none", "shard", "node"):
            for policy in ("cyclic", "none"):
                def remainder(sizing: Any = sizing, locality: str = locality, policy: str = policy,
                              costs: bool = costs) -> Any:
                    src = _sources(ix, locality=locality, costs=costs, two=True)
                    nr = 2 if locality == "node" else 0
                    kw = dict(seed=17, epoch=1, batch_size=sizing(), policy=policy, locality=locality, window=2)
                    if policy == "none":
                        first = Segment(dp_size=4, positions=(3, 1, 2, 0), node_ranks=nr)
                    else:
                        first = Segment(dp_size=4, steps=2, node_ranks=nr)
                    out = []
                    for segs, world in (([first], 3), ([first, Segment(dp_size=3, steps=1, node_ranks=3 if nr else 0)], 2)):
                        for rank in range(world):
                            lws = world if locality == "node" else None
                            rem = plan_remainder(src, Topology(world, rank, local_world_size=lws), segs, **kw)
                            out.append({"plan": _plan_form(rem.plan), "fingerprint": rem.fingerprint})
                    return out
                yield f"remainder/{sname}/{locality}/{policy}", remainder


def _elastic_configs(ix: dict[str, Index]) -> Iterator[tuple[str, Callable[[], Any]]]:
    """States saved on one world size, resumed on another, and again on a third."""
    for sname in ("count4", "budget-sum"):
        for locality in ("none", "shard", "node"):
            def run(sname: str = sname, locality: str = locality) -> Any:
                size = 4 if sname == "count4" else _budget(ix)

                def ds(world: int, rank: int) -> BucketedWebDataset:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        return BucketedWebDataset(
                            ix["a"], batch_size=size, topology=Topology(world, rank, local_world_size=world),
                            seed=5, check_agreement=False, locality=locality, window=2, pad="cyclic")
                out: list[Any] = []
                states = []
                for r in range(4):
                    d = ds(4, r)
                    d.seek(Cursor(0, 2))
                    states.append(d.state_dict())
                    out.append(_state_form(d.state_dict()))
                states3 = []
                for r in range(3):
                    d = ds(3, r)
                    d.load_state_dict(states[r * 4 // 3], allow_elastic=True)
                    out.append(_plan_form(d.cursor.view.plan))
                    d.seek(d.cursor.at(0, 1))
                    states3.append(d.state_dict())
                    out.append(_state_form(states3[-1]))
                for r in range(2):
                    d = ds(2, r)
                    d.load_state_dict(states3[r * 3 // 2], allow_elastic=True)
                    out.append(_plan_form(d.cursor.view.plan))
                    out.append(_state_form(d.state_dict()))
                return out
            yield f"elastic-state/{sname}/{locality}", run


def _cli_configs(ix: dict[str, Index]) -> Iterator[tuple[str, Callable[[], Any]]]:
    a, b = ix["a"].path, ix["b"].path
    limit = str(3.0 * float(np.median(np.asarray(ix["a"].cost))))
    runs = {
        "cli/count/cyclic": [a, "--batch-size", "4", "--pad", "cyclic"],
        "cli/count/none/cp2": [a, "--batch-size", "3", "--pad", "none", "--cp-size", "2"],
        "cli/count/shard/weights": [a, b, "--batch-size", "4", "--locality", "shard", "--window", "2",
                                    "--weights", "1,3", "--repeats", "1"],
        "cli/count/node/accum": [a, "--batch-size", "2", "--locality", "node", "--local-world-size", "2",
                                 "--accumulation-steps", "2"],
        "cli/count/steps": [a, "--batch-size", "4", "--mode", "steps", "--steps", "40"],
        "cli/buckets/over": ["--buckets", "a=3,b=0,c=17,d=40", "--batch-size", "4", "--oversubscribe"],
        "cli/budget/sum": [a, "--budget", limit, "--pad", "drop"],
        "cli/budget/max/shard": [a, "--budget", limit, "--budget-model", "max", "--max-samples", "6",
                                 "--locality", "shard", "--window", "2"],
        "cli/budget/accum/node": [a, b, "--budget", limit, "--locality", "node", "--local-world-size", "2",
                                  "--accumulation-steps", "2"],
    }
    for name, argv in runs.items():
        def run(argv: list[str] = argv) -> Any:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rc = cli_main(["plan", *argv, "--world-size", "4", "--rank", "all", "--seed", "19", "--json"])
            records = [json.loads(line) for line in buf.getvalue().splitlines()]
            for r in records:
                r.pop("seeds", None)  # recorded before rows carried seeds: pinned in tests/core/test_sampleseed.py
                if "urls" in r:
                    r["urls"] = [os.path.basename(u) for u in r["urls"]]
            return {"rc": rc, "records": records}
        yield name, run


def _compute(ix: dict[str, Index]) -> dict[str, str]:
    out = {}
    for gen in (_configs, _elastic_configs, _cli_configs):
        for name, make in gen(ix):
            assert name not in out, name
            out[name] = _digest(_outcome(make))
    return out


def test_plans_are_byte_identical_to_the_recorded_goldens(inputs: dict[str, Index]) -> None:
    got = _compute(inputs)
    if os.environ.get("WDS_PAD_WRITE_GOLDENS"):
        GOLDENS.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDENS.read_text())
    assert sorted(got) == sorted(want), "the matrix of configurations changed"
    moved = [name for name in sorted(want) if got[name] != want[name]]
    assert not moved, f"{len(moved)} configuration(s) plan differently: {moved[:20]}"
    errors = sum(1 for name in got if got[name] == _digest({"error": "ConfigError"}))
    assert errors < len(got) // 4, "most configurations must plan, not be refused"
