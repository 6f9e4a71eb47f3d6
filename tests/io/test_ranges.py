"""Tests of wds_pad.io.ranges: exact bytes, order, merging, memory bound, errors, fork,
retries, changed shards.

Remote behaviour runs against a small HTTP server on 127.0.0.1 (Range requests, delays
and scripted faults) and against fake fsspec filesystems registered here; local and
memory:// shards come from tests/io/conftest.py. The read-ahead, filesystems, redaction
and store faults have their own test files (test_readahead, test_fs, test_redact,
test_store_faults).
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import re
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import fsspec
import pytest
from fsspec.asyn import AsyncFileSystem
from fsspec.spec import AbstractFileSystem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wds_pad.errors import ConfigError, ReadError, ShardError, StaleShardError
from wds_pad.io.fs import get_filesystem
from wds_pad.io.ranges import RangeReader, ReadOptions

FAST = dict(backoff=0.01, backoff_max=0.02, timeout=2.0)


# ---------------------------------------------------------------- fixtures


class _State:
    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.delay = 0.0
        self.stall = 0.0
        self.faults: deque[str] = deque()
        self.requests = 0
        self.active = 0  # requests inside their delay right now, and the most at once
        self.peak_active = 0
        self.etags: dict[str, str] = {}  # path -> ETag header of its answers
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, *args: object) -> None:
        pass

    def setup(self) -> None:
        super().setup()  # headers and body go out in two writes: no Nagle delay
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _send(self, status: int, body: bytes = b"",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        state: _State = self.server.state
        with state.lock:
            state.requests += 1
            fault = state.faults.popleft() if state.faults else None
        if state.delay:
            with state.lock:
                state.active += 1
                state.peak_active = max(state.peak_active, state.active)
            time.sleep(state.delay)
            with state.lock:
                state.active -= 1
        if fault == "503":
            return self._send(503, b"busy")
        if fault == "403":
            return self._send(403, b"forbidden")
        if fault == "norange":
            return self._send(200, state.files["/a.tar"])
        if fault == "reset":  # RST instead of an answer
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return None
        if fault == "stall":
            time.sleep(state.stall)
            self.close_connection = True
            return None
        data = state.files.get(self.path.split("?")[0])
        if data is None:
            return self._send(404, b"no such file")
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if m is None:
            return self._send(200, data)
        start = int(m.group(1))
        end = min(int(m.group(2)) + 1 if m.group(2) else len(data), len(data))
        if start >= len(data):
            return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
        etag = state.etags.get(self.path.split("?")[0])
        return self._send(206, data[start:end],
                          {"Content-Range": f"bytes {start}-{end - 1}/{len(data)}",
                           **({"ETag": etag} if etag else {})})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # 32 parallel connects must not overflow the backlog
    block_on_close = False

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # resets and stalls break pipes on purpose


@pytest.fixture()
def http() -> Iterator[tuple[str, _State]]:
    state = _State({"/a.tar": os.urandom(200_000), "/b.tar": os.urandom(50_000)})
    server = _Server(("127.0.0.1", 0), _Handler)
    server.state = state  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.shutdown()
    server.server_close()


class FakeFS(AbstractFileSystem):
    """A sync fs over FakeFS.files: per-offset delays and scripted exceptions."""

    protocol = "wdsfake"
    files: dict[str, bytes] = {}
    delays: dict[int, float] = {}
    faults: deque[BaseException] = deque()
    calls: list[tuple[str, int, int]] = []
    done: list[int] = []
    lock = threading.Lock()

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **kwargs: Any) -> bytes:
        path = self._strip_protocol(path)
        with FakeFS.lock:
            FakeFS.calls.append((path, start or 0, end or 0))
            fault = FakeFS.faults.popleft() if FakeFS.faults else None
        time.sleep(FakeFS.delays.get(start or 0, 0.0))
        if fault is not None:
            raise fault
        if path not in FakeFS.files:
            raise FileNotFoundError(path)
        data = FakeFS.files[path][start:end]
        with FakeFS.lock:
            FakeFS.done.append(start or 0)
        return data


fsspec.register_implementation("wdsfake", FakeFS, clobber=True)


@pytest.fixture()
def fake() -> type[FakeFS]:
    FakeFS.files = {"x.tar": os.urandom(300_000)}
    FakeFS.delays, FakeFS.faults, FakeFS.calls, FakeFS.done = {}, deque(), [], []
    return FakeFS


# ---------------------------------------------------------------- exact bytes and order


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), in_flight=st.integers(1, 8), gap=st.integers(0, 64),
       merged=st.sampled_from([0, 100, 10_000]))
def test_random_ranges_give_exact_bytes(shards: dict[str, bytes], data: st.DataObject,
                                        in_flight: int, gap: int, merged: int) -> None:
    urls = sorted(shards)
    ranges = []
    for _ in range(data.draw(st.integers(0, 40))):
        url = data.draw(st.sampled_from(urls))
        offset = data.draw(st.integers(0, len(shards[url])))
        length = data.draw(st.integers(0, min(2_000, len(shards[url]) - offset)))
        ranges.append((url, offset, length))
    reader = RangeReader(ReadOptions(max_in_flight=in_flight, merge_gap=gap,
                                     max_merged_bytes=merged, max_bytes_in_flight=20_000))
    out = list(reader.read_many(ranges))
    assert out == [shards[u][o:o + n] for u, o, n in ranges]
    assert reader.stats.ranges == len(ranges)
    if ranges:
        assert reader.read(*ranges[-1]) == out[-1]


def test_order_is_input_order_when_completion_is_not(fake: type[FakeFS]) -> None:
    ranges = [("wdsfake://x.tar", 1000 * i, 500) for i in range(16)]
    fake.delays = {1000 * i: 0.002 * ((i * 7) % 16) for i in range(16)}
    reader = RangeReader(ReadOptions(max_in_flight=16))
    out = list(reader.read_many(ranges))
    assert out == [fake.files["x.tar"][o:o + n] for _, o, n in ranges]
    assert fake.done != sorted(fake.done)  # the fetches did finish out of order
    assert reader.stats.peak_requests_in_flight > 1


def test_adjacent_ranges_are_merged_into_fewer_requests(fake: type[FakeFS]) -> None:
    ranges = [("wdsfake://x.tar", 1000 * i, 1000) for i in range(100)]
    reader = RangeReader(ReadOptions(max_merged_bytes=10_000))
    assert list(reader.read_many(ranges)) == [fake.files["x.tar"][o:o + n] for _, o, n in ranges]
    assert len(fake.calls) == reader.stats.requests == 10
    assert reader.stats.merged == 90


def test_merge_gap_controls_merging_across_holes(fake: type[FakeFS]) -> None:
    ranges = [("wdsfake://x.tar", 1010 * i, 1000) for i in range(20)]  # 10-byte holes
    expected = [fake.files["x.tar"][o:o + n] for _, o, n in ranges]
    exact = RangeReader(ReadOptions(merge_gap=0))
    assert list(exact.read_many(ranges)) == expected
    assert exact.stats.requests == 20
    gapped = RangeReader(ReadOptions(merge_gap=10))
    assert list(gapped.read_many(ranges)) == expected
    assert gapped.stats.requests == 1 and gapped.stats.merged == 19


def test_merging_reduces_http_requests(http: tuple[str, _State]) -> None:
    base, state = http
    ranges = [(f"{base}/a.tar", 500 * i, 500) for i in range(40)]
    reader = RangeReader(ReadOptions(max_merged_bytes=5_000, **FAST))
    assert list(reader.read_many(ranges)) == [state.files["/a.tar"][o:o + n] for _, o, n in ranges]
    assert state.requests == reader.stats.requests == 4


def test_read_ahead_respects_the_memory_bound(fake: type[FakeFS]) -> None:
    sizes = [(i * 7919) % 20_000 + 1 for i in range(60)]
    offsets = [sum(sizes[:i]) + 7 * i for i in range(60)]  # holes: no merging
    ranges = [("wdsfake://x.tar", o, n) for o, n in zip(offsets, sizes)]
    fake.files = {"x.tar": os.urandom(offsets[-1] + sizes[-1])}
    fake.delays = {o: 0.001 for o in offsets}
    bound = 50_000
    reader = RangeReader(ReadOptions(max_in_flight=64, max_bytes_in_flight=bound))
    out = []
    for chunk in reader.read_many(ranges):
        out.append(chunk)
        time.sleep(0.0005)
    assert out == [fake.files["x.tar"][o:o + n] for _, o, n in ranges]
    peak = reader.stats.peak_bytes_in_flight
    assert bound // 2 < peak <= max(bound, max(sizes))
    loose = RangeReader(ReadOptions(max_in_flight=64))
    assert len(list(loose.read_many(ranges))) == 60
    assert loose.stats.peak_bytes_in_flight > bound  # the bound is what held it back


def test_a_range_larger_than_the_bound_still_reads(fake: type[FakeFS]) -> None:
    reader = RangeReader(ReadOptions(max_bytes_in_flight=1_000, max_merged_bytes=1_000))
    ranges = [("wdsfake://x.tar", 0, 600), ("wdsfake://x.tar", 600, 250_000),
              ("wdsfake://x.tar", 250_600, 600)]
    assert list(reader.read_many(ranges)) == [fake.files["x.tar"][o:o + n] for _, o, n in ranges]
    assert reader.stats.peak_bytes_in_flight == 250_000


def test_closing_the_iterator_early_is_clean(http: tuple[str, _State]) -> None:
    base, state = http
    reader = RangeReader(ReadOptions(max_in_flight=8, **FAST))
    it = reader.read_many((f"{base}/a.tar", 1000 * i, 100) for i in range(100))
    assert next(it) == state.files["/a.tar"][:100]
    it.close()
    assert reader.read(f"{base}/b.tar", 5, 10) == state.files["/b.tar"][5:15]


# ---------------------------------------------------------------- errors


def test_missing_local_file_is_a_shard_error(tmp_path: Any) -> None:
    reader = RangeReader(ReadOptions(backoff=5.0, backoff_max=5.0))
    with pytest.raises(ShardError, match="nope.tar"):
        reader.read(str(tmp_path / "nope.tar"), 0, 10)
    with pytest.raises(ShardError, match=r"byte offset 7 .*nope\.tar"):
        reader.read("memory://wdsread/nope.tar", 7, 10)
    assert reader.stats.retries == 0  # fails fast: no retry (each would have slept 5 s)


def test_http_404_and_403_fail_fast_without_retries(http: tuple[str, _State]) -> None:
    base, state = http
    reader = RangeReader(ReadOptions(backoff=5.0, backoff_max=5.0))
    with pytest.raises(ShardError, match=r"byte offset 3 of 'http://127\.0\.0\.1:\d+/gone\.tar'"):
        reader.read(f"{base}/gone.tar", 3, 10)
    state.faults.append("403")
    with pytest.raises(ShardError, match="403"):
        reader.read(f"{base}/a.tar", 0, 10)
    assert state.requests == 2 and reader.stats.retries == 0  # fail fast: each asked once


def test_short_read_is_a_stale_shard_error(tmp_path: Any, http: tuple[str, _State]) -> None:
    path = tmp_path / "shrunk.tar"
    path.write_bytes(b"x" * 1000)
    reader = RangeReader(ReadOptions(**FAST))
    with pytest.raises(StaleShardError, match=r"shrunk\.tar.*byte offset 900"):
        list(reader.read_many([(str(path), 0, 10), (str(path), 900, 200)]))
    fsspec.filesystem("memory").pipe("/wdsread/short.tar", b"y" * 100)
    with pytest.raises(StaleShardError, match=r"byte offset 90\b"):
        reader.read("memory://wdsread/short.tar", 90, 20)
    base, _ = http
    with pytest.raises(StaleShardError, match=r"b\.tar.*byte offset 49990"):
        reader.read(f"{base}/b.tar", 49_990, 20)
    with pytest.raises(StaleShardError, match=r"byte offset 60000"):  # 416 from the server
        reader.read(f"{base}/b.tar", 60_000, 20)
    merged = [(f"{base}/b.tar", 49_000, 500), (f"{base}/b.tar", 49_500, 800)]
    it = RangeReader(ReadOptions(**FAST)).read_many(merged)
    with pytest.raises(StaleShardError, match=r"byte offset 49500"):
        list(it)


def test_a_server_ignoring_range_is_reported_not_sliced_silently(
        http: tuple[str, _State]) -> None:
    base, state = http
    state.faults.append("norange")
    with pytest.raises(ReadError, match=r"a\.tar.*ignored the Range header"):
        RangeReader(ReadOptions(**FAST)).read(f"{base}/a.tar", 100, 10)


def test_bad_ranges_and_options_are_config_errors() -> None:
    reader = RangeReader()
    for bad in [("memory://x", -1, 3), ("memory://x", 0, -3), ("memory://x", 1.5, 3),
                (b"memory://x", 0, 1), ("memory://x", 0)]:
        with pytest.raises(ConfigError):
            list(reader.read_many([bad]))  # type: ignore[list-item]
    with pytest.raises(ConfigError):
        list(reader.read_many([("/tmp", -5, 1)]))
    for kwargs in [dict(max_in_flight=0), dict(max_bytes_in_flight=-1), dict(merge_gap=-1),
                   dict(retries=-1), dict(timeout=0), dict(timeout=float("inf")),
                   dict(backoff=-0.1), dict(backoff=2.0, backoff_max=1.0),
                   dict(max_in_flight=True), dict(storage_options=[1])]:
        with pytest.raises(ConfigError):
            ReadOptions(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------- retries and timeouts


def test_transient_http_faults_are_retried_nothing_lost(http: tuple[str, _State]) -> None:
    base, state = http
    state.faults.extend(["503", "reset", "503", "reset"])
    ranges = [(f"{base}/a.tar", 1000 * i, 300) for i in range(30)]
    reader = RangeReader(ReadOptions(max_in_flight=4, **FAST))
    assert list(reader.read_many(ranges)) == [state.files["/a.tar"][o:o + n] for _, o, n in ranges]
    assert reader.stats.retries >= 2  # aiohttp itself retries a reset on a pooled connection
    assert state.requests == 34 and not state.faults
    assert reader.stats.ranges == 30


def test_transient_sync_faults_are_retried(fake: type[FakeFS]) -> None:
    fake.faults.extend([ConnectionResetError("peer reset"), OSError(5, "EIO"), TimeoutError()])
    ranges = [("wdsfake://x.tar", 2000 * i, 100) for i in range(10)]
    reader = RangeReader(ReadOptions(max_in_flight=1, **FAST))
    assert list(reader.read_many(ranges)) == [fake.files["x.tar"][o:o + n] for _, o, n in ranges]
    assert reader.stats.retries == 3
    assert sorted(fake.done) == [o for _, o, _ in ranges]  # each range delivered once


def test_exhausted_retries_raise_read_error_naming_everything(fake: type[FakeFS]) -> None:
    fake.faults.extend([ConnectionResetError("peer reset")] * 10)
    reader = RangeReader(ReadOptions(retries=2, **FAST))
    with pytest.raises(ReadError) as info:
        reader.read("wdsfake://x.tar", 123, 45)
    msg = str(info.value)
    for part in ("wdsfake://x.tar", "45 bytes", "byte offset 123", "3 attempts",
                 "ConnectionResetError", "ReadOptions.retries"):
        assert part in msg
    assert len(fake.calls) == 3


def test_stalled_request_times_out_then_retry_succeeds(http: tuple[str, _State]) -> None:
    base, state = http
    # a stall far longer than the timeout, and a timeout no answer that does not stall
    # comes near on a busy machine: the count of timeouts is the proof, not elapsed time
    state.stall = 20.0
    state.faults.append("stall")
    reader = RangeReader(ReadOptions(timeout=1.0, backoff=0.01, backoff_max=0.01))
    assert reader.read(f"{base}/a.tar", 10, 20) == state.files["/a.tar"][10:30]
    assert reader.stats.timeouts == 1 and reader.stats.retries == 1 and state.requests == 2


def test_always_stalled_request_fails_in_bounded_time(http: tuple[str, _State]) -> None:
    base, state = http
    state.stall = 20.0  # every attempt stalls far longer than its timeout
    state.faults.extend(["stall"] * 5)
    reader = RangeReader(ReadOptions(timeout=0.15, retries=2, backoff=0.01, backoff_max=0.01))
    with pytest.raises(ReadError, match=r"3 attempts.*TimeoutError.*ReadOptions\.timeout"):
        reader.read(f"{base}/a.tar", 10, 20)
    # bounded: three attempts, each cut by its timeout (never a wait for a stall to end)
    assert state.requests == 3 and reader.stats.timeouts == 3 and reader.stats.retries == 2


def test_backoff_is_deterministic_and_capped() -> None:
    from wds_pad.io.remote import backoff_delay

    opts = ReadOptions(backoff=0.2, backoff_max=1.0)
    delays = [backoff_delay(opts, "s3://b/x.tar", 10, a) for a in range(1, 8)]
    assert delays == [backoff_delay(opts, "s3://b/x.tar", 10, a) for a in range(1, 8)]
    assert 0.1 <= delays[0] <= 0.2 and all(0.5 <= d <= 1.0 for d in delays[3:])
    assert delays != [backoff_delay(opts, "s3://b/y.tar", 10, a) for a in range(1, 8)]


# ---------------------------------------------------------------- concurrency


def test_many_in_flight_hide_latency(http: tuple[str, _State]) -> None:
    """Requests overlap at the server (counted there and by the reader), not "it was
    fast": throughput against one at a time is tools/bench/remote.py's ratio."""
    base, state = http
    state.delay = 0.1
    peaks = {}
    for n, count in ((1, 8), (32, 32)):
        ranges = [(f"{base}/a.tar", 1000 * i, 100) for i in range(count)]
        state.peak_active = 0
        reader = RangeReader(ReadOptions(max_in_flight=n, **FAST))
        assert len(list(reader.read_many(ranges))) == count
        assert reader.stats.peak_requests_in_flight == n and reader.stats.requests == count
        peaks[n] = state.peak_active
    # one at a time never overlaps; 32 in flight overlap inside the server's 100 ms delay
    assert peaks[1] == 1 and peaks[32] >= 8, peaks


