"""Tests of wds_pad.io.descriptors: the descriptor limit, in every place that holds shard
files open (the range reader and its read-ahead, the Loader's workers, the index scan).

Each limited case runs in a child process whose soft RLIMIT_NOFILE is lowered first (what
``ulimit -n 64`` does), or whose descriptors are all taken by other files: the test
process keeps its own limit.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from wds_pad import load_index
from wds_pad.errors import ReadError
from wds_pad.io.descriptors import fd_budget, out_of_descriptors, runs_out
from wds_pad.io.ranges import RangeReader, ReadOptions

from data_helpers import image_index, serve_dir

pytest_plugins = ["conftest_servers"]

LIMIT = 64


def index_keys(path: str) -> list[str]:
    index = load_index(path)
    return sorted(index.key(i) for i in range(len(index)))


def run_limited(code: str, *args: str, limit: int | None = LIMIT) -> subprocess.CompletedProcess[str]:
    """``python -c code args`` with its soft RLIMIT_NOFILE lowered to ``limit`` before anything runs."""
    prelude = ("import resource\n"
               f"resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
               if limit is not None else "")
    return subprocess.run([sys.executable, "-c", prelude + code, *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


# What every child that takes all descriptors does first: fill the table with /dev/null.
FILL = """
def fill(free):
    held = []
    while True:
        try:
            held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            break
    for _ in range(free):
        os.close(held.pop())
    return held
"""


# ---------------------------------------------------------------- the budget

def test_the_budget_is_a_quarter_of_the_soft_limit_read_when_asked() -> None:
    proc = run_limited("from wds_pad.io.descriptors import fd_budget\n"
                       "import resource\n"
                       "a = fd_budget()\n"
                       "resource.setrlimit(resource.RLIMIT_NOFILE, (1000, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
                       "print(a, fd_budget(), fd_budget(share=2))")
    assert proc.stdout.split() == ["16", "250", "500"], proc.stderr
    assert 1 <= fd_budget() <= 4096


def test_running_out_is_the_limits_error_not_the_shards() -> None:
    import errno

    exc = OSError(errno.EMFILE, "Too many open files")
    assert runs_out(exc) and runs_out(OSError(errno.ENFILE, "x")) and not runs_out(FileNotFoundError())
    error = out_of_descriptors("cannot open shard 'a.tar' to read byte offset 0", exc, held=3,
                               fewer="DataLoader workers")
    assert isinstance(error, ReadError)
    text = str(error)
    assert text.startswith("cannot open shard 'a.tar' to read byte offset 0: ")
    assert "RLIMIT_NOFILE" in text and "ulimit -n" in text and "fewer DataLoader workers" in text
    assert "3 of them" in text and "check the path" not in text
    system = str(out_of_descriptors("x", OSError(errno.ENFILE, "File table overflow"), fewer="--workers"))
    assert "ENFILE" in system and "fs.file-max" in system


# ---------------------------------------------------------------- the range reader

def test_a_reader_keeps_at_most_its_budget_of_descriptors(local_files: dict[str, bytes],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import wds_pad.io.ranges as ranges_module

    monkeypatch.setattr(ranges_module, "fd_budget", lambda: 2)
    urls = sorted(local_files)
    reader = RangeReader()
    most = 0
    for i, data in enumerate(reader.read_many((urls[i % 5], 7 * i, 100) for i in range(50))):
        assert data == local_files[urls[i % 5]][7 * i: 7 * i + 100]
        most = max(most, len(reader._fds))
    assert most == 2


def test_read_ahead_pins_no_more_shards_than_the_budget(local_files: dict[str, bytes],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import wds_pad.io.ranges as ranges_module

    monkeypatch.setattr(ranges_module, "fd_budget", lambda: 2)
    urls = sorted(local_files)
    reader = RangeReader(ReadOptions(local_threads=3, max_in_flight=16))
    pinned: list[int] = []

    def parse(fd: int, url: str, offset: int, length: int, arg: Any) -> bytes:
        pinned.append(len(reader._busy))
        time.sleep(0.001)  # the consumer takes more items meanwhile
        return os.pread(fd, length, offset)

    items = [(urls[i % 5], 11 * i, 300, i) for i in range(100)]
    out = list(reader.local_read_ahead().run(items, parse))
    assert [r for _, r, _ in out] == [local_files[u][o:o + n] for u, o, n, _ in items]
    assert max(pinned) <= 2 and len(reader._fds) <= 2


READER_OUT_OF_DESCRIPTORS = FILL + """
import hashlib, json, os, sys
from wds_pad.errors import ReadError
from wds_pad.io.ranges import RangeReader

