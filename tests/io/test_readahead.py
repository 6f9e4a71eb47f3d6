"""Tests of wds_pad.io.readahead: order, errors with their items, bounds, threads, fork.

The local shards come from the ``local_files`` fixture (tests/io/conftest.py).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wds_pad.errors import ConfigError, ShardError
from wds_pad.io.ranges import RangeReader, ReadOptions


def _read_ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("wds_pad-local-read")]


def _wait_for_no_read_ahead_threads(seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while _read_ahead_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _read_ahead_threads(), _read_ahead_threads()


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
    import wds_pad.io.ranges as ranges_module

    monkeypatch.setattr(ranges_module, "fd_budget", lambda: 2)  # 5 files: constant eviction
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
    parent = os.getpid()
    gate, blocked = threading.Event(), []

    def parse(fd: int, url: str, offset: int, length: int, arg: int) -> bytes:
        if arg >= 3 and threading.current_thread() is not threading.main_thread() \
                and os.getpid() == parent:
            blocked.append(arg)
            gate.wait(10)  # the parent's threads are mid-item when the fork happens
        return os.pread(fd, length, offset)

    items = [(url, 100 * i, 50, i) for i in range(12)]
    expected = [(i, local_files[url][100 * i:100 * i + 50], None) for i in range(12)]
    ahead: Any = None
    try:
        for _ in range(5):  # until both threads hold an item: the consumer runs any item no
            # thread has started, so on a busy machine it may have read every one itself
            gate, blocked = threading.Event(), []
            reader = RangeReader(ReadOptions(local_threads=2, max_in_flight=6))
            ahead = reader.local_read_ahead()
            _FORK_AHEAD = ahead.run(items, parse)
            head = [next(_FORK_AHEAD) for _ in range(3)]
            assert head == expected[:3]
            deadline = time.monotonic() + 5
            while len(blocked) < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
            if len(blocked) == 2:
                break
            gate.set()
            ahead.close()
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
    finally:  # a failure here leaves no thread behind for the tests after it
        gate.set()
        _FORK_AHEAD = None
        if ahead is not None:
            ahead.close()


def test_local_threads_is_validated() -> None:
    assert ReadOptions().local_threads == 2
    for bad in (-1, True, 1.5):
        with pytest.raises(ConfigError, match="local_threads"):
            ReadOptions(local_threads=bad)  # type: ignore[arg-type]


def test_the_large_sample_threshold_is_one_constant() -> None:
    """The fetch stage and the batch-wise path split samples at the read-ahead's threshold."""
    from wds_pad.io.readahead import BIG_SAMPLE
    from wds_pad.stream import batchread, fetch

    assert BIG_SAMPLE == 256 * 1024
    assert fetch.BIG_SAMPLE is BIG_SAMPLE and batchread.BIG_SAMPLE is BIG_SAMPLE