# ---------------------------------------------------------------- fork and pickling


_FORK_READER: RangeReader | None = None


def _child(conn: Any, urls: list[str], parent_fs: list[Any]) -> None:
    try:
        fresh = [get_filesystem(u)[0] is not old for u, old in zip(urls, parent_fs)]
        assert _FORK_READER is not None
        data = list(_FORK_READER.read_many([(u, 10, 100) for u in urls]))
        conn.send((fresh, data))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(repr(exc))
    finally:
        conn.close()


def test_forked_child_gets_fresh_filesystems_and_reads(shards: dict[str, bytes],
                                                       http: tuple[str, _State],
                                                       fake: type[FakeFS]) -> None:
    global _FORK_READER
    base, state = http
    urls = [f"{base}/a.tar", "memory://wdsread/s0.tar", next(u for u in shards if "/" == u[0]),
            "wdsfake://x.tar"]
    _FORK_READER = RangeReader(ReadOptions(max_in_flight=4, **FAST))
    list(_FORK_READER.read_many([(u, 0, 10) for u in urls]))  # parent warms every cache
    parent_fs = [get_filesystem(u)[0] for u in urls]
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, urls, parent_fs))
    proc.start()
    send.close()
    assert recv.poll(20), "child hung: it reused the parent's IO loop or pool"
    result = recv.recv()
    proc.join(5)
    assert not isinstance(result, str), result
    fresh, data = result
    assert fresh == [True] * 4
    expected = [state.files["/a.tar"][10:110], shards["memory://wdsread/s0.tar"][10:110],
                shards[urls[2]][10:110], fake.files["x.tar"][10:110]]
    assert data == expected
    assert list(_FORK_READER.read_many([(u, 10, 100) for u in urls])) == expected