urls = sys.argv[1:]
RangeReader().read(urls[0], 0, 1)  # every module the reader needs is imported before the table fills
held = fill(free=1)  # one descriptor left for the reader: each new shard must take an idle one's place
reader = RangeReader()
digests = [hashlib.sha256(b).hexdigest() for b in reader.read_many((u, 0, 512) for u in urls)]
try:  # every descriptor taken, none of them this reader's: nothing it can close
    RangeReader().read(urls[0], 0, 512)
    error = None
except ReadError as exc:
    error = str(exc)
print(json.dumps({"digests": digests, "error": error}))
"""


def test_a_reader_out_of_descriptors_closes_its_idle_ones_then_names_the_limit(
        local_files: dict[str, bytes]) -> None:
    urls = sorted(local_files) * 3
    proc = run_limited("import os\n" + READER_OUT_OF_DESCRIPTORS, *urls)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["digests"] == [hashlib.sha256(local_files[u][:512]).hexdigest() for u in urls]
    error = got["error"]
    assert error.startswith(f"cannot open shard {urls[0]!r} to read byte offset 0: this process has no "
                            f"file descriptor left (EMFILE; soft limit RLIMIT_NOFILE {LIMIT})"), error
    assert "ulimit -n" in error and "fewer DataLoader workers" in error and "check the path" not in error


# ---------------------------------------------------------------- streaming under `ulimit -n 64`

@pytest.fixture(scope="module")
def one_sample_shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    """300 shards of one sample each, indexed: more shards than the limit has descriptors."""
    root = tmp_path_factory.mktemp("one-sample")
    return str(image_index(root, samples=300, shards=300, seed=3).path)


STREAM = """
import json, sys
from wds_pad import BucketedWebDataset, Loader, Topology, load_index
index, workers, locality = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ds = BucketedWebDataset(load_index(index), batch_size=2, topology=Topology(world_size=1, rank=0), seed=1,
                        locality=locality)
print(json.dumps([s["__key__"] for batch in Loader(ds, num_workers=workers) for s in batch if not s["__pad__"]]))
"""


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("locality", ["none", "shard"])
def test_300_shards_stream_under_a_limit_of_64_descriptors(one_sample_shards: str, workers: int,
                                                           locality: str) -> None:
    proc = run_limited(STREAM, one_sample_shards, str(workers), locality)
    assert proc.returncode == 0, proc.stderr
    keys = json.loads(proc.stdout)
    assert sorted(keys) == index_keys(one_sample_shards)  # every sample exactly once


@pytest.fixture(scope="module")
def served_one_sample_shards(one_sample_shards: str, nginx_server: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same 300 shards over HTTP, indexed by their URLs."""
    from wds_pad import build_index

    base = serve_dir(nginx_server, Path(one_sample_shards).parent, "one-sample",
                     ignore=lambda _, names: [n for n in names if not n.endswith(".tar")])
    out = tmp_path_factory.mktemp("served") / "http.wdsidx"
    build_index(f"{base}/shard-{{000000..000299}}.tar", "aspect:width,height", output=str(out))
    return str(out)


@pytest.mark.parametrize(("locality", "workers"), [("none", 2), ("shard", 0), ("shard", 2)])
def test_300_shards_stream_over_http_under_a_limit_of_64_descriptors(served_one_sample_shards: str,
                                                                     one_sample_shards: str, locality: str,
                                                                     workers: int) -> None:
    # requests in flight (each may hold a connection) and the shard cache's fetching threads
    # (a lock, a part file and a connection each) stay within a share of the limit
    proc = run_limited(STREAM, served_one_sample_shards, str(workers), locality)
    assert proc.returncode == 0, proc.stderr
    assert sorted(json.loads(proc.stdout)) == index_keys(one_sample_shards)


