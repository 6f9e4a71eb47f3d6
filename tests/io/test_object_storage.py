"""End-to-end object storage: index, stream and resume over S3 (moto) and HTTP (nginx).

Every server runs on 127.0.0.1 (fixtures from ``conftest_servers``). Each stream is
compared twice: its keys with the plan (``plan[j].samples`` through ``index.key``) and
its bytes with ``wds.WebDataset`` reading the same shards from local disk. A resumed
stream must equal the remainder of the uninterrupted one, batch for batch.

Concurrency is measured, not assumed: a probe rule on the FaultProxy timestamps every
request as it arrives; with a fixed latency L added to each request, requests that
arrive less than L apart were outstanding together.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import s3fs
import webdataset as wds

from faultproxy import Fault, FaultProxy, Request, Rule
from servers import MotoServer
from data_helpers import (assert_same_bytes, batch_keys, make_dataset, plan_keys, serve_dir, upload_files,
                          wds_reference)
from wds_pad.cli.synth import make_image_shards
from wds_pad.cli.app import main as cli_main
from wds_pad.stream.dataset import BucketedWebDataset
from wds_pad.stream.loader import Loader
from wds_pad.io import fs as wds_fs
from wds_pad.errors import IndexFormatError, ReadError, ShardError, StaleShardError
from wds_pad.index.codec import load_index
from wds_pad.index.record import Index
from wds_pad.index.output import write_index
from wds_pad.index.build import build_index
from wds_pad.index.verify import verify_index
from wds_pad.io.ranges import RangeReader, ReadOptions
from wds_pad.core.topology import Topology

pytest_plugins = ["conftest_servers"]

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning"),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

SOLO = Topology(world_size=1, rank=0)
SHARDS = 32
SAMPLES = 160  # 5 per shard on average: moto copies the whole object per ranged GET
PATTERN = "train-{000000..000031}.tar"
BUCKET_BY = "aspect:width,height"


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """32 tiny image shards named like the bucket's objects, ``train-000000.tar`` ..."""
    out = tmp_path_factory.mktemp("os-shards")
    for i, path in enumerate(make_image_shards(out / "gen", samples=SAMPLES, shards=SHARDS, seed=5)):
        os.replace(path, out / f"train-{i:06d}.tar")
    return out


@pytest.fixture(scope="module")
def reference(shard_dir: Path) -> dict[str, dict[str, Any]]:
    """Every sample, keyed by ``__key__``, as webdataset reads it from local disk."""
    return wds_reference(str(shard_dir / f"train-{i:06d}.tar") for i in range(SHARDS))


@pytest.fixture(scope="module")
def s3_train(moto_server: MotoServer, shard_dir: Path) -> str:
    """A bucket holding the 32 shards as ``s3://BUCKET/train-000000.tar`` ...; its name."""
    return upload_files(moto_server, "wds-pad-object-storage",
                        [shard_dir / f"train-{i:06d}.tar" for i in range(SHARDS)])


@pytest.fixture(scope="module")
def http_base(nginx_server: Any, shard_dir: Path) -> str:
    """Base URL under which nginx serves the same 32 shards."""
    return serve_dir(nginx_server, shard_dir, "os-train", ignore=shutil.ignore_patterns("gen"))


@pytest.fixture(scope="module")
def s3_index(moto_server: MotoServer, s3_train: str) -> tuple[str, Index]:
    """The index of the bucket's shards, written next to them: (its URL, the built Index)."""
    index_url = f"s3://{s3_train}/train.wdsidx"
    built = build_index(f"s3://{s3_train}/{PATTERN}", BUCKET_BY, output=index_url,
                        storage_options=moto_server.storage_options)
    return index_url, built


@pytest.fixture
def forget_filesystems() -> Iterator[None]:
    """Drop cached filesystems afterwards (one built from a test's environment would
    otherwise outlive it, pointing at a stopped endpoint)."""
    yield
    s3fs.S3FileSystem.clear_instance_cache()
    wds_fs._FS_CACHE.clear()


def _s3fs(moto_server: MotoServer) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(skip_instance_cache=True, **moto_server.storage_options)


def _ds(index: Index | str, **kw: Any) -> BucketedWebDataset:
    return make_dataset(index, **{"topology": SOLO, "seed": 7, **kw})


