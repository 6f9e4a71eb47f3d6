"""Faults between the reader and object storage, injected by a FaultProxy on loopback.

One module-wide proxy stands in front of nginx (HTTP) and one in front of moto (S3);
each test sets its own faults (cleared before the next). Every stream is compared with a
fault-free run of the same plan: the same keys in the same batches, the same bytes.

- transient (503/500, connection resets, latency): retried with backoff, nothing lost
  or duplicated;
- permanent (403, 404): fail fast with the URL, no retry (counted at the proxy);
- stalled requests: cancelled after ``ReadOptions.timeout``, then retried, or a clear
  ReadError in bounded time, never a hang;
- credentials never appear in an error message, a log record or stderr.

Retry layers below wds_pad are switched off where a test counts requests: botocore's
legacy ``max_attempts`` counts *retries* (``total_max_attempts: 1`` means one attempt),
and s3fs retries S3's ``SlowDown`` code by itself, so raw S3 faults use status 500.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import logging
import shutil
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from faultproxy import Fault, FaultProxy, Request, Rule, StallMode
from servers import MotoServer
from data_helpers import make_dataset, plan_keys, serve_dir, upload_files
from wds_pad.cli.synth import make_image_shards
from wds_pad.stream.dataset import BucketedWebDataset
from wds_pad.stream.fetch import fetch
from wds_pad.stream.stages import PlannedSource, plan_batched
from wds_pad.errors import ReadError, ShardError, WdsPadError
from wds_pad.index.codec import load_index
from wds_pad.index.record import Index
from wds_pad.index.build import build_index
from wds_pad.io.ranges import RangeReader, ReadOptions
from wds_pad.core.topology import Topology

pytest_plugins = ["conftest_servers"]

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning")]

SOLO = Topology(world_size=1, rank=0)
SHARDS = 8
SAMPLES = 64
PATTERN = "shard-{000000..000007}.tar"
BUCKET_BY = "aspect:width,height"
# Fast retries: backoff adds next to nothing to a test's run time.
FAST = dict(backoff=0.01, backoff_max=0.05)
RAW_S3 = {"config_kwargs": {"retries": {"total_max_attempts": 1}}}


def _ranged(request: Request) -> bool:
    return request.method == "GET" and request.header("range") is not None


_S3_CODES = {403: "AccessDenied", 404: "NoSuchKey", 500: "InternalError", 503: "SlowDown"}


class S3FaultProxy(FaultProxy):
    """A FaultProxy whose error bodies carry the code S3 itself sends for each status.

    The stock proxy answers every non-503 status with ``InternalError``, which s3fs maps
    to a transient EREMOTEIO even for a 403; real S3 says ``AccessDenied``.
    """

    @staticmethod
    def _send_error(writer: Any, status: int, method: str, target: str) -> None:
        code = _S3_CODES.get(status, "InternalError")
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>injected {status} for {method} {target}</Message>"
                "<RequestId>faultproxy</RequestId></Error>").encode()
        head = (f"HTTP/1.1 {status} Error\r\nContent-Type: application/xml\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")
        writer.write(head.encode("latin-1") + (b"" if method == "HEAD" else body))


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_image_shards(tmp_path_factory.mktemp("fault-shards"), samples=SAMPLES,
                                  shards=SHARDS, seed=3)[0]).parent


@pytest.fixture(scope="module")
def http_proxy(nginx_server: Any, shard_dir: Path) -> Iterator[FaultProxy]:
    serve_dir(nginx_server, shard_dir, "faults")
    with FaultProxy(nginx_server.host, nginx_server.port, seed=1) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def s3_proxy(moto_server: MotoServer, shard_dir: Path) -> Iterator[FaultProxy]:
    upload_files(moto_server, "wds-pad-faults", sorted(shard_dir.glob("shard-*.tar")))
    with S3FaultProxy(moto_server.host, moto_server.port, seed=2) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def http_index(http_proxy: FaultProxy, tmp_path_factory: pytest.TempPathFactory) -> Index:
    out = str(tmp_path_factory.mktemp("fault-index") / "http.wdsidx")
    return build_index(f"{http_proxy.url}/faults/{PATTERN}", BUCKET_BY, output=out)


@pytest.fixture(scope="module")
def s3_options(moto_server: MotoServer, s3_proxy: FaultProxy) -> dict[str, Any]:
    return {**moto_server.storage_options_via(s3_proxy.url), **RAW_S3}


@pytest.fixture(scope="module")
def s3_index(s3_options: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Index:
    out = str(tmp_path_factory.mktemp("fault-index") / "s3.wdsidx")
    return build_index(f"s3://wds-pad-faults/{PATTERN}", BUCKET_BY, output=out,
                       storage_options=s3_options)


@pytest.fixture(autouse=True)
def _clean_proxies(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test starts with no faults, no latency and zeroed counters on both proxies."""
    proxies = [request.getfixturevalue(n) for n in ("http_proxy", "s3_proxy")
               if n in request.fixturenames]
    for proxy in proxies:
        proxy.clear_faults()
        proxy.reset_counters()
    yield
    for proxy in proxies:
        proxy.clear_faults()


