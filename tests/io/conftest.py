"""Fixtures of the io tests: local and memory:// shards of random bytes."""

from __future__ import annotations

import os

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