def test_reader_pickles_as_its_options() -> None:
    import pickle

    reader = RangeReader(ReadOptions(max_in_flight=3))
    clone = pickle.loads(pickle.dumps(reader))
    assert clone.options == reader.options and clone.stats.requests == 0


# ---------------------------------------------------------------- credentials in messages


def test_error_messages_never_carry_secrets(fake: type[FakeFS], http: tuple[str, _State]) -> None:
    secret = "SuperSecretValue42"
    opts = ReadOptions(retries=1, storage_options={"wdsfake": {"secret": secret}}, **FAST)
    assert secret not in repr(opts)
    reader = RangeReader(opts)
    fake.faults.extend([PermissionError(f"denied for secret {secret}")])
    with pytest.raises(ShardError) as info:
        reader.read("wdsfake://x.tar", 0, 10)
    fake.faults.extend([ConnectionResetError(f"reset while using {secret}")] * 2)
    with pytest.raises(ReadError) as info2:
        reader.read("wdsfake://x.tar", 0, 10)
    base, _ = http
    userinfo = base.replace("http://", "http://bob:pa55word@")
    with pytest.raises(ShardError) as info3:
        reader.read(f"{userinfo}/missing.tar", 0, 10)
    for exc in (info.value, info2.value, info3.value):
        chain = f"{exc} {exc.__cause__} {exc.__context__}"
        assert secret not in chain and "pa55word" not in chain, chain
        assert "byte offset 0" in str(exc)