def _ds(index: Index, **kw: Any) -> BucketedWebDataset:
    return make_dataset(index, **{"topology": SOLO, "seed": 5, "pad": "drop", **kw})  # each sample once


def _digest(batches: Any) -> list[list[tuple[str, str]]]:
    """(key, blake2b of every member) per sample, per batch."""
    out = []
    for batch in batches:
        row = []
        for s in batch:
            h = hashlib.blake2b(digest_size=12)
            for k in sorted(k for k in s if not k.startswith("__")):
                h.update(k.encode() + b"\0" + s[k])
            row.append((s["__key__"], h.hexdigest()))
        out.append(row)
    return out


@pytest.fixture(scope="module")
def http_clean(http_index: Index, http_proxy: FaultProxy) -> list[list[tuple[str, str]]]:
    """The fault-free stream over HTTP (checked against the plan once)."""
    http_proxy.clear_faults()
    ds = _ds(http_index)
    got = _digest(ds)
    assert [[k for k, _ in b] for b in got] == plan_keys(ds.plan(), http_index)
    return got


@pytest.fixture(scope="module")
def s3_clean(s3_index: Index, s3_options: dict[str, Any], s3_proxy: FaultProxy) -> list[list[tuple[str, str]]]:
    s3_proxy.clear_faults()
    return _digest(_ds(s3_index, storage_options=s3_options))


def _gets(proxy: FaultProxy, match: Callable[[Request], bool] = _ranged) -> int:
    return sum(1 for r in proxy.requests if match(r))


def _only(index: Index, i: int) -> Callable[[Request], bool]:
    """Matches the GET of sample ``i``'s byte range (and no other shard's same range)."""
    header = f"bytes={int(index.offset[i])}-{int(index.offset[i] + index.length[i]) - 1}"
    url = index.url(i)
    path = url[url.index("/", url.index("://") + 3):] if "://" in url else url
    bucket_path = "/" + url.split("://", 1)[1]  # s3://b/k -> /b/k (path-style on moto)
    return lambda r: r.header("range") == header and r.target in (path, bucket_path)


def _first_planned(index: Index, ds: BucketedWebDataset) -> int:
    return int(ds.plan()[0].samples[0])


# ---------------------------------------------------------------- transient faults


def test_http_transient_faults_are_retried_nothing_lost(http_index: Index, http_proxy: FaultProxy,
                                                        http_clean: list[Any]) -> None:
    http_proxy.set_latency(5)
    http_proxy.fail_randomly(0.2, status=503, match=_ranged)
    # aiohttp silently retries one reset on a pooled connection: two in a row reach us.
    http_proxy.reset_next(4, match=_ranged)
    options = ReadOptions(max_in_flight=8, retries=10, timeout=10, max_merged_bytes=0, **FAST)
    ds = _ds(http_index, read_options=options)
    got = _digest(ds)
    assert got == http_clean
    faults = http_proxy.faults_injected
    assert faults.get("fail", 0) >= 3 and faults.get("reset") == 4
    # One request per planned sample, plus exactly one more per injected fault.
    planned = sum(b.samples.size for b in ds.plan())
    assert _gets(http_proxy) == planned + faults["fail"] + faults["reset"]


