"""Real multi-process runs over torch.distributed (gloo on 127.0.0.1).

Each scenario is one launch of N processes (tests/dist_helpers.py): every rank joins the
process group, forgets RANK/WORLD_SIZE, and streams with the real seed broadcast
(``seed=None``), ``Topology.detect()`` from the group or ``Topology.from_mesh`` on a
DeviceMesh. The parent checks every rank's stream against the invariants of the design
(equal batch counts, same bucket at the same step, identical batches for CP peers, the
exact padded plan over all DP ranks) and against the pure planner with the broadcast
seed. The agreement scenario checks that a rank with another index, seed or batch size
makes every rank raise the same clear error promptly, and that ``check_agreement=False``
makes no collective at all.
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Any, Callable

import pytest
from data_helpers import plan_keys
from dist_helpers import Job, JobFailed, bucket_keys_of, check_epoch, run_scenarios, session_dataset

from wds_pad import Topology, plan_epoch
from wds_pad.index.codec import load_index

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

# One launch per world size runs all of that size's scenarios (each process imports torch).
WORLDS: dict[int, list[dict[str, Any]]] = {
    2: [{"scenario": "stream", "cp": 1}],
    4: [{"scenario": "stream", "cp": 2, "num_workers": 2}, {"scenario": "stream", "mesh": [2, 2]},
        {"scenario": "agreement", "bad_rank": 2}],
    8: [{"scenario": "stream", "mesh": [4, 2], "repeats": 1}],
}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return session_dataset(tmp_path_factory)


@pytest.fixture(scope="module")
def bucket_keys(data: dict[str, str]) -> dict[str, list[str]]:
    return bucket_keys_of(data["index"])


@pytest.fixture(scope="module")
def launched(data: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Any]:
    """world -> results[scenario][rank] of that world's one launch (run on first use)."""
    cache: dict[int, Any] = {}

    def get(world: int) -> Any:
        if world not in cache:
            common = {"index": data["index"], "other_index": data["other_index"], "batch_size": 2, "epochs": 2}
            try:
                cache[world] = run_scenarios(world, tmp_path_factory.mktemp(f"world{world}"),
                                             [{**common, **s} for s in WORLDS[world]])
            except AssertionError as exc:  # fail every test of this world, without relaunching
                cache[world] = exc
        if isinstance(cache[world], AssertionError):
            raise cache[world]
        return cache[world]

    return get


@pytest.mark.parametrize(
    ("world", "which", "cp"),
    [
        pytest.param(2, 0, 1, id="world2-detect-cp1"),
        pytest.param(4, 0, 2, id="world4-detect-cp2-2workers"),
        pytest.param(4, 1, 2, id="world4-mesh-dp2xcp2"),
        pytest.param(8, 0, 2, id="world8-mesh-dp4xcp2-repeats1"),
    ],
)
def test_every_rank_streams_its_share_of_the_padded_plan(
    world: int, which: int, cp: int, launched: Callable[[int], Any], data: dict[str, str],
    bucket_keys: dict[str, list[str]],
) -> None:
    params = WORLDS[world][which]
    results = launched(world)[which]
    repeats = params.get("repeats", 0)

    seeds = {r["seed"] for r in results}
    assert len(seeds) == 1, f"ranks drew different seeds: {seeds}"  # the broadcast worked
    seed = seeds.pop()
    assert 0 <= seed < 2**63
    topologies = {rank: r["topology"] for rank, r in enumerate(results)}
    for rank, topo in topologies.items():  # consecutive CP peers, for detect and the (dp, cp) mesh
        assert topo == Topology(world_size=world, rank=rank, cp_size=cp).to_dict()

    index = load_index(data["index"])
    dataset = index.to_dataset(repeats=repeats)
    orders = []
    for epoch in range(2):
        streams = {rank: [b for b in r["batches"] if b["epoch"] == epoch] for rank, r in enumerate(results)}
        assert all(streams.values()), f"epoch {epoch}: some rank streamed nothing"
        check_epoch(streams, topologies, bucket_keys, batch_size=2, repeats=repeats, epoch=epoch)
        for rank, stream in streams.items():  # exactly the pure planner's plan for the broadcast seed
            plan = plan_epoch(dataset, Topology(world_size=world, rank=rank, cp_size=cp), seed=seed,
                              epoch=epoch, batch_size=2, oversubscribe=True, warn=False)
            assert [b["keys"] for b in stream] == plan_keys(plan, index)
        orders.append([k for b in streams[0] for k in b["keys"]])
    assert orders[0] != orders[1], "epoch 1 was not reshuffled"


