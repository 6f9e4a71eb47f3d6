"""``wds-pad simulate`` predicts the GETs a job makes: counted at a loopback server.

Real jobs (``tools/nodejob.py``: gloo on loopback, DataLoader workers, every byte checked
against the shards on disk) of 4 ranks read 16 shards over HTTP through the FaultProxy,
which counts the requests; a node is 2 or 4 processes sharing one cache folder. Each
epoch waits for the test before the next one starts, so the GETs of each of epochs 0-2
are counted apart, and compared with ``wds-pad simulate --json`` for the same options.
"""

from __future__ import annotations

import io
import json
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

import nodejob  # tools/ is on sys.path (tests/conftest.py)
from data_helpers import serve_dir
from wds_pad.cli import main
from wds_pad.cli.synth import make_blob_shards
from wds_pad.index.build import build_index

pytest_plugins = ["conftest_servers"]
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

NPROCS, SHARDS, EPOCHS, BLOCK = 4, 16, 3, 16 * 1024
SEED, WINDOW = 5, 2


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sim-shards")
    make_blob_shards(out, samples=320, sample_bytes=4000, shards=SHARDS, seed=3)
    return out


@pytest.fixture
def served(nginx_server: Any, shard_dir: Path, fault_proxy: Any, tmp_path: Path) -> tuple[Any, str]:
    base = serve_dir(nginx_server, shard_dir, "sim-train")
    proxy = fault_proxy(nginx_server)
    url = base.replace(f"{nginx_server.host}:{nginx_server.port}", f"{proxy.host}:{proxy.port}")
    names = sorted(p.name for p in shard_dir.glob("*.tar"))
    build_index([f"{url}/{n}" for n in names], "aspect:width,height", output=str(tmp_path / "ix.wdsidx"),
                cost="json:width")
    return proxy, str(tmp_path / "ix.wdsidx")


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
        served: tuple[Any, str], shard_dir: Path, tmp_path: Path, locality: str, sizing: str,
        per_node: int) -> None:
    """Epochs 0-2, one node of 4 processes or two of 2, each node its own cache folder:
    the GETs the proxy counts per epoch are simulate's within 2 %; every byte right."""
    proxy, index = served
    size = ["--batch-size", "4"] if sizing == "batch" else ["--budget", "2048"]
    sim = predicted(index, locality, size, per_node)
    kw = {"batch_size": 4, "seed": SEED, "window": WINDOW, "cp": 1, "locality": locality,
          "local_world_size": per_node, **({"budget": 2048.0} if sizing == "budget" else {})}
    expected = nodejob.expected_batches(index, NPROCS, EPOCHS, **kw)
    cache, state = tmp_path / "cache", tmp_path / "state"
    state.mkdir()
    args = ["--index", index, "--reference", str(shard_dir), "--cache-dir", str(cache), "--state", str(state),
            "--epochs", str(EPOCHS), "--workers", "2", "--cp", "1", "--batch-size", "4", "--seed", str(SEED),
            "--window", str(WINDOW), "--block-bytes", str(BLOCK), "--pause", "--locality", locality,
            "--local-world-size", str(per_node)] + (["--budget", "2048"] if sizing == "budget" else [])
    proxy.reset_counters()
    job = nodejob.Job(args, NPROCS, run="sim").start()
    seen: list[int] = []
    for e in range(EPOCHS):
        while not (state / f"done{e}").exists():
            assert all(p.poll() is None for p in job.procs), job.outputs()
            time.sleep(0.02)
        seen.append(proxy.requests_seen - sum(seen))
        (state / f"go{e}").write_text("")
    assert job.wait() == [0] * NPROCS, job.outputs()
    counts = nodejob.check_logs(state, NPROCS, expected)
    assert counts["wrong"] == counts["missing"] == counts["repeated"] == counts["unplanned"] == 0, counts
    print(f"{locality} {sizing} {NPROCS // per_node} node(s): counted {seen}, simulated {sim['gets_per_epoch']}")
    for got, want in zip(seen, sim["gets_per_epoch"]):
        assert abs(got - want) <= 0.02 * max(want, got), (seen, sim["gets_per_epoch"])


@pytest.mark.parametrize("locality, per_node", [("node", 2), ("shard", 4)])
def test_a_new_job_on_the_warm_cache_folders_makes_the_gets_simulate_warm_says(
        served: tuple[Any, str], shard_dir: Path, tmp_path: Path, locality: str, per_node: int) -> None:
    """A job of one epoch, then another on the cache folders it left: the second job's
    GETs (the HEADs of its once-per-job check of the copies it found set apart) are
    ``simulate --warm``'s, and the first one's are the cold simulation's."""
    proxy, index = served
    cache = tmp_path / "cache"
    args = ["--index", index, "--reference", str(shard_dir), "--cache-dir", str(cache), "--epochs", "1",
            "--workers", "2", "--cp", "1", "--batch-size", "4", "--seed", str(SEED), "--window", str(WINDOW),
            "--block-bytes", str(BLOCK), "--locality", locality, "--local-world-size", str(per_node)]
    gets = []
    for run in ("cold", "warm"):
        state = tmp_path / run
        state.mkdir()
        proxy.reset_counters()
        job = nodejob.Job(args + ["--state", str(state)], NPROCS, run=run).start()
        assert job.wait() == [0] * NPROCS, job.outputs()
        gets.append(proxy.requests_seen - sum(r.method == "HEAD" for r in proxy.requests))
    cold = predicted(index, locality, ["--batch-size", "4"], per_node, epochs=1)["gets_per_epoch"][0]
    warm = predicted(index, locality, ["--batch-size", "4"], per_node, "--warm", epochs=1)["gets_per_epoch"][0]
    print(f"{locality}, {NPROCS // per_node} node(s): counted cold {gets[0]}, warm {gets[1]}; simulated {cold}, {warm}")
    assert abs(gets[0] - cold) <= 0.02 * cold
    assert abs(gets[1] - warm) <= max(0.02 * warm, 0)