def test_s3_transient_faults_are_retried_nothing_lost(s3_index: Index, s3_options: dict[str, Any],
                                                      s3_proxy: FaultProxy, s3_clean: list[Any]) -> None:
    s3_proxy.fail_randomly(0.15, status=500, match=_ranged)  # InternalError: only we retry it
    s3_proxy.fail_next(3, status=503, match=_ranged)  # SlowDown: s3fs retries it first
    s3_proxy.reset_next(3, match=_ranged)
    options = ReadOptions(max_in_flight=8, retries=10, timeout=10, **FAST)
    got = _digest(_ds(s3_index, storage_options=s3_options, read_options=options))
    assert got == s3_clean
    assert s3_proxy.faults_injected.get("fail", 0) >= 5 and s3_proxy.faults_injected["reset"] == 3


def test_http_bodies_cut_short_are_retried_nothing_lost(http_index: Index, http_proxy: FaultProxy,
                                                        http_clean: list[Any]) -> None:
    """A connection closed mid-body (fewer bytes than the Content-Length: aiohttp's
    ContentLengthError, which carries code 400) is transient: retried, nothing lost."""
    http_proxy.stall_next(3, mode=StallMode.CUT, match=_ranged)
    options = ReadOptions(max_in_flight=4, retries=5, timeout=10, max_merged_bytes=0, **FAST)
    ds = _ds(http_index, read_options=options)
    assert _digest(ds) == http_clean
    assert http_proxy.faults_injected.get("stall") == 3
    assert ds.read_stats.retries >= 3


def _raised(make: Callable[[], BaseException], cause: BaseException | None = None) -> BaseException:
    try:
        try:
            raise make()
        except BaseException as inner:
            if cause is None:
                raise
            raise cause from inner
    except BaseException as exc:  # noqa: BLE001 - the object as a client raises it
        return exc


def test_bodies_cut_short_are_transient_as_real_client_exceptions_say_it() -> None:
    import aiohttp
    import botocore.exceptions
    from aiohttp.http_exceptions import ContentLengthError, TransferEncodingError

    from wds_pad.io.faults import _classify

    short = _raised(lambda: ContentLengthError("Not enough data for satisfy content length header."))
    assert getattr(short, "code", None) == 400  # a status that alone would say "permanent"
    cases = [short,
             _raised(lambda: TransferEncodingError("Not enough data for satisfy transfer length header.")),
             _raised(lambda: ContentLengthError("short"), aiohttp.ClientPayloadError("Response payload is not completed")),
             _raised(lambda: aiohttp.ServerDisconnectedError()),
             botocore.exceptions.IncompleteReadError(actual_bytes=10, expected_bytes=100),
             botocore.exceptions.ResponseStreamingError(error=ConnectionResetError("reset by peer")),
             _raised(lambda: botocore.exceptions.IncompleteReadError(actual_bytes=1, expected_bytes=2),
                     OSError(5, "read failed"))]
    assert [_classify(e) for e in cases] == ["transient"] * len(cases)
    assert _classify(aiohttp.ClientResponseError(None, (), status=403)) == "permanent"  # type: ignore[arg-type]


@pytest.mark.parametrize("retries", [0, 3])
def test_retry_count_is_configurable(http_index: Index, http_proxy: FaultProxy, retries: int) -> None:
    i = 0
    only = _only(http_index, i)
    http_proxy.fail_randomly(1.0, status=503, match=only)  # this range always fails
    reader = RangeReader(ReadOptions(retries=retries, **FAST))
    with pytest.raises(ReadError, match=rf"failed after {retries + 1} attempts.*503") as info:
        reader.read(http_index.url(i), int(http_index.offset[i]), int(http_index.length[i]))
    assert http_index.url(i) in str(info.value)
    assert _gets(http_proxy, only) == retries + 1
    assert reader.stats.retries == retries


# ---------------------------------------------------------------- permanent faults


@pytest.mark.parametrize("status", [403, 404])
def test_http_permanent_status_fails_fast_without_retry(http_index: Index, http_proxy: FaultProxy,
                                                        status: int) -> None:
    ds = _ds(http_index, read_options=ReadOptions(retries=5, backoff=2.0, backoff_max=2.0))
    i = _first_planned(http_index, ds)
    only = _only(http_index, i)
    http_proxy.fail_randomly(1.0, status=status, match=only)
    with pytest.raises(ShardError) as info:
        list(ds)
    assert http_index.url(i) in str(info.value) and http_index.key(i) in str(info.value)
    # fails fast: asked once, never retried (counted by the proxy and by the reader)
    assert _gets(http_proxy, only) == 1
    assert ds.read_stats is not None and ds.read_stats.retries == 0