SHARD_LEVEL = FILL + """
import json, os, sys
from wds_pad import ShardLoader, ShardStream, Topology
from wds_pad.errors import ReadError

index, workers = sys.argv[1], int(sys.argv[2])
stream = ShardStream(index, topology=Topology(world_size=1, rank=0), seed=1)
keys = [s["__key__"] for s in ShardLoader(stream, num_workers=workers) if not s["__pad__"]]
next(iter(ShardStream(index, topology=Topology(world_size=1, rank=0), seed=1)))  # imports all it needs
again = ShardStream(index, topology=Topology(world_size=1, rank=0), seed=1)
held = fill(free=0)  # every descriptor taken by other files
try:
    next(iter(again))
    error = None
except ReadError as exc:
    error = str(exc)
for fd in held:
    os.close(fd)
print(json.dumps({"keys": keys, "error": error}))
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_the_shard_level_path_streams_300_shards_under_a_limit_of_64(one_sample_shards: str, workers: int) -> None:
    proc = run_limited(SHARD_LEVEL, one_sample_shards, str(workers))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert sorted(got["keys"]) == index_keys(one_sample_shards)
    assert re.match(r"cannot open shard '.*\.tar': this process has no file descriptor left \(EMFILE; "
                    r"soft limit RLIMIT_NOFILE 64\); raise the limit", got["error"]), got["error"]


# ---------------------------------------------------------------- indexing under `ulimit -n 64`

@pytest.fixture(scope="module")
def many_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2,000 small shards of one sample each."""
    root = tmp_path_factory.mktemp("many")
    for i in range(2000):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            info = tarfile.TarInfo(f"k{i:04d}.txt")
            info.size = 4
            tar.addfile(info, io.BytesIO(b"%04d" % i))
        (root / f"s-{i:04d}.tar").write_bytes(buf.getvalue())
    return root


CLI = "import sys\nfrom wds_pad.cli.app import main\nsys.exit(main(sys.argv[1:]))\n"


@pytest.mark.parametrize("workers", [["--workers", "2"], []], ids=["workers-2", "default-workers"])
def test_indexing_2000_shards_under_a_limit_of_64_descriptors(many_shards: Path, tmp_path: Path,
                                                              workers: list[str]) -> None:
    out = tmp_path / "i.wdsidx"
    proc = run_limited(CLI, "index", str(many_shards / "s-{0000..1999}.tar"), "-o", str(out), "--no-progress",
                       *workers)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert index_keys(str(out)) == [f"k{i:04d}" for i in range(2000)]


INDEX_OUT_OF_DESCRIPTORS = FILL + """
import os, sys
from wds_pad.cli.app import main

pattern, out = sys.argv[1:]
assert main(["index", pattern, "-o", out + ".warm", "--no-progress"]) == 0  # every module imported
held = fill(free=0)
sys.exit(main(["index", pattern, "-o", out, "--no-progress", "--on-error", "skip"]))
"""


def test_indexing_out_of_descriptors_is_one_line_about_the_limit(many_shards: Path, tmp_path: Path) -> None:
    proc = run_limited(INDEX_OUT_OF_DESCRIPTORS, str(many_shards / "s-{0000..0009}.tar"), str(tmp_path / "i.wdsidx"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    line = lines[0]
    # the output is tried first (before any scan), so that is what runs out here
    assert re.match(rf"wds-pad index: error: (cannot open shard '{re.escape(str(many_shards))}/s-000\d\.tar' "
                    rf"to scan it|cannot create the index output '{re.escape(str(tmp_path))}/i\.wdsidx'): this "
                    r"process has no file descriptor left \(EMFILE; soft limit RLIMIT_NOFILE 64\)", line), line
    assert "ulimit -n" in line and "fewer --workers" in line
    assert not (tmp_path / "i.wdsidx").exists()  # not an index of no shards: --on-error skip skips no shard for it
