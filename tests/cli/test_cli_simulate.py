"""``wds-pad simulate``: the options of ``plan``, the JSON it prints, its counts against the
node figures of ``plan --summary``, its usage errors; the time model itself:
``tests/core/test_simtime.py``.

The GETs it predicts against those a real job makes at a loopback server:
``tests/io/test_simulate_jobs.py``.
"""

from __future__ import annotations

import argparse
import io
import json
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from wds_pad import Topology, load_index, plan_epoch
from wds_pad.cli import main
from wds_pad.cli.app import build_parser
from wds_pad.cli.synth import make_blob_shards
from wds_pad.cli.readfigures import node_figures
from wds_pad.core.local.locality import shard_map_of
from wds_pad.index.build import build_index

BLOCK = 16 * 1024


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("sim")
    make_blob_shards(out / "shards", samples=320, sample_bytes=4000, shards=16, seed=3)
    build_index(sorted(str(p) for p in (out / "shards").glob("*.tar")), "aspect:width,height",
                output=str(out / "ix.wdsidx"), cost="json:width")
    return str(out / "ix.wdsidx")


def run(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["simulate", *args])
    return code, out.getvalue()


def _options(name: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {o for a in sub.choices[name]._actions for o in a.option_strings} | \
        {a.dest for a in sub.choices[name]._actions if not a.option_strings}


def test_simulate_takes_every_planning_option_of_plan_under_the_same_name() -> None:
    plan_only = {"--rank", "--steps", "--json", "--summary"}
    assert _options("plan") - plan_only <= _options("simulate")


@pytest.mark.parametrize("locality", ["none", "shard", "node"])
@pytest.mark.parametrize("sizing", [["--batch-size", "4"], ["--budget", "2048"]])
def test_the_first_epoch_of_every_node_costs_what_plan_summary_says_and_node_locality_nothing_after(
        index: str, locality: str, sizing: list[str]) -> None:
    code, out = run(index, "--world-size", "4", "--local-world-size", "2", *sizing, "--seed", "5",
                    "--window", "2", "--locality", locality, "--epochs", "3", "--block-bytes", str(BLOCK),
                    "--price-per-get", "0.001", "--price-per-gb", "2", "--json")
    assert code == 0
    sim = json.loads(out)
    ix = load_index(index)
    ds = ix.to_dataset(costs=sizing[0] == "--budget")
    ds = shard_map_of(ix, ds) if locality != "none" else ds
    size: Any = 4
    if sizing[0] == "--budget":
        from wds_pad import Budget
        size = Budget(2048.0)
    sizes = [max(s.size, 0) for s in ix.shards]
    for node in range(2):
        plans = [plan_epoch([ds], Topology(4, r, local_world_size=2), seed=5, batch_size=size, window=2,
                            locality=locality, warn=False) for r in (2 * node, 2 * node + 1)]
        f = node_figures(plans, [ix.shard], [ix.length], [sizes], BLOCK)
        assert sim["nodes"][node]["gets"][0] == f.gets
    assert sim["gets_per_epoch"] == [sum(n["gets"][e] for n in sim["nodes"]) for e in range(3)]
    assert sim["cost_usd"] == pytest.approx(0.001 * sum(sim["gets_per_epoch"]) + 2 * sum(sim["bytes_per_epoch"]) / 1e9)
    if locality == "node":
        assert sim["gets_per_epoch"][1:] == [0, 0]
        assert sim["peak_cache_bytes"] > 0
    if locality == "none":
        assert sim["peak_cache_bytes"] == 0 and len(set(sim["gets_per_epoch"])) == 1


def test_a_warm_restart_of_node_locality_fetches_nothing_and_waits_for_nothing(index: str) -> None:
    code, out = run(index, "--world-size", "4", "--local-world-size", "2", "--batch-size", "4", "--seed", "5",
                    "--locality", "node", "--epochs", "2", "--warm", "--start-ms", "0", "--json")
    sim = json.loads(out)
    assert code == 0 and sim["gets_per_epoch"] == [0, 0] and sim["first_batch_s"] == 0.0
    assert sim["stall_share"] == 0.0
    # the stream's start is all the first batch waits for
    code, out = run(index, "--world-size", "4", "--local-world-size", "2", "--batch-size", "4", "--seed", "5",
                    "--locality", "node", "--epochs", "2", "--warm", "--start-ms", "300", "--json")
    assert json.loads(out)["first_batch_s"] == pytest.approx(0.3)


def test_the_table_names_every_epoch_and_node(index: str) -> None:
    code, out = run(index, "--world-size", "4", "--local-world-size", "2", "--batch-size", "4", "--seed", "5",
                    "--locality", "shard", "--epochs", "2")
    assert code == 0
    assert "node 0 GETs" in out and "node 1 GETs" in out and "first batch after" in out
    assert len([line for line in out.splitlines() if line.strip().startswith(("0 ", "1 "))]) == 2


@pytest.mark.parametrize("args, words", [
    (["--world-size", "4", "--batch-size", "4", "--seed", "1"], "give INDEX file(s)"),
    (["IX", "--world-size", "4", "--batch-size", "4", "--seed", "1", "--locality", "node"], "--local-world-size"),
    (["IX", "--world-size", "4", "--batch-size", "4", "--seed", "1", "--bandwidth-mbps", "0"], "--bandwidth-mbps"),
])
def test_bad_options_are_one_usage_error_in_flags(index: str, args: list[str], words: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", *[index if a == "IX" else a for a in args]])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("wds-pad simulate: error:") and words in err


def test_a_negative_start_skew_is_a_usage_error(index: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", index, "--world-size", "4", "--batch-size", "4", "--seed", "1", "--start-skew-ms", "-5"])
    assert exc.value.code == 2 and "--start-skew-ms" in capsys.readouterr().err
