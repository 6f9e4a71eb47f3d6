"""Tests of wds_pad.io.ranges: exact bytes, order, merging, memory bound, errors, fork, retries.

Remote behaviour runs against a small HTTP server on 127.0.0.1 (Range requests, delays
and scripted faults) and against fake fsspec filesystems registered here.
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

import botocore.exceptions
import fsspec
import pytest
from fsspec.asyn import AsyncFileSystem
from fsspec.spec import AbstractFileSystem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wds_pad.io import ranges as wds_read
from wds_pad.errors import (ConfigError, IndexFormatError, ReadError, ShardError, StaleShardError,
                            WdsPadError)
from wds_pad.io.ranges import RangeReader, ReadOptions, get_filesystem, redact

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
    from wds_pad.io.ranges import _backoff

    opts = ReadOptions(backoff=0.2, backoff_max=1.0)
    delays = [_backoff(opts, "s3://b/x.tar", 10, a) for a in range(1, 8)]
    assert delays == [_backoff(opts, "s3://b/x.tar", 10, a) for a in range(1, 8)]
    assert 0.1 <= delays[0] <= 0.2 and all(0.5 <= d <= 1.0 for d in delays[3:])
    assert delays != [_backoff(opts, "s3://b/y.tar", 10, a) for a in range(1, 8)]


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


# ---------------------------------------------------------------- filesystems and fork


def test_filesystems_are_shared_per_protocol_and_options(shards: dict[str, bytes]) -> None:
    fs_a, path_a = get_filesystem("memory://wdsread/s0.tar")
    fs_b, path_b = get_filesystem("memory://wdsread/s1.tar")
    assert fs_a is fs_b and (path_a, path_b) == ("/wdsread/s0.tar", "/wdsread/s1.tar")
    fs_c, _ = get_filesystem("http://127.0.0.1:1/x.tar", {"http": {"headers": {"X-A": "1"}},
                                                          "s3": {"anon": True}})
    assert fs_c.kwargs == {"headers": {"X-A": "1"}}  # the s3 options were not passed to http
    fs_d, _ = get_filesystem("https://127.0.0.1:1/x.tar", {"http": {"headers": {"X-A": "1"}}})
    assert fs_d.kwargs == {"headers": {"X-A": "1"}}
    cached, path = get_filesystem("simplecache::memory://wdsread/s0.tar")
    again, path2 = get_filesystem("simplecache::memory://wdsread/s1.tar")
    assert cached is again and (path, path2) == ("/wdsread/s0.tar", "/wdsread/s1.tar")
    reader = RangeReader()
    assert reader.read("simplecache::memory://wdsread/s1.tar", 10, 5) == \
        shards["memory://wdsread/s1.tar"][10:15]
    with pytest.raises(ConfigError, match="nosuchproto"):
        get_filesystem("nosuchproto://x/y")


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


# ---------------------------------------------------------------- credentials


def test_redact_hides_credentials() -> None:
    ReadOptions(storage_options={"s3": {"key": "AKIAEXAMPLEKEY1", "secret": "s3cr3t/value+x"},
                                 "client_kwargs": {"aws_session_token": "TOKENVALUE123"}})
    text = ("s3://b/x.tar failed with key AKIAEXAMPLEKEY1 and s3cr3t/value+x token TOKENVALUE123 "
            "via https://alice:hunter22@host/x.tar?X-Amz-Signature=abcdef&X-Amz-Credential=AK%2F1"
            "&part=3 password=pw123 Authorization: Bearer eyJhbGciOi")
    out = redact(text)
    for secret in ("AKIAEXAMPLEKEY1", "s3cr3t/value+x", "TOKENVALUE123", "hunter22", "alice",
                   "abcdef", "AK%2F1", "pw123", "eyJhbGciOi"):
        assert secret not in out, (secret, out)
    assert "part=3" in out and "s3://b/x.tar" in out and "https://***@host/x.tar" in out
    assert redact("key sample_000001 at byte offset 42") == "key sample_000001 at byte offset 42"


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


# ---------------------------------------------------------------- redaction keeps prose


_PROSE_WORDS = ["unable", "to", "locate", "credentials", "credential", "the", "token", "secret",
                "key", "password", "signature", "authorization", "expired", "refresh", "your",
                "see", "docs", "found", "missing", "in", "env", "set", "storage", "options",
                "check", "request", "we", "calculated", "does", "not", "match", "you",
                "provided", "Unable", "Partial", "The", "Check", "NoCredentialsError",
                "PartialCredentialsError", "SignatureDoesNotMatch", "ExpiredToken",
                "InvalidAccessKeyId", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "aws",
                "configure", "access", "denied", "none"]
_PROSE = st.lists(st.tuples(st.sampled_from(_PROSE_WORDS), st.sampled_from([" ", ": ", ", ", ". ", "; "])),
                  min_size=1, max_size=14).map(lambda ws: "".join(w + s for w, s in ws).rstrip())


@pytest.mark.parametrize("text", [
    "NoCredentialsError: Unable to locate credentials",
    "PartialCredentialsError: Partial credentials found in env, missing: AWS_SECRET_ACCESS_KEY",
    "Unable to locate credentials. You can configure credentials by running \"aws configure\".",
    "the token expired; refresh your credentials: see the docs",
    "SignatureDoesNotMatch: The request signature we calculated does not match the signature "
    "you provided. Check your key and signing method.",
    "ExpiredToken: The provided token has expired.",
    "InvalidAccessKeyId: The AWS Access Key Id you provided does not exist in our records.",
    "shard 's3://b/x.tar': the store found no credentials: set them in storage_options",
])
def test_redact_keeps_messages_about_credentials(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wds_read, "_SECRETS", set())  # only the patterns, not other tests' secrets
    assert redact(text) == text


@settings(max_examples=300, deadline=None)
@given(text=_PROSE)
def test_redact_leaves_sentences_about_credentials_unchanged(text: str) -> None:
    with _no_registered_secrets():
        assert redact(text) == text


_SECRET_VALUE = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-_",
                        min_size=8, max_size=40).map(lambda v: v[:-1] + "7")  # keys carry a digit
_ASSIGNED = [
    "secret={v}", "aws_secret_access_key = {v}", "'secret': '{v}'", '"token": "{v}"', "token: {v}",
    "password={v}", "X-Amz-Security-Token: {v}", "Authorization: Bearer {v}",
    "Authorization: AWS4-HMAC-SHA256 Credential={v}/20240101/us-east-1/s3/aws4_request",
    "https://s3.example/b/k?X-Amz-Signature={v}&part=1", "Signature={v}", "https://user:{v}@host/x",
]


@settings(max_examples=200, deadline=None)
@given(before=_PROSE, after=_PROSE, value=_SECRET_VALUE, form=st.sampled_from(_ASSIGNED))
def test_redact_hides_secret_values_inside_prose(before: str, after: str, value: str, form: str) -> None:
    with _no_registered_secrets():
        out = redact(f"{before} {form.format(v=value)} {after}")
    assert value not in out and "***" in out
    assert out.startswith(f"{before} ") and out.endswith(f" {after}")  # the prose around is kept


class _no_registered_secrets:
    """redact() with only its patterns (hypothesis runs many examples in one test call)."""

    def __enter__(self) -> None:
        self.saved = wds_read._SECRETS
        wds_read._SECRETS = set()

    def __exit__(self, *exc: object) -> None:
        wds_read._SECRETS = self.saved


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


# ---------------------------------------------------------------- one place judges store faults


def _connector_error() -> BaseException:
    import aiohttp

    key = type("Key", (), {"ssl": False, "host": "127.0.0.1", "port": 9})()
    return aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "Connect call failed"))


def _not_found_from(cause: BaseException) -> BaseException:
    exc = FileNotFoundError("http://127.0.0.1:9/x.tar")
    exc.__cause__ = cause
    return exc


@pytest.mark.parametrize(("make", "expected", "says"), [
    (lambda: botocore.exceptions.NoCredentialsError(), ReadError, "found no credentials.*AWS_ACCESS_KEY_ID"),
    (lambda: botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:9/b/x.tar"),
     ReadError, "cannot reach the store.*endpoint_url"),
    (_connector_error, ReadError, "cannot reach the store"),
    (lambda: _not_found_from(_connector_error()), ReadError, "cannot reach the store"),
    (lambda: TimeoutError(), ReadError, "cannot reach the store"),
    (lambda: FileNotFoundError("x"), ShardError, "does not exist; check the URL or pattern"),
    (lambda: PermissionError("Access Denied"), ShardError, "not readable: PermissionError: Access Denied"),
    (lambda: OSError(5, "I/O error"), ReadError, "cannot read shard"),
])
def test_store_faults_become_our_errors_naming_url_and_fix(make: Any, expected: type, says: str) -> None:
    def fail() -> None:
        raise make()

    url = "s3://bucket/x.tar"
    with pytest.raises(expected, match=says) as info:
        wds_read.call_store(fail, url)
    assert url in str(info.value) and isinstance(info.value, WdsPadError)
    assert isinstance(info.value, OSError)


def test_store_faults_of_an_index_and_bugs() -> None:
    def missing() -> None:
        raise FileNotFoundError("gone")

    with pytest.raises(IndexFormatError, match="index 'memory://i.wdsidx' does not exist; build it"):
        wds_read.call_store(missing, "memory://i.wdsidx", what="index", missing=IndexFormatError,
                            fix="build it with `wds-pad index`")

    def forbidden() -> None:
        raise PermissionError("denied")

    with pytest.raises(ReadError, match="not readable"):  # an index: not IndexFormatError
        wds_read.call_store(forbidden, "memory://i.wdsidx", what="index", missing=IndexFormatError,
                            fix="")

    def bug() -> None:
        raise KeyError("ours")

    with pytest.raises(KeyError):  # not a store's fault: raised as it is
        wds_read.call_store(bug, "s3://b/x.tar")



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


# ---------------------------------------------------------------- local read-ahead


def _read_ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("wds_pad-local-read")]


def _wait_for_no_read_ahead_threads(seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while _read_ahead_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _read_ahead_threads(), _read_ahead_threads()


@pytest.fixture(scope="module")
def local_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("local")
    out = {}
    for i in range(5):
        data = os.urandom(40_000 + 1_000 * i)
        (root / f"f{i}.bin").write_bytes(data)
        out[str(root / f"f{i}.bin")] = data
    return out


class _Flaky(Exception):
    pass


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), threads=st.integers(0, 3), in_flight=st.integers(1, 6),
       bound=st.sampled_from([1, 2_500, 10**9]))
def test_read_ahead_keeps_order_errors_and_bounds(local_files: dict[str, bytes], data: st.DataObject,
                                                  threads: int, in_flight: int, bound: int) -> None:
    urls = sorted(local_files)
    n = data.draw(st.integers(0, 30))
    items = []
    for j in range(n):
        url = data.draw(st.sampled_from(urls))
        offset = data.draw(st.integers(0, 30_000))
        length = data.draw(st.integers(1, 2_000))
        fail, delay = data.draw(st.booleans()), data.draw(st.sampled_from([0.0, 0.0, 0.001, 0.003]))
        items.append((url, offset, length, (j, fail, delay)))
    consumed, bytes_out = [0], [0]
    lengths = [length for _, _, length, _ in items]
    seen: list[str] = []

    def parse(fd: int, url: str, offset: int, length: int, arg: Any) -> tuple[int, bytes]:
        j, fail, delay = arg
        # taken ahead only within the bounds: at most in_flight items, and at most
        # max(bound, largest) bytes, counted from the first item not yet handed out
        assert j - consumed[0] < in_flight
        assert sum(lengths[consumed[0]:j + 1]) <= max(bound, max(lengths))
        seen.append(threading.current_thread().name)
        time.sleep(delay)
        if fail:
            raise _Flaky(f"item {j}")
        return j, os.pread(fd, length, offset)

    reader = RangeReader(ReadOptions(local_threads=threads, max_in_flight=in_flight,
                                     max_bytes_in_flight=bound))
    with reader.local_read_ahead() as ahead:
        got = []
        for arg, result, error in ahead.run(iter(items), parse):
            got.append((arg, result, error))
            consumed[0] += 1
            bytes_out[0] += lengths[arg[0]]
    assert [arg for arg, _, _ in got] == [arg for *_, arg in items]
    for (url, offset, length, (j, fail, _)), (_, result, error) in zip(items, got):
        if fail:
            assert isinstance(error, _Flaky) and str(error) == f"item {j}" and result is None
        else:
            assert error is None and result == (j, local_files[url][offset:offset + length])
    ok = [length for (_, _, length, (_, fail, _)) in items if not fail]
    assert reader.stats.ranges == reader.stats.requests == len(ok)
    assert reader.stats.bytes == sum(ok)
    if threads:
        assert reader.stats.peak_requests_in_flight <= in_flight
        assert reader.stats.peak_bytes_in_flight <= max(bound, max(lengths, default=0))
    else:
        assert set(seen) <= {"MainThread"}
    _wait_for_no_read_ahead_threads()


def test_read_ahead_uses_its_threads_and_the_consumer(local_files: dict[str, bytes]) -> None:
    url = sorted(local_files)[0]
    names: list[str] = []

    def parse(fd: int, url: str, offset: int, length: int, arg: Any) -> bytes:
        names.append(threading.current_thread().name)
        time.sleep(0.002)
        return os.pread(fd, length, offset)

    reader = RangeReader(ReadOptions(local_threads=2, max_in_flight=8))
    ahead = reader.local_read_ahead()
    out = [r for _, r, _ in ahead.run(((url, 100 * i, 100, i) for i in range(60)), parse)]
    assert out == [local_files[url][100 * i:100 * i + 100] for i in range(60)]
    assert {"wds_pad-local-read-0", "wds_pad-local-read-1"} <= set(names)
    assert len(ahead.workers) == 2 and all(t.daemon for t in ahead.workers)
    ahead.close()
    assert ahead.workers == []
    _wait_for_no_read_ahead_threads()


def test_read_ahead_raises_a_source_error_after_the_items_before_it(
        local_files: dict[str, bytes]) -> None:
    url = sorted(local_files)[0]

    def items() -> Iterator[tuple[str, int, int, int]]:
        for i in range(5):
            yield url, i, 10, i
        raise ConfigError("the plan ran out")

    reader = RangeReader(ReadOptions(local_threads=2, max_in_flight=16))
    got = []
    with reader.local_read_ahead() as ahead, pytest.raises(ConfigError, match="the plan ran out"):
        for arg, result, error in ahead.run(items(), lambda fd, u, o, n, a: a):
            got.append(arg)
    assert got == [0, 1, 2, 3, 4]


def test_abandoned_read_ahead_skips_queued_items_and_stops(local_files: dict[str, bytes]) -> None:
    url = sorted(local_files)[0]
    started: list[int] = []
    finished: list[int] = []
    release = threading.Event()

    def parse(fd: int, url: str, offset: int, length: int, arg: int) -> int:
        started.append(arg)
        release.wait(60)
        finished.append(arg)
        return arg

    reader = RangeReader(ReadOptions(local_threads=2, max_in_flight=16))
    ahead = reader.local_read_ahead()
    it = ahead.run(((url, 0, 10, i) for i in range(100)), parse)
    release.set()
    assert next(it)[0] == 0
    release.clear()  # from now on the threads block in the next items they take
    time.sleep(0.05)
    blocked = len(started) - len(finished)
    it.close()  # must not wait for the blocked threads
    # they are still blocked (they wait up to 60 s): close returned without them
    assert len(started) - len(finished) >= blocked
    begun = len(started)
    assert not reader._busy  # every descriptor pin was dropped
    release.set()  # the threads live on (the read-ahead is not closed) but find nothing to do
    time.sleep(0.1)
    assert len(started) == begun <= 17  # items queued but not started were never parsed
    workers = ahead.workers
    assert len(workers) == 2 and all(t.is_alive() for t in workers)
    ahead.close()
    _wait_for_no_read_ahead_threads()


def test_dropped_read_ahead_stops_its_threads(local_files: dict[str, bytes]) -> None:
    url = sorted(local_files)[0]
    reader = RangeReader(ReadOptions(local_threads=3))
    before = set(_read_ahead_threads())
    it = reader.local_read_ahead().run(((url, i, 10, i) for i in range(50)),
                                       lambda fd, u, o, n, a: a)
    assert next(it)[0] == 0
    mine = set(_read_ahead_threads()) - before
    assert len(mine) == 3
    del it  # the generator held the only reference to the read-ahead
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in mine) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.is_alive() for t in mine)


def test_read_ahead_never_reads_from_an_evicted_descriptor(local_files: dict[str, bytes],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import wds_pad.io.ranges as read_module

    monkeypatch.setattr(read_module, "_MAX_OPEN_FDS", 2)  # 5 files: constant eviction
    urls = sorted(local_files)

    def parse(fd: int, url: str, offset: int, length: int, arg: Any) -> bytes:
        time.sleep(0.001)  # the consumer opens (and would evict) others meanwhile
        return os.pread(fd, length, offset)

    items = [(urls[i % 5], 37 * i, 500, i) for i in range(200)]
    reader = RangeReader(ReadOptions(local_threads=3, max_in_flight=6))
    out = list(reader.local_read_ahead().run(items, parse))
    assert [e for _, _, e in out] == [None] * 200
    assert [r for _, r, _ in out] == [local_files[u][o:o + n] for u, o, n, _ in items]


def test_read_ahead_error_of_a_missing_shard_comes_with_its_item(local_files: dict[str, bytes],
                                                                 tmp_path: Any) -> None:
    url = sorted(local_files)[0]
    missing = str(tmp_path / "gone.tar")
    items = [(url, 0, 10, 0), (missing, 512, 10, 1), (url, 10, 10, 2)]
    out = list(RangeReader(ReadOptions(local_threads=2)).local_read_ahead().run(
        items, lambda fd, u, o, n, a: os.pread(fd, n, o)))
    assert [a for a, _, _ in out] == [0, 1, 2]
    assert out[0][2] is None and out[2][1] == local_files[url][10:20]
    assert isinstance(out[1][2], ShardError) and "gone.tar" in str(out[1][2])


_FORK_AHEAD: Any = None


def _fork_child(conn: Any) -> None:
    try:
        conn.send([(a, r, e) for a, r, e in _FORK_AHEAD])
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(repr(exc))
    finally:
        conn.close()


def test_forked_child_finishes_a_suspended_read_ahead(local_files: dict[str, bytes]) -> None:
    global _FORK_AHEAD
    url = sorted(local_files)[1]
    gate = threading.Event()
    blocked: list[int] = []
    parent = os.getpid()

    def parse(fd: int, url: str, offset: int, length: int, arg: int) -> bytes:
        if arg >= 3 and threading.current_thread() is not threading.main_thread() \
                and os.getpid() == parent:
            blocked.append(arg)
            gate.wait(10)  # the parent's threads are mid-item when the fork happens
        return os.pread(fd, length, offset)

    items = [(url, 100 * i, 50, i) for i in range(12)]
    expected = [(i, local_files[url][100 * i:100 * i + 50], None) for i in range(12)]
    reader = RangeReader(ReadOptions(local_threads=2, max_in_flight=6))
    ahead = reader.local_read_ahead()
    _FORK_AHEAD = ahead.run(items, parse)
    head = [next(_FORK_AHEAD) for _ in range(3)]
    assert head == expected[:3]
    deadline = time.monotonic() + 5
    while len(blocked) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(blocked) == 2  # both threads hold an item no one in the child will finish
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_fork_child, args=(send,))
    proc.start()
    send.close()
    assert recv.poll(20), "the child hung waiting for the parent's read-ahead threads"
    result = recv.recv()
    proc.join(5)
    assert result == expected[3:]
    gate.set()
    assert list(_FORK_AHEAD) == expected[3:]  # the parent goes on as if nothing happened
    _FORK_AHEAD = None
    ahead.close()


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


def test_local_threads_is_validated() -> None:
    assert ReadOptions().local_threads == 2
    for bad in (-1, True, 1.5):
        with pytest.raises(ConfigError, match="local_threads"):
            ReadOptions(local_threads=bad)  # type: ignore[arg-type]


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
    from wds_pad.index.build import shard_info

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
    from wds_pad.index.build import shard_info

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
    from wds_pad.index.build import shard_info

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