def test_ranks_that_disagree_all_raise_the_same_clear_error(launched: Callable[[int], Any]) -> None:
    bad = WORLDS[4][2]["bad_rank"]
    results = launched(4)[2]
    for case, field in (("index", "datasets[0].index_digest (rank 0: "), ("seed", "seed_hash (rank 0: "),
                        ("batch_size", "batch_size (rank 0: 2, rank 2: 3)")):
        outcomes = [r[case] for r in results]
        assert [o["error"] for o in outcomes] == ["StateMismatchError"] * 4, (case, outcomes)
        message = outcomes[0]["message"]
        assert all(o["message"] == message for o in outcomes), f"{case}: ranks raised different messages"
        assert f"rank {bad} differs from rank 0" in message and field in message, (case, message)
        assert "rank 1 differs" not in message and "rank 3 differs" not in message, (case, message)
        assert "check_agreement=False" in message  # says how to opt out
        # one all_gather, no more: the error is prompt by construction (a rank left waiting in
        # a second collective would end in gloo's timeout error, not StateMismatchError)
        assert all(o["collectives"] == 1 for o in outcomes), (case, outcomes)

    # check_agreement=False: no collective, so only ranks 0 and 2 iterating does not hang
    disabled = [r["disabled"] for r in results]
    assert [d["collectives"] for d in disabled] == [0, 0, 0, 0]
    assert disabled[0]["batches"] > 0 and disabled[bad]["batches"] > 0
    assert disabled[1]["batches"] == disabled[3]["batches"] == 0


def _planned_streams(index_path: str, world: int, cp: int, batch_size: int) -> tuple[dict, dict]:
    index = load_index(index_path)
    streams, topologies = {}, {}
    for rank in range(world):
        topo = Topology(world_size=world, rank=rank, cp_size=cp)
        plan = plan_epoch(index, topo, seed=3, batch_size=batch_size, oversubscribe=True, warn=False)
        topologies[rank] = topo.to_dict()
        streams[rank] = [{"step": b.step, "bucket": b.bucket, "keys": [index.key(int(i)) for i in b.samples],
                          "pad": b.pad.tolist()} for b in plan]
    return streams, topologies


def test_the_invariant_check_catches_each_violation(data: dict[str, str], bucket_keys: dict[str, list[str]]) -> None:
    """The parent-side check is what the multi-process tests rest on: it must not be lenient."""
    streams, topologies = _planned_streams(data["index"], 4, 2, 2)
    check_epoch(streams, topologies, bucket_keys, batch_size=2)  # the plan itself passes

    def broken(edit: Callable[[dict], None]) -> dict:
        copy = {r: [dict(b, keys=list(b["keys"]), pad=list(b["pad"])) for b in s] for r, s in streams.items()}
        edit(copy)
        return copy

    other_bucket = next(b for b in bucket_keys if b != streams[0][0]["bucket"])
    violations = {
        "unequal batch counts": lambda s: s[3].pop(),
        "other (step, bucket)": lambda s: [s[r][0].update(bucket=other_bucket) for r in (2, 3)],
        "CP peers": lambda s: s[1][0]["keys"].reverse(),
        "not every sample exactly": lambda s: [s[r][0]["keys"].__setitem__(0, s[0][0]["keys"][1]) for r in (0, 1)],
        "pad flag": lambda s: [s[r][-1]["pad"].__setitem__(0, not s[r][-1]["pad"][0]) for r in (0, 1)],
    }
    for expected, edit in violations.items():
        with pytest.raises(AssertionError, match=re.escape(expected)):
            check_epoch(broken(edit), topologies, bucket_keys, batch_size=2)


_SLEEPER = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} port {os.environ['MASTER_PORT']} child {child.pid}",
      flush=True)
if os.environ["RANK"] == os.environ.get("FAIL_RANK"):
    sys.exit(3)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (killed, not yet reaped by init) is gone too
        return f.read().split(") ")[1][0] != "Z"


def _children(results: Any) -> list[int]:
    return [int(r.stdout.split("child ")[1]) for r in results]


def test_the_launcher_never_hangs() -> None:
    """A hung job is killed at its timeout, workers included, and fails with every rank's output."""
    job = Job([sys.executable, "-c", _SLEEPER], 2, timeout=4).start()
    with pytest.raises(JobFailed, match=r"timed out after 4 s(.|\n)*rank 0 of 2 port \d+(.|\n)*rank 1 of 2"):
        try:
            job.wait()
        finally:
            results = job.collect()
            job.close()
    # "killed at its timeout" is the JobFailed above ("timed out after 4 s"); a launcher that
    # then hung would be stopped by this module's pytest timeout (no wall-clock bound here)
    time.sleep(0.2)
    assert not any(_alive(pid) for pid in _children(results)), "a grandchild outlived the kill"

    # fail fast: once rank 1 exits with an error, rank 0 is killed after the grace period
    # (had rank 0 lived to the 60 s timeout, wait() would raise JobFailed "timed out")
    with Job([sys.executable, "-c", _SLEEPER], 2, timeout=60, grace=1, env={"FAIL_RANK": "1"}) as job:
        results = job.wait()
    # rank 1 failed with its own code; rank 0 was killed by the launcher (None when the
    # launcher recorded the kill, -SIGKILL when the process was reaped first)
    assert results[1].returncode == 3
    assert results[0].returncode is None or results[0].returncode < 0, results[0].returncode
    time.sleep(0.2)
    assert not any(_alive(pid) for pid in _children(results))