def _resume_matches(make: Any, full: list[list[str]], stop_after: int, num_workers: int | None) -> None:
    """Stop a fresh stream after ``stop_after`` batches, resume a new one from its state.

    ``num_workers=None`` iterates the dataset itself; otherwise a :class:`Loader` with
    that many DataLoader workers (its state counts what the trainer received).
    """
    first = make()
    owner: Any = first if num_workers is None else Loader(first, num_workers=num_workers)
    it = iter(owner)
    head = batch_keys(itertools.islice(it, stop_after))
    state = owner.state_dict()
    del it  # ends the workers
    second = make()
    resumed: Any = second if num_workers is None else Loader(second, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert head == full[:stop_after]
    assert batch_keys(resumed) == full[stop_after:]


class _Arrivals:
    """A never-firing proxy rule that timestamps every request as it arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, request: Request) -> bool:
        if request.method == "GET":
            self.times.append(time.monotonic())
        return False

    def peak_within(self, window: float) -> int:
        """Most arrivals inside any ``window`` seconds: all of them were in flight at once
        when every request is delayed by at least ``window`` at the proxy."""
        times, best, lo = sorted(self.times), 0, 0
        for hi, t in enumerate(times):
            while t - times[lo] >= window:
                lo += 1
            best = max(best, hi - lo + 1)
        return best


# ---------------------------------------------------------------- S3


def test_s3_index_next_to_shards_stream_and_resume(moto_server: MotoServer, s3_train: str,
                                                    s3_index: tuple[str, Index],
                                                    reference: dict[str, dict[str, Any]]) -> None:
    options = moto_server.storage_options
    index_url, built = s3_index
    assert _s3fs(moto_server).exists(index_url)  # written next to the shards, in the bucket
    assert [s.url for s in built.shards] == [f"s3://{s3_train}/train-{i:06d}.tar" for i in range(SHARDS)]
    assert len(built) == SAMPLES and all(s.stamp.startswith("ETag=") for s in built.shards)

    index = load_index(index_url, storage_options=options)
    assert index.digest == built.digest
    ds = _ds(index_url, storage_options=options)  # the dataset loads the index from S3 itself
    batches = list(ds)
    full = batch_keys(batches)
    assert full == plan_keys(ds.plan(), index) and len(full) == len(ds) > 10
    assert_same_bytes(batches, reference)

    make = lambda: _ds(index_url, storage_options=options)  # noqa: E731
    _resume_matches(make, full, stop_after=len(full) // 2, num_workers=None)


def test_s3_resume_through_loader_workers(moto_server: MotoServer, s3_index: tuple[str, Index]) -> None:
    """Workers fork after the parent loaded the index over s3fs: they must read on their own."""
    options = moto_server.storage_options
    index_url = s3_index[0]
    make = lambda: _ds(index_url, storage_options=options, seed=8)  # noqa: E731
    full = batch_keys(Loader(make(), num_workers=2))
    assert full == plan_keys(make().plan(), load_index(index_url, storage_options=options))
    _resume_matches(make, full, stop_after=7, num_workers=2)


def test_s3_index_streams_through_spawned_workers(moto_server: MotoServer, s3_index: tuple[str, Index]) -> None:
    """Spawned workers receive the remote index pickled (a local one travels as its path)."""
    options = moto_server.storage_options
    make = lambda: _ds(s3_index[0], storage_options=options, seed=9)  # noqa: E731
    spawned = batch_keys(Loader(make(), num_workers=2, multiprocessing_context="spawn"))
    assert spawned == batch_keys(make()) and len(spawned) > 10


def test_s3_credentials_and_endpoint_from_the_environment(
        moto_server: MotoServer, s3_train: str, fault_proxy: Any,
        monkeypatch: pytest.MonkeyPatch, forget_filesystems: None) -> None:
    """No storage_options at all: botocore takes keys, region and endpoint from AWS_*."""
    proxy: FaultProxy = fault_proxy(moto_server)
    key_id = "AKIAWDSPADFROMENV01"
    for name, value in {**moto_server.env, "AWS_ACCESS_KEY_ID": key_id,
                        "AWS_SECRET_ACCESS_KEY": "env-secret-wds-pad-8e1d",
                        "AWS_ENDPOINT_URL": proxy.url, "AWS_ENDPOINT_URL_S3": proxy.url}.items():
        monkeypatch.setenv(name, value)
    index = build_index(f"s3://{s3_train}/train-{{000000..000003}}.tar", BUCKET_BY)
    ds = _ds(index, oversubscribe=True)
    assert batch_keys(ds) == plan_keys(ds.plan(), index)
    auth = [r.header("authorization") or "" for r in proxy.requests]
    assert auth and all(f"Credential={key_id}/" in a for a in auth)  # the env's key signed them


def test_s3_missing_index_is_a_clear_error(moto_server: MotoServer, s3_train: str) -> None:
    with pytest.raises(IndexFormatError, match=f"s3://{s3_train}/nope.wdsidx.*does not exist"):
        _ds(f"s3://{s3_train}/nope.wdsidx", storage_options=moto_server.storage_options)


# ---------------------------------------------------------------- faults of the store itself


def _closed_port() -> int:
    """A loopback port nothing listens on: bound, then closed."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# botocore and s3fs would retry a refused connection for seconds: one attempt, short waits
QUICK = {"config_kwargs": {"retries": {"total_max_attempts": 1}, "connect_timeout": 2,
                           "read_timeout": 10}}


@pytest.fixture
def no_credentials(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                   forget_filesystems: None) -> dict[str, Any]:
    """The environment points at moto but holds no credentials anywhere (nor does a
    config file; no metadata server is asked); returns storage_options to match."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in {"AWS_ENDPOINT_URL": moto_server.endpoint_url,
                        "AWS_ENDPOINT_URL_S3": moto_server.endpoint_url,
                        "AWS_DEFAULT_REGION": moto_server.region, "AWS_EC2_METADATA_DISABLED": "true",
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-credentials"),
                        "AWS_CONFIG_FILE": str(tmp_path / "no-config"), "AWS_MAX_ATTEMPTS": "1",
                        "AWS_RETRY_MODE": "standard"}.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    wds_fs._FS_CACHE.clear()
    return {"client_kwargs": {"endpoint_url": moto_server.endpoint_url,
                              "region_name": moto_server.region}, **QUICK}


def test_s3_without_credentials_is_a_read_error_saying_what_to_set(
        s3_train: str, s3_index: tuple[str, Index], no_credentials: dict[str, Any], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    index_url, _ = s3_index
    shard = f"s3://{s3_train}/train-000000.tar"
    for call, url in ((lambda: build_index(shard, None, storage_options=no_credentials), shard),
                      (lambda: load_index(index_url, storage_options=no_credentials), index_url)):
        with pytest.raises(ReadError, match="found no credentials") as info:
            call()
        msg = str(info.value)
        assert url in msg and "Unable to locate credentials" in msg  # redaction keeps the words
        assert "AWS_ACCESS_KEY_ID" in msg and "storage_options" in msg
    # The CLI takes the environment alone: one line of advice, exit 1, no traceback.
    for argv, url in ((["index", shard, "-o", str(tmp_path / "x.wdsidx"), "--no-progress"], shard),
                      (["inspect", index_url], index_url)):
        assert cli_main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"wds-pad {argv[0]}: error: cannot read ") and url in err, err
        assert "found no credentials" in err and len(err.strip().splitlines()) == 1, err


def test_s3_output_without_credentials_is_a_read_error_before_any_scan(
        s3_train: str, no_credentials: dict[str, Any], tmp_path: Path) -> None:
    out = f"s3://{s3_train}/out-{tmp_path.name}.wdsidx"
    scanned: list[str] = []

    def bucket_fn(key: str, data: Any) -> str:
        scanned.append(key)
        return "all"

    with pytest.raises(ReadError, match="found no credentials") as info:
        build_index(f"s3://{s3_train}/train-000000.tar", bucket_fn, output=out,
                    storage_options=no_credentials)
    assert out in str(info.value) and not scanned  # refused before the shard was read


_STREAM_WITHOUT_CREDENTIALS = """
import gc, sys
from wds_pad.stream.dataset import BucketedWebDataset
from wds_pad.errors import ReadError
from wds_pad.io.options import ReadOptions
from wds_pad.core.topology import Topology

options = {"client_kwargs": {"endpoint_url": sys.argv[2], "region_name": "us-east-1"},
           "config_kwargs": {"retries": {"total_max_attempts": 1}}}
for attempt in range(8):
    ds = BucketedWebDataset(sys.argv[1], batch_size=4, topology=Topology(world_size=1, rank=0),
                            seed=attempt, storage_options=options,
                            read_options=ReadOptions(max_in_flight=32, max_merged_bytes=0))
    try:
        list(ds)
    except ReadError as exc:  # the user's own handler
        print("caught:", exc, flush=True)
    gc.collect()
"""


def test_a_permanent_failure_with_many_reads_in_flight_prints_nothing_to_stderr(
        moto_server: MotoServer, s3_index: tuple[str, Index], no_credentials: dict[str, Any],
        tmp_path: Path) -> None:
    """32 ranged GETs in flight fail for want of credentials: the one error reaches the
    handler; the others are cancelled and retrieved, so asyncio prints nothing."""
    index_path = str(tmp_path / "train.wdsidx")
    write_index(s3_index[1], index_path)
    package = str(Path(wds_fs.__file__).resolve().parents[2])  # this checkout's wds_pad
    proc = subprocess.run(
        [sys.executable, "-W", "ignore::UserWarning", "-c", _STREAM_WITHOUT_CREDENTIALS, index_path,
         moto_server.endpoint_url],
        env={**os.environ, "PYTHONPATH": package}, capture_output=True, text=True, timeout=100)
    caught = [line for line in proc.stdout.splitlines() if line.startswith("caught:")]
    assert proc.returncode == 0 and len(caught) == 8, (proc.stdout, proc.stderr[-3000:])
    assert all("found no credentials" in line and "Unable to locate credentials" in line
               for line in caught), caught[0]
    assert "never retrieved" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr == ""


def test_a_store_at_a_closed_port_cannot_be_reached_which_is_not_missing(
        s3_train: str, capsys: pytest.CaptureFixture[str], forget_filesystems: None) -> None:
    port = _closed_port()
    http = f"http://127.0.0.1:{port}"
    s3 = {"key": "wdspad-closed-port-key", "secret": "wdspad-closed-port-secret",
          "client_kwargs": {"endpoint_url": http, "region_name": "us-east-1"}, **QUICK}
    cases = [
        (lambda: build_index(f"s3://{s3_train}/train-000000.tar", None, storage_options=s3),
         f"s3://{s3_train}/train-000000.tar", "EndpointConnectionError"),
        (lambda: load_index(f"s3://{s3_train}/train.wdsidx", storage_options=s3),
         f"s3://{s3_train}/train.wdsidx", "EndpointConnectionError"),
        (lambda: build_index(f"{http}/train-000000.tar", None), f"{http}/train-000000.tar",
         "ClientConnectorError"),
        (lambda: load_index(f"{http}/train.wdsidx"), f"{http}/train.wdsidx", "ClientConnectorError"),
    ]
    for call, url, raw in cases:
        with pytest.raises(ReadError, match="cannot reach the store") as info:
            call()
        msg = str(info.value)
        assert f"{url}'" in msg and raw in msg and "then retry" in msg, msg
        assert "does not exist" not in msg and not isinstance(info.value, (ShardError, IndexFormatError))
    assert cli_main(["inspect", f"{http}/train.wdsidx"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("wds-pad inspect: error: cannot read index") and "cannot reach the store" in err
    assert len(err.strip().splitlines()) == 1, err


def test_verify_says_unreachable_not_missing_when_the_store_is_down(
        http_base: str, nginx_server: Any, fault_proxy: Any, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    proxy: FaultProxy = fault_proxy(nginx_server)
    index_path = str(tmp_path / "v.wdsidx")
    build_index(f"{proxy.url}/os-train/train-{{000000..000002}}.tar", BUCKET_BY, output=index_path)
    assert cli_main(["verify", index_path]) == 0
    capsys.readouterr()
    proxy.stop()  # the server is gone: nothing listens on its port any more
    problems = verify_index(index_path)
    assert len(problems) == 3 and all(p.reason.startswith("unreachable: ") for p in problems)
    assert cli_main(["verify", index_path]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" ", 1)[0] for line in out] == ["UNREACHABLE"] * 3 + ["3"], out
    assert all("cannot reach the store" in line and "then retry" in line for line in out[:3])
    assert out[3].startswith("3 of 3 shards not checked") and "--update" not in out[3], out[3]


# ---------------------------------------------------------------- HTTP


def test_http_index_stream_and_resume(http_base: str, tmp_path: Path,
                                      reference: dict[str, dict[str, Any]]) -> None:
    # Indexing over HTTP streams each object once through fsspec (no seeking past payloads).
    index_path = str(tmp_path / "train.wdsidx")  # HTTP is read-only: the index lives locally
    built = build_index(f"{http_base}/{PATTERN}", BUCKET_BY, output=index_path)
    assert [s.url for s in built.shards] == [f"{http_base}/train-{i:06d}.tar" for i in range(SHARDS)]
    assert len(built) == SAMPLES and all(s.stamp for s in built.shards)  # ETag from nginx
    ds = _ds(index_path)
    batches = list(ds)
    full = batch_keys(batches)
    assert full == plan_keys(ds.plan(), built)
    assert_same_bytes(batches, reference)
    _resume_matches(lambda: _ds(index_path), full, stop_after=len(full) // 3, num_workers=None)
    _resume_matches(lambda: _ds(index_path), full, stop_after=5, num_workers=2)


def test_http_index_equals_local_index_rows(http_base: str, shard_dir: Path) -> None:
    """Streaming the tar over HTTP finds the same samples, offsets and buckets as seeking."""
    remote = build_index(f"{http_base}/train-{{000000..000007}}.tar", BUCKET_BY)
    local = build_index(str(shard_dir / "train-{000000..000007}.tar"), BUCKET_BY)
    for column in ("offset", "length", "bucket", "shard"):
        assert getattr(remote, column).tolist() == getattr(local, column).tolist()
    assert [remote.key(i) for i in range(len(remote))] == [local.key(i) for i in range(len(local))]


# ---------------------------------------------------------------- changed shards


def _changed_bytes(data: bytes, how: str) -> bytes:
    """The shard with bytes appended, or with one payload byte edited (same size): every
    indexed byte range still parses either way."""
    if how == "append":
        return data + b"\0" * 10240
    edited = bytearray(data)
    edited[512] ^= 0xFF  # the first member's data, after its 512-byte header
    return bytes(edited)


def _only_ranged_gets(proxy: FaultProxy) -> list[Request]:
    requests = proxy.requests
    assert requests and all(r.method == "GET" and r.header("Range") for r in requests), \
        sorted({(r.method, r.header("Range") is not None) for r in requests})
    return requests


@pytest.mark.parametrize("how", ["append", "edit"])
def test_s3_changed_shard_is_refused_with_no_extra_request(moto_server: MotoServer, s3_bucket: str,
                                                            shard_dir: Path, fault_proxy: Any,
                                                            how: str) -> None:
    client = moto_server.client()
    for i in range(4):
        client.upload_file(str(shard_dir / f"train-{i:06d}.tar"), s3_bucket, f"train-{i:06d}.tar")
    index = build_index(f"s3://{s3_bucket}/train-{{000000..000003}}.tar", BUCKET_BY,
                        storage_options=moto_server.storage_options)
    proxy: FaultProxy = fault_proxy(moto_server)
    ds = _ds(index, storage_options=moto_server.storage_options_via(proxy.url))
    assert batch_keys(ds) == plan_keys(ds.plan(), index)  # unchanged: streams as before
    assert len(_only_ranged_gets(proxy)) == ds.read_stats.requests  # type: ignore[union-attr]
    shard = int(index.shard[int(ds.plan()[1].samples[0])])
    key = f"train-{shard:06d}.tar"
    client.put_object(Bucket=s3_bucket, Key=key,
                      Body=_changed_bytes((shard_dir / key).read_bytes(), how))
    proxy.reset_counters()
    with pytest.raises(StaleShardError) as err:
        list(ds)
    msg = str(err.value)
    assert f"s3://{s3_bucket}/{key}" in msg and "--update" in msg
    assert index.shards[shard].stamp in msg and index.shards[shard].stamp.startswith("ETag=")
    assert len(_only_ranged_gets(proxy)) <= ds.read_stats.requests  # type: ignore[union-attr]


@pytest.mark.parametrize("how", ["append", "edit"])
def test_http_changed_shard_is_refused_with_no_extra_request(nginx_server: Any, shard_dir: Path,
                                                              fault_proxy: Any, how: str) -> None:
    root = nginx_server.root_dir / f"changed-{how}"
    root.mkdir()
    for i in range(4):
        shutil.copyfile(shard_dir / f"train-{i:06d}.tar", root / f"train-{i:06d}.tar")
    proxy: FaultProxy = fault_proxy(nginx_server)
    base = f"{proxy.url}/changed-{how}"
    index = build_index(f"{base}/train-{{000000..000003}}.tar", BUCKET_BY)
    assert all(s.stamp.startswith("ETag=") for s in index.shards)
    proxy.reset_counters()
    ds = _ds(index)
    assert batch_keys(Loader(ds, num_workers=0)) == plan_keys(ds.plan(), index)  # unchanged: as before
    assert len(_only_ranged_gets(proxy)) == ds.read_stats.requests  # type: ignore[union-attr]
    shard = int(index.shard[int(ds.plan()[1].samples[0])])
    path = root / f"train-{shard:06d}.tar"
    stat = path.stat()
    path.write_bytes(_changed_bytes(path.read_bytes(), how))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))  # nginx: seconds
    proxy.reset_counters()
    with pytest.raises(StaleShardError) as err:
        list(Loader(ds, num_workers=0))
    msg = str(err.value)
    assert f"{base}/train-{shard:06d}.tar" in msg and "--update" in msg
    assert index.shards[shard].stamp in msg
    assert len(_only_ranged_gets(proxy)) <= ds.read_stats.requests  # type: ignore[union-attr]


# ---------------------------------------------------------------- caching chains


def test_simplecache_chain_indexes_and_streams_from_the_cache(
        moto_server: MotoServer, s3_train: str, fault_proxy: Any, tmp_path: Path,
        reference: dict[str, dict[str, Any]]) -> None:
    proxy: FaultProxy = fault_proxy(moto_server)
    cache = tmp_path / "cache"
    options = {"s3": moto_server.storage_options_via(proxy.url),
               "simplecache": {"cache_storage": str(cache)}}
    index = build_index(f"simplecache::s3://{s3_train}/{PATTERN}", BUCKET_BY,
                        output=str(tmp_path / "cached.wdsidx"), storage_options=options)
    assert index.shards[0].url == f"simplecache::s3://{s3_train}/train-000000.tar"
    assert len(index) == SAMPLES and len(os.listdir(cache)) == SHARDS  # each object fetched once
    fetched = sum(r.method == "GET" for r in proxy.requests)
    assert fetched == SHARDS
    proxy.reset_counters()
    ds = _ds(index.path, storage_options=options)
    batches = list(ds)
    assert batch_keys(batches) == plan_keys(ds.plan(), index)
    assert_same_bytes(batches, reference)
    assert not [r for r in proxy.requests if r.method == "GET"]  # served from the local cache


# ---------------------------------------------------------------- concurrency, measured


def test_many_range_reads_in_flight_hide_latency(http_base: str, fault_proxy: Any,
                                                 nginx_server: Any, tmp_path: Path) -> None:
    """Behaviour, not speed: many requests are outstanding together, counted by the
    reader and seen at the server; elapsed time is left to tools/bench/remote.py, which
    prints samples/s at 1 .. 64 in flight as ratios against one at a time."""
    latency = 0.1
    proxy: FaultProxy = fault_proxy(nginx_server)
    base = proxy.url + http_base[len(nginx_server.url):]
    index = build_index(f"{base}/{PATTERN}", BUCKET_BY, output=str(tmp_path / "proxied.wdsidx"))
    probe = _Arrivals()
    proxy.add_rule(Rule(Fault.FAIL, remaining=None, match=probe))
    proxy.set_latency(latency * 1000)
    ds = _ds(index, read_options=ReadOptions(max_in_flight=32, max_merged_bytes=0))
    it = iter(ds)
    got = sum(len(b) for b in itertools.islice(it, 16))  # 64 samples
    it.close()
    assert got == 64
    stats = ds.read_stats
    assert stats is not None and stats.peak_requests_in_flight >= 8, stats
    # Requests that arrive less than L apart were outstanding together: one at a time,
    # each would wait >= L for the answer to the one before. (A busy machine can only
    # bunch arrivals up, never make a sequential reader look concurrent.)
    assert probe.peak_within(latency) >= 8, probe.peak_within(latency)

    # The reader's own counters agree with the server, and max_in_flight=1 really is one
    # at a time (a fresh proxy, so nothing of the stream above can arrive in between).
    quiet: FaultProxy = fault_proxy(nginx_server)
    probe = _Arrivals()
    quiet.add_rule(Rule(Fault.FAIL, remaining=None, match=probe))
    quiet.set_latency(latency * 1000)
    ranges = [(index.url(i).replace(proxy.url, quiet.url, 1), int(index.offset[i]), int(index.length[i]))
              for i in range(0, 32, 2)]
    assert all(url.startswith(quiet.url) for url, _, _ in ranges)
    peaks = {}
    for n in (1, 16):
        probe.times.clear()
        reader = RangeReader(ReadOptions(max_in_flight=n))
        assert [len(b) for b in reader.read_many(ranges)] == [r[2] for r in ranges]
        assert reader.stats.peak_requests_in_flight == n and reader.stats.requests == len(ranges)
        assert len(probe.times) == len(ranges)
        peaks[n] = probe.peak_within(latency)
    assert peaks[1] == 1 and peaks[16] >= 8, peaks
