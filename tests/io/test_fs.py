"""Tests of wds_pad.io.fs: one filesystem per protocol chain and options, options per protocol.

That a forked child makes its own filesystems is tested with the reader
(tests/io/test_ranges.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import fsspec
import pytest

from wds_pad.errors import ConfigError
from wds_pad.io.fs import get_filesystem
from wds_pad.io.ranges import RangeReader

pytest_plugins = ["conftest_servers"]


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


# -- a forked child and the parent's sessions ---------------------------------------------

def _parent_reads_after_child_collects(make: Any, path: str) -> bytes | None:
    """Reads 100 bytes with a filesystem from ``make()`` (a pooled connection), forks a
    child that drops and collects every filesystem it inherited (what a DataLoader worker
    does when it makes its own), then reads again in the parent: the bytes, or None if
    the read hung."""
    import gc
    import os
    import threading

    from wds_pad.io import fs as wds_fs

    held = {"fs": make()}
    first = held["fs"].cat_file(path, start=0, end=100)
    pid = os.fork()
    if pid == 0:  # the child: like a DataLoader worker making its own filesystems
        code = 1
        try:
            held.clear()
            wds_fs._FS_CACHE.clear()
            fsspec.AbstractFileSystem.clear_instance_cache()
            gc.collect()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    out: dict[str, bytes] = {}
    fs = held["fs"]
    reader = threading.Thread(target=lambda: out.update(data=fs.cat_file(path, start=0, end=100)), daemon=True)
    reader.start()
    reader.join(30)  # loopback: milliseconds; a hung connection waits for its whole timeout
    assert first == out.get("data", first)
    return out.get("data")


def test_a_forked_child_collecting_inherited_http_filesystems_leaves_the_parents_connections_working(
        nginx_server: Any, tmp_path: Path) -> None:
    """aiohttp closes a collected connector, which unregisters its sockets from the epoll
    set the child shares with the parent: the parent's next request on a pooled
    connection then hung for its whole timeout (the bench's 60 s stalls)."""
    (nginx_server.root_dir / "fork-http.bin").write_bytes(bytes(range(256)) * 64)
    make = lambda: fsspec.filesystem("http", skip_instance_cache=True)  # noqa: E731
    assert _parent_reads_after_child_collects(make, f"{nginx_server.url}/fork-http.bin") == bytes(range(100))



def test_disowning_parent_sessions_survives_the_garbage_collector_running_finalizers_meanwhile() -> None:
    """A forked child reads ``weakref.finalize``'s registry to disown the parent's sessions.
    A collection during that read (any allocation can start one) runs finalizers, which
    remove themselves from the registry: it then changed size while it was read, and the
    child printed an ignored RuntimeError (seen once in a DataLoader worker's stderr).

    Run in a forked child, as it runs for real: in this process it would disown the
    sessions the other tests' filesystems hold."""
    import gc
    import traceback
    import weakref

    from wds_pad.io import fs as wds_fs

    class Cycle:
        pass

    def trapped() -> int:  # in the child: 0 if the read survived and every finalizer ran
        ran: list[int] = []
        gc.disable()
        gc.collect()
        for i in range(200):  # garbage that only a collection frees, each with a finalizer
            c = Cycle()
            c.me = c  # type: ignore[attr-defined]
            weakref.finalize(c, ran.append, i)
            del c
        gc.set_threshold(gc.get_count()[0] + 20)  # a collection 20 allocations into the read
        gc.enable()
        wds_fs._forget_parent_sessions()
        gc.collect()
        return 0 if len(ran) == 200 else 2

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            code = trapped()
        except BaseException:  # noqa: BLE001 - reported through the exit code
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # 1: the read raised; 2: a finalizer was lost
