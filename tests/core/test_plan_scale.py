"""Scale tests of the planner: one rank's memory is O(its share), not O(samples).

Each measurement runs in a fresh subprocess over a synthetic index of 10^6-10^7 samples
(tools/make_index.py, in tmp_path): the peak RSS (``VmHWM``, the subprocess's own
high-water mark; ``ru_maxrss`` would start at the RSS of the forking test process,
which Linux carries across exec) after the imports, then after
``load_index`` + ``plan_epoch`` + a few batches; the difference is the planner's extra
peak RSS. Never wall time. The eager path (the ids of every bucket in explicit arrays,
what ``Index.to_dataset()`` built before format version 2) is measured the same way,
so the bound is shown to tell the two apart on this machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

BOUND_MB = 24  # what a rank may add for 10^3 entries of its own, whatever the number of samples

_MEASURE = r"""
import json, sys
import numpy as np
from wds_pad import Dataset, Topology, load_index, plan_epoch

def peak_kb():  # this process image's own high-water mark: ru_maxrss would start at the
    with open("/proc/self/status") as f:  # RSS the forking parent had (Linux keeps it across exec)
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

path, world, eager = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "eager"
before = peak_kb()
index = load_index(path, verify=False)  # (a file under 256 MiB is digest-checked by default: every page read)
source = Dataset(index.name, index.bucket_samples()) if eager else index
plan = plan_epoch(source, Topology(world, world // 2 + 3), seed=7, batch_size=4, warn=False)
firsts = [plan[i].samples.size for i in range(min(3, len(plan)))]
share = int(plan.samples.size)
after = peak_kb()
print(json.dumps({"extra_mb": (after - before) / 1024, "share": share, "batches": len(plan), "firsts": firsts}))
"""


def _measure(path: Path, world: int, eager: bool = False) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(path), str(world), "eager" if eager else "lazy"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=str(path.parent))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def indexes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("scale")
    out = {}
    for samples, shards in ((10**6, 100), (10**7, 1000)):
        path = root / f"s{samples}.wdsidx"
        made = subprocess.run([sys.executable, str(ROOT / "tools" / "make_index.py"), "--samples", str(samples),
                               "--shards", str(shards), "--buckets", "300", "-o", str(path)],
                              capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert made.returncode == 0, made.stderr
        out[samples] = path
    return out


def test_a_ranks_memory_is_its_share_not_the_samples(indexes: dict[int, Path]) -> None:
    # the same share per rank (about 10^3 entries) at 10^6 and at 10^7 samples
    small = _measure(indexes[10**6], 10**3)
    large = _measure(indexes[10**7], 10**4)
    assert 100 < small["share"] < 10_000 and 100 < large["share"] < 10_000
    assert small["firsts"] and large["firsts"]
    assert small["extra_mb"] < BOUND_MB, small
    assert large["extra_mb"] < BOUND_MB, large
    # ten times the samples, the same share: at most a few MB more (page-table and
    # allocator noise), nowhere near the 8 bytes per sample an id array costs (76 MB)
    assert large["extra_mb"] < small["extra_mb"] + 8, (small, large)


def test_the_bound_tells_the_eager_path_apart(indexes: dict[int, Path]) -> None:
    # explicit id arrays (what to_dataset gave before format v2): O(samples) per rank
    eager = _measure(indexes[10**7], 10**4, eager=True)
    lazy = _measure(indexes[10**7], 10**4)
    assert eager["share"] == lazy["share"] and eager["batches"] == lazy["batches"]
    assert eager["extra_mb"] > 4 * BOUND_MB, eager  # ids (80 MB) and their sorted copies
    assert lazy["extra_mb"] < BOUND_MB, lazy


def test_with_few_ranks_memory_follows_the_materialised_share(indexes: dict[int, Path]) -> None:
    # 8 and 16 ranks: shares of ~1.25 x 10^6 and ~6 x 10^5 entries, materialised
    # (plan.samples): the peak halves with the share; per entry it stays a constant (the
    # keyed permutation's temporaries: ~220 bytes on this machine, 9 of them kept)
    eight = _measure(indexes[10**7], 8)
    sixteen = _measure(indexes[10**7], 16)
    assert eight["share"] > 10**6 and 0.45 < sixteen["share"] / eight["share"] < 0.55
    assert eight["extra_mb"] < BOUND_MB + eight["share"] * 320 / 2**20, eight
    assert sixteen["extra_mb"] < 0.7 * eight["extra_mb"], (eight, sixteen)