def test_http_missing_shard_is_a_shard_error_naming_it(nginx_server: Any, http_proxy: FaultProxy,
                                                        shard_dir: Path, tmp_path: Path) -> None:
    gone = nginx_server.root_dir / "faults" / "gone.tar"
    shutil.copy(shard_dir / "shard-000000.tar", gone)
    index = build_index(f"{http_proxy.url}/faults/gone.tar", None)
    gone.unlink()  # a real 404 from nginx
    http_proxy.reset_counters()
    ds = _ds(index, read_options=ReadOptions(backoff=2.0, backoff_max=2.0))
    with pytest.raises(ShardError, match=r"gone\.tar"):
        list(ds)
    assert ds.read_stats is not None and ds.read_stats.retries == 0  # fails fast: no retry
    asked = [r.header("range") for r in http_proxy.requests if _ranged(r)]
    assert asked and len(asked) == len(set(asked))  # several in flight, none asked twice


def test_s3_access_denied_and_missing_key_fail_fast(moto_server: MotoServer, s3_index: Index,
                                                    s3_options: dict[str, Any],
                                                    s3_proxy: FaultProxy) -> None:
    ds = _ds(s3_index, storage_options=s3_options,
             read_options=ReadOptions(retries=5, backoff=2.0, backoff_max=2.0))
    i = _first_planned(s3_index, ds)
    only = _only(s3_index, i)
    rule = s3_proxy.fail_randomly(1.0, status=403, match=only)
    with pytest.raises(ShardError, match="not readable with these credentials") as info:
        list(ds)
    assert _gets(s3_proxy, only) == 1  # fails fast: asked once, never retried
    assert ds.read_stats is not None and ds.read_stats.retries == 0
    assert s3_index.url(i) in str(info.value)
    rule.remaining = 0

    client = moto_server.client()
    client.copy_object(Bucket="wds-pad-faults", Key="doomed.tar",
                       CopySource={"Bucket": "wds-pad-faults", "Key": "shard-000001.tar"})
    doomed = build_index("s3://wds-pad-faults/doomed.tar", None, storage_options=s3_options)
    client.delete_object(Bucket="wds-pad-faults", Key="doomed.tar")
    s3_proxy.reset_counters()
    with pytest.raises(ShardError, match=r"s3://wds-pad-faults/doomed\.tar"):
        list(_ds(doomed, storage_options=s3_options,
                 read_options=ReadOptions(backoff=2.0, backoff_max=2.0)))
    asked = [r.header("range") for r in s3_proxy.requests if _ranged(r)]
    assert asked and len(asked) == len(set(asked))


