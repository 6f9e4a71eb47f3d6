"""Fixtures of the io tests: local and memory:// shards of random bytes, and the real
jobs over loopback HTTP that several test modules check (run once per session)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Two local files and two memory:// files, by URL in several spellings."""
    root = tmp_path_factory.mktemp("shards")
    out: dict[str, bytes] = {}
    for i, size in enumerate((70_000, 3_000)):
        data = os.urandom(size)
        (root / f"s{i}.tar").write_bytes(data)
        out[str(root / f"s{i}.tar")] = data
        out[f"file://{root}/s{i}.tar"] = data
        fsspec.filesystem("memory").pipe(f"/wdsread/s{i}.tar", data)
        out[f"memory://wdsread/s{i}.tar"] = data
    return out


@pytest.fixture(scope="module")
def local_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("local")
    out = {}
    for i in range(5):
        data = os.urandom(40_000 + 1_000 * i)
        (root / f"f{i}.bin").write_bytes(data)
        out[str(root / f"f{i}.bin")] = data
    return out


@pytest.fixture(scope="session")
def job_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 shards of 20 samples of 4000 bytes, the real jobs' (tests/nodejob_runs.py)."""
    from wds_pad.cli.synth import make_blob_shards

    out = tmp_path_factory.mktemp("job-shards")
    make_blob_shards(out, samples=320, sample_bytes=4000, shards=16, seed=3)
    return out


@dataclass
class JobRuns:
    """The runs of :func:`nodejob_runs.io_runs`, done: their index (over the proxy, costs
    ``json:width``), the shards on local disk, and each run by name."""

    index: str
    shards: Path
    runs: dict[str, Any]


@pytest.fixture(scope="session")
def job_runs(nginx_server: Any, job_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> JobRuns:
    """Every run of :func:`nodejob_runs.io_runs` in one launch, reading the shards from
    ``nginx_server`` through a FaultProxy that counts each epoch's requests."""
    import nodejob_runs
    from data_helpers import serve_dir
    from faultproxy import FaultProxy
    from wds_pad.index.build import build_index

    root = tmp_path_factory.mktemp("job-runs")
    base = serve_dir(nginx_server, job_shards, "job-runs")
    with FaultProxy(nginx_server.host, nginx_server.port) as proxy:
        url = base.replace(f"{nginx_server.host}:{nginx_server.port}", f"{proxy.host}:{proxy.port}")
        index = str(root / "ix.wdsidx")
        build_index([f"{url}/{p.name}" for p in sorted(job_shards.glob("*.tar"))], "aspect:width,height",
                    output=index, cost="json:width")
        runs = nodejob_runs.io_runs(index, job_shards, root / "caches")
        nodejob_runs.run_all(runs, nodejob_runs.NPROCS, proxy, root / "states")
    return JobRuns(index, job_shards, runs)  # the proxy stopped: no thread of it outlives the runs
