"""``wds-pad simulate`` predicts the GETs a job makes: counted at a loopback server.

Real jobs (``tools/nodejob.py``: gloo on loopback, DataLoader workers, every byte checked
against the shards on disk) of 4 ranks read 16 shards over HTTP through the FaultProxy,
which counts the requests; a node is 2 or 4 processes sharing one cache folder. Each
epoch waits for the launcher before the next one starts, so the GETs of each of epochs
0-2 are counted apart, and compared with ``wds-pad simulate --json`` for the same options.
The jobs run once per session, one after the other in one launch (``job_runs``,
``tests/nodejob_runs.py``); each test checks the runs of its options.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from typing import Any

import pytest

import nodejob  # tools/ is on sys.path (tests/conftest.py)
from nodejob_runs import BLOCK, BUDGET, EPOCHS, NPROCS, SEED, WINDOW, epoch_run
from wds_pad.cli import main

pytest_plugins = ["conftest_servers"]
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def predicted(index: str, locality: str, sizing: list[str], per_node: int, *extra: str,
              epochs: int = EPOCHS) -> dict[str, Any]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["simulate", index, "--world-size", str(NPROCS), "--local-world-size", str(per_node),
                     *sizing, "--seed", str(SEED), "--window", str(WINDOW), "--locality", locality,
                     "--epochs", str(epochs), "--block-bytes", str(BLOCK), "--json", *extra])
    assert code == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("locality", ["none", "shard", "node"])
@pytest.mark.parametrize("sizing", ["batch", "budget"])
@pytest.mark.parametrize("per_node", [4, 2])
def test_simulated_gets_per_epoch_are_the_gets_counted_at_the_server(
        job_runs: Any, locality: str, sizing: str, per_node: int) -> None:
    """Epochs 0-2, one node of 4 processes or two of 2, each node its own cache folder:
    the GETs the proxy counts per epoch are simulate's within 2 %; every byte right."""
    run, index = job_runs.runs[epoch_run(locality, sizing, per_node)], job_runs.index
    size = ["--batch-size", "4"] if sizing == "batch" else ["--budget", str(int(BUDGET))]
    sim = predicted(index, locality, size, per_node)
    kw = {"batch_size": 4, "seed": SEED, "window": WINDOW, "cp": 1, "locality": locality,
          "local_world_size": per_node, **({"budget": BUDGET} if sizing == "budget" else {})}
    expected = nodejob.expected_batches(index, NPROCS, EPOCHS, **kw)
    counts = nodejob.check_logs(run.state, NPROCS, expected)
    assert counts["wrong"] == counts["missing"] == counts["repeated"] == counts["unplanned"] == 0, counts
    seen = run.requests
    assert len(seen) == EPOCHS
    print(f"{locality} {sizing} {NPROCS // per_node} node(s): counted {seen}, simulated {sim['gets_per_epoch']}")
    for got, want in zip(seen, sim["gets_per_epoch"]):
        assert abs(got - want) <= 0.02 * max(want, got), (seen, sim["gets_per_epoch"])


@pytest.mark.parametrize("locality, per_node", [("node", 2), ("shard", 4)])
def test_a_new_job_on_the_warm_cache_folders_makes_the_gets_simulate_warm_says(
        job_runs: Any, locality: str, per_node: int) -> None:
    """A job of one epoch, then another on the cache folders it left: the second job's
    GETs (the HEADs of its once-per-job check of the copies it found set apart) are
    ``simulate --warm``'s, and the first one's are the cold simulation's."""
    cold_run, warm_run = (job_runs.runs[f"{kind}-{locality}-{per_node}"] for kind in ("cold", "warm"))
    assert cold_run.arg("--cache-dir") == warm_run.arg("--cache-dir")
    gets = [sum(run.requests) - sum(run.heads) for run in (cold_run, warm_run)]
    cold = predicted(job_runs.index, locality, ["--batch-size", "4"], per_node, epochs=1)["gets_per_epoch"][0]
    warm = predicted(job_runs.index, locality, ["--batch-size", "4"], per_node, "--warm",
                     epochs=1)["gets_per_epoch"][0]
    print(f"{locality}, {NPROCS // per_node} node(s): counted cold {gets[0]}, warm {gets[1]}; simulated {cold}, {warm}")
    assert warm_run.heads[0] > 0  # another job: it checked the copies it found
    assert abs(gets[0] - cold) <= 0.02 * cold
    assert abs(gets[1] - warm) <= max(0.02 * warm, 0)