def test_s3_403_with_many_reads_in_flight_is_one_error_and_nothing_on_stderr(
        s3_index: Index, s3_options: dict[str, Any], s3_proxy: FaultProxy,
        caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
    """Every ranged GET is refused while 32 are in flight: the first refusal is raised,
    the others are cancelled and their late errors retrieved, never printed by asyncio."""
    s3_proxy.set_latency(20)
    s3_proxy.fail_randomly(1.0, status=403, match=_ranged)
    ds = _ds(s3_index, storage_options=s3_options,
             read_options=ReadOptions(max_in_flight=32, max_merged_bytes=0, **FAST))
    for _ in range(4):
        with pytest.raises(ShardError, match="not readable with these credentials"):
            list(ds)
    assert _gets(s3_proxy) > 4  # many were in flight
    time.sleep(0.5)  # the cancelled ones finish on the IO loop
    gc.collect()
    never = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
    assert not never, never[0]
    err = capfd.readouterr().err
    assert "never retrieved" not in err and "Traceback" not in err, err


# ---------------------------------------------------------------- stalls and timeouts


# A stalled request never answers (it hangs until the reader gives up), so the stall is
# always far longer than the timeout. The timeout (1 s) is one for every request of a
# stream, and a request that is *not* stalled can reach it too: without nginx the HTTP
# upstream is the Python fallback server, whose listen backlog is socketserver's 5, so a
# burst of new connections loses a SYN and waits the kernel's 1 s retransmit; a busy
# machine makes that likelier, nginx or not. So what is asserted is about the stalled
# range alone: how often the proxy saw it, and the timeouts the reader logged for it
# (every retry is logged with the range and its cause); an unstalled request that timed
# out was retried like any other, and the stream's bytes show nothing was lost. Few
# requests are in flight (STALL_IN_FLIGHT): the connections a stream opens fit that
# backlog, requests still wait behind the stalled one in the read-ahead, and its retry
# runs alone. Elapsed time is asserted only as the lower bound a timeout implies.
SETTINGS = [pytest.param(1.0, 0, id="timeout1-retries0"), pytest.param(1.0, 2, id="timeout1-retries2")]
ONCE = [pytest.param(1.0, 1, id="timeout1-retries1"), pytest.param(1.0, 3, id="timeout1-retries3")]
STALL_IN_FLIGHT = 4


def _timeouts_of(caplog: pytest.LogCaptureFixture, index: Index, i: int) -> int:
    """Retries the reader logged for sample ``i``'s range after a timeout of it."""
    where = f"at byte offset {int(index.offset[i])} of {index.url(i)!r}"
    return sum(1 for r in caplog.records if r.name.startswith("wds_pad")
               and "retrying" in (m := r.getMessage()) and where in m and "TimeoutError" in m)


@pytest.mark.parametrize(("timeout", "retries"), ONCE)
@pytest.mark.parametrize("mode", [StallMode.REQUEST, StallMode.BODY])
def test_http_stall_once_times_out_and_the_retry_finishes(http_index: Index, http_proxy: FaultProxy,
                                                          http_clean: list[Any], timeout: float,
                                                          retries: int, mode: StallMode,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="wds_pad")
    options = ReadOptions(timeout=timeout, retries=retries, max_merged_bytes=0,
                          max_in_flight=STALL_IN_FLIGHT, **FAST)
    ds = _ds(http_index, read_options=options)
    i = _first_planned(http_index, ds)
    only = _only(http_index, i)
    http_proxy.stall_next(1, mode=mode, match=only)  # the first attempt stalls, the retry does not
    assert _digest(ds) == http_clean
    assert http_proxy.faults_injected == {"stall": 1}
    # the stalled attempt was cut by the timeout and retried; the retry finished: every
    # GET of the range but the last timed out (2 and 1 unless a busy machine made the
    # retry itself time out), and the last one answered
    timeouts = _timeouts_of(caplog, http_index, i)
    assert timeouts >= 1 and _gets(http_proxy, only) == timeouts + 1
    stats = ds.read_stats
    assert stats is not None and stats.timeouts >= timeouts and stats.retries >= timeouts, stats


def test_http_a_batch_leaves_with_its_last_sample_not_the_next_batchs_first(
        http_index: Index, http_proxy: FaultProxy, http_clean: list[Any]) -> None:
    """Batch 0 is handed out while the GET of batch 1's first sample still hangs: a batch
    waits for its own samples only, not for the next batch's first one to arrive."""
    options = ReadOptions(timeout=3.0, retries=1, max_merged_bytes=0, max_in_flight=STALL_IN_FLIGHT, **FAST)
    ds = _ds(http_index, read_options=options)
    only = _only(http_index, int(ds.plan()[1].samples[0]))
    http_proxy.stall_next(1, mode=StallMode.REQUEST, match=only)
    it = iter(ds)
    first = next(it)
    # at most the stalled attempt was sent: batch 0 did not wait for its timeout and retry
    assert _gets(http_proxy, only) <= 1
    assert _digest([first, *it]) == http_clean
    assert http_proxy.faults_injected == {"stall": 1} and _gets(http_proxy, only) == 2


def test_http_plan_batched_given_the_source_hands_a_batch_out_with_its_last_sample(
        http_index: Index, http_proxy: FaultProxy, http_clean: list[Any]) -> None:
    """The raw stages: ``plan_batched(source=...)`` ends a batch at the plan's size, so batch
    0 comes while the GET of batch 1's first sample hangs; without the source it comes only
    once that sample is there (after the timeout and the retry)."""
    options = ReadOptions(timeout=3.0, retries=1, max_merged_bytes=0, max_in_flight=STALL_IN_FLIGHT, **FAST)
    spec = _ds(http_index).spec
    only = _only(http_index, int(spec.plan(0)[1].samples[0]))
    for given in (True, False):
        http_proxy.reset_counters()
        http_proxy.stall_next(1, mode=StallMode.REQUEST, match=only)
        source = PlannedSource(spec, worker=(0, 1))
        it = plan_batched(source=source if given else None)(fetch(options)(iter(source)))
        first = next(it)
        if given:
            assert _gets(http_proxy, only) <= 1  # batch 0 did not wait for the hanging GET
        else:
            assert _gets(http_proxy, only) == 2  # it waited for the timeout and the retry
        assert _digest([first, *it]) == http_clean


@pytest.mark.parametrize(("timeout", "retries"), SETTINGS)
def test_http_always_stalled_range_fails_with_read_error_in_bounded_time(
        http_index: Index, http_proxy: FaultProxy, timeout: float, retries: int,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="wds_pad")
    options = ReadOptions(timeout=timeout, retries=retries, max_merged_bytes=0,
                          max_in_flight=STALL_IN_FLIGHT, **FAST)
    ds = _ds(http_index, read_options=options)
    i = _first_planned(http_index, ds)
    only = _only(http_index, i)
    http_proxy.add_rule(Rule(Fault.STALL, remaining=None, match=only))
    t0 = time.perf_counter()
    with pytest.raises(ReadError, match=rf"after {retries + 1} attempts.*TimeoutError.*{timeout} s") as info:
        list(ds)
    # every attempt waited its whole timeout (a lower bound: a busy machine only adds to
    # it); "never a hang" is the module's pytest timeout, the attempts are counted
    assert time.perf_counter() - t0 >= (retries + 1) * timeout
    assert http_index.url(i) in str(info.value)
    assert f"byte offset {int(http_index.offset[i])} " in str(info.value)
    assert _gets(http_proxy, only) == retries + 1
    # each attempt but the last timed out and was retried; the last one is the error
    assert _timeouts_of(caplog, http_index, i) == retries
    stats = ds.read_stats
    assert stats is not None and stats.timeouts >= retries + 1 and stats.retries >= retries, stats


def test_s3_stall_times_out_then_retry_or_read_error(s3_index: Index, s3_options: dict[str, Any],
                                                     s3_proxy: FaultProxy, s3_clean: list[Any],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="wds_pad")
    # moto is a Python server, slower than nginx under load: retries to spare for a slow
    # answer, here; the always-stalled part below has one retry
    options = ReadOptions(timeout=1.0, retries=3, max_merged_bytes=0,
                          max_in_flight=STALL_IN_FLIGHT, **FAST)
    ds = _ds(s3_index, storage_options=s3_options, read_options=options)
    i = _first_planned(s3_index, ds)
    only = _only(s3_index, i)
    s3_proxy.stall_next(1, match=only)
    assert _digest(ds) == s3_clean
    timeouts = _timeouts_of(caplog, s3_index, i)  # as over HTTP: all but the last GET timed out
    assert timeouts >= 1 and _gets(s3_proxy, only) == timeouts + 1
    assert ds.read_stats is not None and ds.read_stats.timeouts >= timeouts
    s3_proxy.reset_counters()
    caplog.clear()
    ds = _ds(s3_index, storage_options=s3_options,
             read_options=dataclasses.replace(options, retries=1))
    s3_proxy.add_rule(Rule(Fault.STALL, remaining=None, match=only))
    t0 = time.perf_counter()
    with pytest.raises(ReadError, match=r"after 2 attempts.*TimeoutError") as info:
        list(ds)
    assert time.perf_counter() - t0 >= 2 * 1.0  # both attempts waited their timeout
    assert s3_index.url(i) in str(info.value)
    assert _gets(s3_proxy, only) == 2
    assert _timeouts_of(caplog, s3_index, i) == 1  # the first, retried; the second is the error
    assert ds.read_stats.timeouts >= 2 and ds.read_stats.retries >= 1


# ---------------------------------------------------------------- credentials


KEY_ID = "AKIAWDSPADLEAKTEST42"
SECRET = "wdsPadS3cretNeverPrint-7f3e9a1c"
TOKEN = "wdspad-bearer-token-5b2c8d"


def test_credentials_never_appear_in_errors_logs_or_stderr(
        moto_server: MotoServer, s3_proxy: FaultProxy, http_proxy: FaultProxy, http_index: Index,
        caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, botocore and s3fs included
    s3_opts = {**moto_server.storage_options_via(s3_proxy.url), **RAW_S3,
               "key": KEY_ID, "secret": SECRET}
    http_opts = {"client_kwargs": {"headers": {"Authorization": f"Bearer {TOKEN}"}}}
    errors: list[BaseException] = []

    def provoke(fn: Callable[[], Any]) -> None:
        with pytest.raises(WdsPadError) as info:
            fn()
        errors.append(info.value)

    # Wrong bucket, at indexing and at reading.
    provoke(lambda: build_index("s3://no-such-bucket-wds-pad/x-{0..1}.tar", None, storage_options=s3_opts))
    provoke(lambda: RangeReader(ReadOptions(storage_options=s3_opts)).read("s3://no-such-bucket-wds-pad/x.tar", 0, 9))
    provoke(lambda: load_index("s3://no-such-bucket-wds-pad/i.wdsidx", storage_options=s3_opts))
    url = "s3://wds-pad-faults/shard-000000.tar"
    # 403, a transient fault outlasting its retries, and a stall, through the proxy.
    s3_proxy.fail_next(1, status=403, match=_ranged)
    provoke(lambda: RangeReader(ReadOptions(storage_options=s3_opts)).read(url, 0, 512))
    s3_proxy.fail_randomly(1.0, status=500, match=_ranged)
    provoke(lambda: RangeReader(ReadOptions(storage_options=s3_opts, retries=1, **FAST)).read(url, 0, 512))
    s3_proxy.clear_faults()
    s3_proxy.stall_next(2, match=_ranged)
    provoke(lambda: RangeReader(ReadOptions(storage_options=s3_opts, retries=1, timeout=0.3, **FAST)
                                ).read(url, 0, 512))
    # The same over HTTP with a bearer token.
    http_proxy.fail_next(1, status=403, match=_ranged)
    provoke(lambda: RangeReader(ReadOptions(storage_options=http_opts)).read(http_index.url(0), 0, 512))
    http_proxy.stall_next(1, match=_ranged)
    provoke(lambda: RangeReader(ReadOptions(storage_options=http_opts, retries=0, timeout=0.3)
                                ).read(http_index.url(0), 0, 512))
    # The credentials were really sent (so they could have leaked).
    assert any(f"Credential={KEY_ID}/" in (r.header("authorization") or "") for r in s3_proxy.requests)
    assert any(r.header("authorization") == f"Bearer {TOKEN}" for r in http_proxy.requests)

    assert len(errors) == 8
    assert isinstance(errors[5], ReadError) and isinstance(errors[3], ShardError)
    texts = ["".join(traceback.format_exception(e)) for e in errors]
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("wds_pad")]
    assert any("retrying" in m for m in ours)  # retries are logged, redacted
    captured = capfd.readouterr()
    everything = "\n".join([*texts, *(r.getMessage() for r in caplog.records), captured.out,
                            captured.err, caplog.text])
    assert SECRET not in everything and TOKEN not in everything
    # botocore itself logs the signed Authorization header (with the key id) at DEBUG;
    # our own messages and tracebacks never carry it.
    assert not [t for t in [*texts, *ours] if KEY_ID in t]


def test_s3_http_403_with_unknown_error_code_is_not_retried(
        moto_server: MotoServer, s3_index: Index, fault_proxy: Any) -> None:
    proxy: FaultProxy = fault_proxy(moto_server)  # the stock proxy: 403 with Code InternalError
    options = {**moto_server.storage_options_via(proxy.url), **RAW_S3}
    reader = RangeReader(ReadOptions(storage_options=options, retries=3, **FAST))
    proxy.fail_next(1, status=403, match=_ranged)
    with pytest.raises(ShardError):
        reader.read(s3_index.url(0), 0, 512)
    assert _gets(proxy) == 1
