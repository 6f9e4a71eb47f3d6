"""The resized gloo jobs of test_elastic_gloo.py and test_pack_elastic_gloo.py, run once
per session: each world size is one launch that runs every configuration's job of that
size in turn (one process group; torch is imported once per rank, not once per job).

A configuration is an elastic run: a job of 4 ranks saves its states mid-epoch and is
killed, the next job resumes them on 3 ranks (and is killed after its own save, or runs
to the epoch's end), and so on. In a launch, the configurations that run to the end go
first, then those that save; each of those but the last leaves its epoch right after its
save, and the job is SIGKILLed while the last trains on. What counts as trained is each
rank's log up to its saved position, as the tests read it.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dist_helpers import Job, format_outputs, launch, session_dataset

HELPERS = Path(__file__).resolve().parents[1] / "dist_helpers.py"
ENV = {"PYTHONPATH": str(HELPERS.parents[1])}  # the ranks import this checkout's wds_pad


@dataclass
class Resized:
    """One configuration's run: its jobs ``(world, extra params)`` in order, their folders
    (``job{j}``: the ranks' logs, ``state{j}``: the states saved) under ``root``."""

    common: dict[str, Any]
    jobs: list[tuple[int, dict[str, Any]]]
    root: Path
    info: dict[str, Any]

    def logs(self, j: int) -> list[list[dict[str, Any]]]:
        world = self.jobs[j][0]
        return [[json.loads(line) for line in (self.root / f"job{j}" / f"rank{r}.jsonl").read_text().splitlines()]
                for r in range(world)]

    def params(self, j: int) -> dict[str, Any]:
        params = {"scenario": "elastic_phase", **self.common, **self.jobs[j][1],
                  "state_dir": str(self.root / f"state{j}"), "log": str(self.root / f"job{j}")}
        if j:
            params["resume_from"] = str(self.root / f"state{j - 1}")
        return params


def _launch(world: int, out: Path, scenarios: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True)
    for s in scenarios:
        Path(s["log"]).mkdir(parents=True)
    run = [s for s in scenarios if "save_at" not in s]
    saving = [s for s in scenarios if "save_at" in s]
    saving = [{**s, "then_next": True} for s in saving[:-1]] + saving[-1:]
    argv = [sys.executable, str(HELPERS), str(out), json.dumps(run + saving)]
    if not saving:
        launch(argv, world, timeout=300, env=ENV)
        return
    last = Path(saving[-1]["log"])
    with Job(argv, world, timeout=300, env=ENV) as job:
        deadline = time.monotonic() + 300
        while not all((last / f"saved{r}").exists() for r in range(world)):
            assert job.running() and time.monotonic() < deadline, format_outputs(job.collect())
            time.sleep(0.1)
        job.kill(signal.SIGKILL)


@pytest.fixture(scope="session")
def resized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Resized]:
    """The runs by name: ``none`` and ``shard`` (count sizing, that locality), ``budget``
    (a budget of payload bytes, 2 micro-batches per step) and ``pack`` (two packs of
    ``seq_len`` per batch, 2 micro-batches per step)."""
    from wds_pad import build_index, load_index

    data = session_dataset(tmp_path_factory)
    root = tmp_path_factory.mktemp("resized")
    index = str(root / "costed.wdsidx")
    build_index(list(load_index(data["index"]).urls), "aspect:width,height", output=index, cost="bytes")
    ix = load_index(index)
    cost = {ix.key(i): float(ix.cost[i]) for i in range(len(ix))}
    median = sorted(cost.values())[len(cost) // 2]
    budget, seq_len = 4 * float(median), int(3 * median)
    counted = [(4, {"save_at": 7}), (3, {"save_at": 5, "old_world": 4}), (2, {"old_world": 3})]
    runs = {
        locality: Resized({"index": data["index"], "batch_size": 2, "seed": 7, "locality": locality}, counted,
                          root / locality, {"index": data["index"]})
        for locality in ("none", "shard")}
    runs["budget"] = Resized({"index": index, "batch_size": 0, "budget": budget, "seed": 7, "accumulation_steps": 2},
                             [(4, {"save_at": 6}), (3, {"save_at": 4, "old_world": 4}), (2, {"old_world": 3})],
                             root / "budget", {"index": index, "cost": cost, "budget": budget})
    runs["pack"] = Resized({"index": index, "batch_size": 0, "seed": 7, "accumulation_steps": 2,
                            "pack": {"seq_len": seq_len, "packs": 2, "oversize": "alone"}},
                           [(4, {"save_at": 4}), (3, {"old_world": 4})],
                           root / "pack", {"index": index, "cost": cost, "seq_len": seq_len})
    for j, world in enumerate((4, 3, 2)):
        scenarios = [run.params(j) for run in runs.values() if j < len(run.jobs)]
        assert all(run.jobs[j][0] == world for run in runs.values() if j < len(run.jobs))
        _launch(world, root / f"launch{j}", scenarios)
    return runs