# ---------------------------------------------------------------- cancelled requests that fail late


class LateFailFS(AsyncFileSystem):
    """An async fs whose range at offset 0 fails at once and every other one fails late,
    even when cancelled (as a client whose cleanup outlives the cancel)."""

    protocol = "wdslate"
    failed: list[int] = []

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None,
                        **kwargs: Any) -> bytes:
        if start:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                pass
            LateFailFS.failed.append(start)
        raise PermissionError(f"denied: {path} at {start}")


fsspec.register_implementation("wdslate", LateFailFS, clobber=True)


def test_a_failure_cancels_what_is_in_flight_and_nothing_is_printed(
        caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
    LateFailFS.failed = []
    reader = RangeReader(ReadOptions(max_in_flight=16, max_merged_bytes=0, **FAST))
    with pytest.raises(ShardError, match=r"byte offset 0 of .wdslate://x\.tar"):
        list(reader.read_many(("wdslate://x.tar", i * 100, 100) for i in range(64)))
    deadline = time.monotonic() + 30
    while len(LateFailFS.failed) < 15 and time.monotonic() < deadline:  # the 15 others, cancelled
        time.sleep(0.01)
    assert sorted(LateFailFS.failed) == [i * 100 for i in range(1, 16)]
    time.sleep(0.1)  # their tasks finish on the IO loop
    gc.collect()
    never = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert not never, never[0].getMessage()
    err = capfd.readouterr().err
    assert "never retrieved" not in err and "Traceback" not in err, err


# ---------------------------------------------------------------- S3 protocol (moto on loopback)


@pytest.fixture(scope="module")
def s3() -> Iterator[tuple[dict[str, Any], bytes]]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = "http://127.0.0.1:%d" % server.get_host_and_port()[1]
    creds = {"key": "AKIAWDSPADTEST0001", "secret": "wdsPadS3cret/Value"}
    writer = fsspec.filesystem("s3", endpoint_url=endpoint, skip_instance_cache=True, **creds)
    writer.mkdir("wds-bucket")
    blob = os.urandom(120_000)
    writer.pipe("wds-bucket/train-000.tar", blob)
    yield {"s3": {"endpoint_url": endpoint, **creds}}, blob
    server.stop()


def test_s3_ranges_merges_and_errors(s3: tuple[dict[str, Any], bytes]) -> None:
    options, blob = s3
    reader = RangeReader(ReadOptions(storage_options=options, max_merged_bytes=4_000, **FAST))
    ranges = [("s3://wds-bucket/train-000.tar", 1000 * i, 1000) for i in range(40)]
    ranges += [("s3://wds-bucket/train-000.tar", 97_000 - 3000 * i, 700) for i in range(20)]
    assert list(reader.read_many(ranges)) == [blob[o:o + n] for _, o, n in ranges]
    assert reader.stats.requests == 10 + 20 and reader.stats.merged == 30
    errors = []
    for rng, kind in [(("s3://wds-bucket/nope.tar", 5, 10), ShardError),
                      (("s3://no-such-bucket/x.tar", 5, 10), ShardError),
                      (("s3://wds-bucket/train-000.tar", 119_990, 20), StaleShardError),
                      (("s3://wds-bucket/train-000.tar", 200_000, 20), StaleShardError)]:
        with pytest.raises(kind, match=f"byte offset {rng[1]}") as info:
            reader.read(*rng)
        errors.append(info.value)
    assert reader.stats.retries == 0  # fail fast: none of them retried
    for exc in errors:
        chain = f"{exc} {exc.__cause__}"
        assert options["s3"]["secret"] not in chain and options["s3"]["key"] not in chain


# ---------------------------------------------------------------- descriptors


def test_reader_closes_its_descriptors_when_collected(local_files: dict[str, bytes]) -> None:
    import gc

    reader = RangeReader()
    list(reader.read_many([(u, 0, 10) for u in local_files]))
    fds = list(reader._fds.values())
    assert len(fds) == 5
    for fd in fds:
        os.fstat(fd)
    del reader
    gc.collect()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


# ---------------------------------------------------------------- changed shards


def _change(path: Any, how: str) -> None:
    """Change a shard so that its indexed byte ranges still read: append bytes, edit a
    payload byte in place (same size, a new mtime), or replace it by another file."""
    stat = os.stat(path)
    if how == "append":
        with open(path, "ab") as f:
            f.write(b"\0" * 1024)
    elif how == "edit":
        with open(path, "r+b") as f:
            f.seek(700)
            byte = f.read(1)
            f.seek(700)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:  # replaced: another file of the same size takes its name
        data = bytearray(open(path, "rb").read())
        data[700] ^= 0xFF
        other = f"{path}.new"
        with open(other, "wb") as f:
            f.write(data)
        os.replace(other, path)
    # an mtime surely distinct from the indexed one (a filesystem's clock ticks coarsely)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))


@pytest.mark.parametrize("how", ["append", "edit", "replace"])
def test_local_shard_changed_since_indexing_is_stale_when_first_opened(tmp_path: Any,
                                                                       how: str) -> None:
    from wds_pad.index.shardfile import shard_info

    paths = [str(tmp_path / f"s{i}.tar") for i in range(2)]
    for p in paths:
        with open(p, "wb") as f:
            f.write(os.urandom(8_000))
    expected = {p: shard_info(p) for p in paths}  # what the index records
    assert expected[paths[0]][1].startswith("mtime=")
    _change(paths[0], how)
    reader = RangeReader(ReadOptions(local_threads=0), expected=expected)
    assert reader.read(paths[1], 0, 10) == open(paths[1], "rb").read(10)  # unchanged: as before
    for _ in range(2):  # every range of the changed shard, not just the first
        with pytest.raises(StaleShardError) as info:
            list(reader.read_many([(paths[1], 10, 10), (paths[0], 100, 10)]))
        msg = str(info.value)
        size, stamp = expected[paths[0]]
        assert paths[0] in msg and "wds-pad index" in msg and "--update" in msg
        assert f"the index records {size} bytes, {stamp}" in msg
        assert f"now has {os.path.getsize(paths[0])} bytes, mtime=" in msg
    with pytest.raises(StaleShardError):  # the descriptor path of the read-ahead too
        reader.local_fd(paths[0])
    # without the index's records the reader reads the changed shard as it is
    assert RangeReader().read(paths[0], 100, 10) == open(paths[0], "rb").read()[100:110]


def test_local_check_is_one_fstat_per_shard(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from wds_pad.index.shardfile import shard_info

    paths = [str(tmp_path / f"s{i}.tar") for i in range(3)]
    for p in paths:
        with open(p, "wb") as f:
            f.write(os.urandom(20_000))
    reader = RangeReader(expected={p: shard_info(p) for p in paths})
    calls = []
    real = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: calls.append(fd) or real(fd))
    ranges = [(paths[i % 3], 10 * i, 10) for i in range(300)]
    assert list(reader.read_many(ranges)) == [open(u, "rb").read()[o:o + n] for u, o, n in ranges]
    assert len(calls) == 3
    reader._fds.clear()  # descriptors evicted and opened again: still checked only once
    list(reader.read_many(ranges))
    assert len(calls) == 3


@pytest.mark.parametrize("how", ["append", "replace"])
def test_http_shard_changed_is_stale_from_the_get_headers_alone(http: tuple[str, _State],
                                                                how: str) -> None:
    base, state = http
    url, other = f"{base}/a.tar", f"{base}/b.tar"
    state.etags = {"/a.tar": '"v1"', "/b.tar": '"b1"'}
    expected = {url: (200_000, 'ETag="v1"'), other: (50_000, 'ETag="b1"')}
    reader = RangeReader(ReadOptions(**FAST), expected=expected)
    assert reader.read(other, 5, 10) == state.files["/b.tar"][5:15]  # unchanged: as before
    if how == "append":
        state.files["/a.tar"] += b"\0" * 100
    else:  # same size, another version
        state.etags["/a.tar"] = '"v2"'
    state.requests = 0
    for _ in range(2):
        with pytest.raises(StaleShardError) as info:
            reader.read(url, 1_000, 100)
        msg = str(info.value)
        assert url in msg and "the index records 200000 bytes" in msg and "--update" in msg
        assert ("200100 bytes" in msg) if how == "append" else ('ETag="v2"' in msg)
    assert state.requests == 1  # the first GET told: no HEAD, and no GET after it
    # a stamp of another kind is not compared with the ETag: only the size is
    reader = RangeReader(ReadOptions(**FAST), expected={url: (len(state.files["/a.tar"]),
                                                              "mtime=1.5")})
    assert reader.read(url, 0, 10) == state.files["/a.tar"][:10]


def test_s3_shard_changed_is_stale_from_the_get_headers_alone(s3: tuple[dict[str, Any], bytes]) -> None:
    from wds_pad.index.shardfile import shard_info

    options, _ = s3
    writer = fsspec.filesystem("s3", skip_instance_cache=True, endpoint_url=options["s3"]["endpoint_url"],
                               key=options["s3"]["key"], secret=options["s3"]["secret"])
    urls = [f"s3://wds-bucket/changed-{i}.tar" for i in range(3)]
    blob = os.urandom(30_000)
    for u in urls:
        writer.pipe(u, blob)
    expected = {u: shard_info(u, options) for u in urls}
    assert all(stamp.startswith("ETag=") for _, stamp in expected.values())
    writer.pipe(urls[0], blob + b"\0" * 10)  # appended
    writer.pipe(urls[1], bytes(reversed(blob)))  # same size, another object
    reader = RangeReader(ReadOptions(storage_options=options, **FAST), expected=expected)
    assert reader.read(urls[2], 100, 50) == blob[100:150]  # unchanged: as before
    for u, what in ((urls[0], "30010 bytes"), (urls[1], "ETag=")):
        with pytest.raises(StaleShardError) as info:
            reader.read(u, 100, 50)
        msg = str(info.value)
        assert u in msg and what in msg and expected[u][1] in msg and "--update" in msg
        assert options["s3"]["secret"] not in msg
    assert reader.stats.requests == 3  # one GET per read: the check needs no request of its own
    with pytest.raises(StaleShardError):
        reader.read(urls[0], 200, 50)
    assert reader.stats.requests == 4  # counted as submitted; answered without a request
