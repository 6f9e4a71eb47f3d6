"""A run that goes well prints nothing on stderr, and an error prints only itself: no
aiohttp "Unclosed client session" from DataLoader workers over S3, no ignored errors from
torch's ``__del__`` in the workers of the loader after one that raised.

Each scenario runs in a child process whose whole stderr is checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from data_helpers import upload_files
from wds_pad.cli.synth import make_image_shards

pytest_plugins = ["conftest_servers"]

NOISE = ("Unclosed client session", "Unclosed connector", "Exception ignored", "can only test a child process",
         "Traceback")


def run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-W", "ignore::wds_pad.errors.DroppedBucketWarning", "-c", code, *args],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    return proc


def quiet(stderr: str) -> list[str]:
    """The lines of ``stderr`` that hold any of the noises."""
    return [line for line in stderr.splitlines() if any(n in line for n in NOISE)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return make_image_shards(tmp_path_factory.mktemp("quiet"), samples=40, shards=4, seed=5)


# The parent makes S3 sessions of its own (indexing), then its workers make theirs: a
# worker that collects what it inherited (any full collection, as a long run makes sooner
# or later) used to print "Unclosed client session" for each of the parent's sessions.
S3_LOADER = """
import gc, json, sys
from wds_pad import BucketedWebDataset, Loader, ShardLoader, ShardStream, Topology, build_index

options, pattern, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
build_index(pattern, "aspect:width,height", storage_options=options, output=out)

def collect(samples):
    gc.collect()
    return samples

counts = []
for locality in ("none", "shard"):
    ds = BucketedWebDataset(out, batch_size=2, topology=Topology(world_size=1, rank=0), seed=1, oversubscribe=True,
                            storage_options=options, locality=locality, collation_fn=collect)
    counts.append(sum(not s["__pad__"] for batch in Loader(ds, num_workers=2) for s in batch))
stream = ShardStream(out, topology=Topology(world_size=1, rank=0), seed=1, storage_options=options).map(
    lambda s: (gc.collect(), s)[1])
counts.append(sum(not s["__pad__"] for s in ShardLoader(stream, num_workers=2)))
print(json.dumps(counts))
"""


def test_s3_loader_workers_print_nothing(moto_server: Any, shards: list[str], tmp_path: Path) -> None:
    bucket = upload_files(moto_server, "wds-pad-quiet-stderr", shards)
    pattern = f"s3://{bucket}/shard-{{000000..000003}}.tar"
    proc = run(S3_LOADER, json.dumps(moto_server.storage_options), pattern, str(tmp_path / "s3.wdsidx"))
    assert json.loads(proc.stdout) == [40, 40, 40]  # every sample, besides the padded copies
    assert quiet(proc.stderr) == [], proc.stderr


# A loader whose worker raised (a shard deleted), then the next loader with workers: the
# failed DataLoader iterator, left to the garbage collector, was collected in the next
# loader's forked workers, where torch's __del__ printed an ignored AssertionError.
AFTER_A_FAILURE = """
import json, os, sys
from wds_pad import BucketedWebDataset, Loader, ShardError, ShardLoader, ShardStream, StaleShardError, Topology, build_index

shards, out = sys.argv[1:-1], sys.argv[-1]
build_index(shards, "aspect:width,height", output=out)
one = dict(topology=Topology(world_size=1, rank=0), seed=1)

def loaders():
    yield "Loader", Loader(BucketedWebDataset(out, batch_size=2, oversubscribe=True, **one), num_workers=2)
    yield "ShardLoader", ShardLoader(ShardStream(out, **one), num_workers=2)

got = {}
for name, failing in loaders():
    os.rename(shards[2], shards[2] + ".gone")
    try:
        for _ in failing:
            pass
    except ShardError as exc:  # StaleShardError included
        got[name + " failed"] = type(exc).__name__
    finally:
        os.rename(shards[2] + ".gone", shards[2])
    got[name] = [sum(1 for _ in loader) for _, loader in loaders()]
print(json.dumps(got))
"""


def test_the_loader_after_one_that_raised_prints_nothing(shards: list[str], tmp_path: Path) -> None:
    proc = run(AFTER_A_FAILURE, *shards, str(tmp_path / "i.wdsidx"))
    got = json.loads(proc.stdout)
    assert got["Loader failed"] == "ShardError" and got["ShardLoader failed"] == "StaleShardError"
    assert got["Loader"] == got["ShardLoader"] == [21, 40]  # 21 batches of 2, 40 samples
    assert quiet(proc.stderr) == [], proc.stderr
