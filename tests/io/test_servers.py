"""Tests of the loopback test infrastructure: tools/servers.py and tools/faultproxy.py.

Every server here runs on 127.0.0.1; every process a test starts is checked reaped.
"""

from __future__ import annotations

import hashlib
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import aiohttp
import fsspec
import pytest
import s3fs
from fsspec.exceptions import FSTimeoutError

from faultproxy import FaultProxy, Request, StallMode  # tools/ is on sys.path: tests/conftest.py
from servers import MotoServer, NginxServer, PythonHttpServer

TOOLS = str(Path(__file__).resolve().parents[2] / "tools")  # for the child processes

pytest_plugins = ["conftest_servers"]

pytestmark = pytest.mark.timeout(60)

DATA = random.Random(0).randbytes(256 * 1024)  # no period: an off-by-N read cannot match


def _procs() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, pgrp) of every live, non-zombie process, from /proc."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                out[int(entry)] = (int(fields[1]), int(fields[2]))
    return out


def _children() -> set[int]:
    return {pid for pid, (ppid, _) in _procs().items() if ppid == os.getpid()}


def _http_fs(**client_kwargs: object) -> fsspec.AbstractFileSystem:
    return fsspec.filesystem("http", skip_instance_cache=True, client_kwargs=client_kwargs)


def _range_get(url: str, header: str) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, headers={"Range": header})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _raw_request(port: int, path: str, timeout: float) -> bytes:
    """Send one GET on a fresh socket; return what arrives before close or timeout."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except TimeoutError:
            pass
        return got


# -- process lifecycle ----------------------------------------------------------------


def test_moto_server_starts_answers_and_is_reaped_even_on_error() -> None:
    before = _children()
    with pytest.raises(RuntimeError, match="boom"), MotoServer() as server:
        pid = server.pid
        assert pid in _children()
        with urllib.request.urlopen(server.endpoint_url + "/moto-api/data.json", timeout=5) as resp:
            assert resp.status == 200
        raise RuntimeError("boom")
    assert pid not in _procs()
    assert _children() == before
    server.stop()  # idempotent
    assert server.pid is None


@pytest.mark.skipif(not NginxServer.available(), reason="nginx not installed (.ci/install-services)")
def test_nginx_workers_end_with_the_master(tmp_path: Path) -> None:
    before = _children()
    with NginxServer(tmp_path, workers=2) as server:
        master = server.pid
        workers = [pid for pid, (ppid, _) in _procs().items() if ppid == master]
        assert len(workers) == 2
    alive = _procs()
    assert master not in alive and not set(workers) & set(alive)
    assert not [pid for pid, (_, pgrp) in alive.items() if pgrp == master]
    assert _children() == before


@pytest.mark.skipif(not NginxServer.available(), reason="nginx not installed (.ci/install-services)")
def test_server_dies_with_a_killed_parent(tmp_path: Path) -> None:
    code = (f"import sys, time; sys.path.insert(0, {TOOLS!r}); from servers import NginxServer; "
            f"s = NginxServer({str(tmp_path)!r}).start(); print(s.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        master = int(parent.stdout.readline())
        assert master in _procs()
    finally:
        parent.kill()  # SIGKILL: no atexit, no finally in the parent
        parent.wait()
    deadline = time.monotonic() + 10
    while master in _procs() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert master not in _procs()


def test_python_http_server_thread_ends(tmp_path: Path) -> None:
    with PythonHttpServer(tmp_path) as server:
        name = f"PythonHttpServer:{server.port}"
        assert any(t.name == name for t in threading.enumerate())
    assert not any(t.name == name for t in threading.enumerate())


# -- S3 (moto) -----------------------------------------------------------------------


def test_s3_upload_then_ranged_reads_are_exact(moto_server: MotoServer, s3_bucket: str, tmp_path: Path) -> None:
    local = tmp_path / "shard.tar"
    local.write_bytes(DATA)
    url = moto_server.upload(local, f"s3://{s3_bucket}/dir/shard.tar")
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **moto_server.storage_options)
    assert fs.size(url) == len(DATA)
    assert fs.cat_file(url, start=1000, end=5000) == DATA[1000:5000]
    assert fs.cat_file(url, start=len(DATA) - 7) == DATA[-7:]
    starts, ends = [0, 123, 200_000], [10, 65_536, len(DATA)]
    assert fs.cat_ranges([url] * 3, starts, ends) == [DATA[s:e] for s, e in zip(starts, ends, strict=True)]
    # Single-part uploads carry the MD5 as ETag: later code may rely on it for staleness.
    assert fs.info(url)["ETag"] == f'"{hashlib.md5(DATA).hexdigest()}"'  # noqa: S324
    assert moto_server.put_bytes(f"s3://{s3_bucket}/small", b"abc") and fs.cat_file(f"{s3_bucket}/small") == b"abc"


# -- HTTP (nginx or fallback) ---------------------------------------------------------


def _check_http_ranges(base_url: str, root: Path) -> None:
    (root / "shard.tar").write_bytes(DATA)
    url = f"{base_url}/shard.tar"
    status, headers, body = _range_get(url, "bytes=100-199")
    assert (status, body, headers["Content-Range"]) == (206, DATA[100:200], f"bytes 100-199/{len(DATA)}")
    assert _range_get(url, "bytes=-5")[::2] == (206, DATA[-5:])
    assert _range_get(url, f"bytes={len(DATA) - 3}-")[::2] == (206, DATA[-3:])
    assert _range_get(url, f"bytes={len(DATA)}-")[0] == 416
    fs = _http_fs()
    assert fs.size(url) == len(DATA)
    assert fs.cat_file(url, start=4096, end=70_000) == DATA[4096:70_000]
    assert fs.cat_ranges([url] * 2, [0, 9], [3, 12]) == [DATA[0:3], DATA[9:12]]
    assert url in fs.ls(base_url + "/", detail=False)


def test_nginx_server_fixture_serves_exact_ranges(nginx_server: NginxServer | PythonHttpServer) -> None:
    _check_http_ranges(nginx_server.url, nginx_server.root_dir)


def test_python_fallback_serves_exact_ranges(tmp_path: Path) -> None:
    with PythonHttpServer(tmp_path) as server:
        _check_http_ranges(server.url, tmp_path)
        assert server.requests_served >= 8


# -- fault proxy ----------------------------------------------------------------------


@pytest.fixture
def web(nginx_server: NginxServer | PythonHttpServer) -> str:
    """Path of a 256 KiB file on the HTTP server."""
    (nginx_server.root_dir / "blob.bin").write_bytes(DATA)
    return "/blob.bin"


def test_proxy_forwards_http_keepalive_and_counts(nginx_server, web, fault_proxy) -> None:  # noqa: ANN001
    proxy: FaultProxy = fault_proxy(nginx_server)
    fs = _http_fs()
    url = proxy.url + web
    assert fs.size(url) == len(DATA)
    assert fs.cat_file(url, start=10, end=100_000) == DATA[10:100_000]
    assert fs.cat_file(url) == DATA
    assert proxy.requests_seen == 3
    assert [(r.method, r.header("range")) for r in proxy.requests][1] == ("GET", "bytes=10-99999")


def test_proxy_latency_delays_every_request(nginx_server, web, fault_proxy) -> None:  # noqa: ANN001
    proxy: FaultProxy = fault_proxy(nginx_server, latency_ms=500)
    fs = _http_fs()
    for _ in range(2):
        t0 = time.perf_counter()
        assert fs.cat_file(proxy.url + web, start=0, end=10) == DATA[:10]
        assert time.perf_counter() - t0 >= 0.5
    # 0 switches it off: with a minute of latency still on, a client that gives up after
    # 20 s would time out (no claim that a request "is fast", which a busy machine breaks)
    proxy.set_latency(60_000)
    proxy.set_latency(0)
    patient = _http_fs(timeout=aiohttp.ClientTimeout(total=20))
    assert patient.cat_file(proxy.url + web, start=0, end=10) == DATA[:10]


def test_proxy_fails_next_n_then_recovers(nginx_server, web, fault_proxy) -> None:  # noqa: ANN001
    proxy: FaultProxy = fault_proxy(nginx_server)
    proxy.fail_next(2, status=503)
    results = [_range_get(proxy.url + web, "bytes=0-3") for _ in range(3)]
    assert [r[0] for r in results] == [503, 503, 206]
    assert b"<Code>SlowDown</Code>" in results[0][2] and results[2][2] == DATA[:4]
    assert proxy.requests_seen == 3 and proxy.faults_injected == {"fail": 2}
    proxy.fail_next(1, status=500)
    with pytest.raises(aiohttp.ClientResponseError, match="500"):
        _http_fs().cat_file(proxy.url + web, start=0, end=4)


def test_proxy_random_failures_are_seeded(nginx_server, web, fault_proxy) -> None:  # noqa: ANN001
    patterns = []
    for _ in range(2):
        proxy: FaultProxy = fault_proxy(nginx_server, seed=7)
        proxy.fail_randomly(0.5, match=lambda r: r.method == "GET")
        patterns.append([_range_get(proxy.url + web, "bytes=0-0")[0] for _ in range(24)])
    assert patterns[0] == patterns[1]
    assert 3 <= patterns[0].count(503) <= 21 and set(patterns[0]) == {206, 503}


def test_proxy_reset_is_a_connection_error(nginx_server, web, fault_proxy) -> None:  # noqa: ANN001
    proxy: FaultProxy = fault_proxy(nginx_server)
    proxy.reset_next(1)
    with pytest.raises(ConnectionResetError):
        _raw_request(proxy.port, web, timeout=5)
    # aiohttp retries an idempotent request once when a reused connection breaks, so a
    # pooled client needs two resets in a row to see one.
    fs = _http_fs()
    assert fs.cat_file(proxy.url + web, start=0, end=2) == DATA[:2]
    proxy.reset_next(2)
    with pytest.raises(aiohttp.ClientConnectionError):
        fs.cat_file(proxy.url + web, start=0, end=2)
    assert fs.cat_file(proxy.url + web, start=5, end=9) == DATA[5:9]
    assert proxy.faults_injected == {"reset": 3}


def test_proxy_stall_times_out_a_client(nginx_server, web, fault_proxy) -> None:  # noqa: ANN001
    proxy: FaultProxy = fault_proxy(nginx_server)
    proxy.stall_next(1, mode=StallMode.REQUEST)
    assert _raw_request(proxy.port, web, timeout=0.5) == b""
    proxy.stall_next(1, mode=StallMode.BODY)
    got = _raw_request(proxy.port, web, timeout=0.5)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body == DATA[: len(DATA) // 2]
    fs = _http_fs(timeout=aiohttp.ClientTimeout(total=1))
    proxy.stall_next(1)
    t0 = time.perf_counter()
    with pytest.raises(FSTimeoutError):  # the stall never ends: only the client's timeout does
        fs.cat_file(proxy.url + web, start=0, end=10)
    assert time.perf_counter() - t0 >= 0.9  # it waited its 1 s (a lower bound: load only adds)
    assert fs.cat_file(proxy.url + web, start=0, end=10) == DATA[:10]


def test_s3fs_works_through_proxy_and_retries_5xx(moto_server: MotoServer, s3_bucket: str, fault_proxy) -> None:  # noqa: ANN001
    proxy: FaultProxy = fault_proxy(moto_server)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **moto_server.storage_options_via(proxy.url))
    url = f"{s3_bucket}/via-proxy.bin"
    fs.pipe_file(url, DATA)  # a PUT with a body through the proxy
    assert fs.cat_file(url, start=3, end=70_000) == DATA[3:70_000]
    assert fs.cat_ranges([url] * 2, [0, 100], [1, 200]) == [DATA[:1], DATA[100:200]]
    ranged: Callable[[Request], bool] = lambda r: r.header("range") is not None  # noqa: E731
    proxy.fail_next(1, status=503, match=ranged)
    assert fs.cat_file(url, start=50, end=60) == DATA[50:60]  # botocore retried the 503
    assert proxy.faults_injected == {"fail": 1}
    assert sum(r.header("range") == "bytes=50-59" for r in proxy.requests) == 2


def test_proxy_stop_leaves_no_thread_or_listener(nginx_server) -> None:  # noqa: ANN001
    with FaultProxy(nginx_server.host, nginx_server.port) as proxy:
        port = proxy.port
        with socket.create_connection(("127.0.0.1", port), timeout=5) as idle:  # held open across stop
            idle.sendall(b"HEAD / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert idle.recv(65536).startswith(b"HTTP/1.1 200")  # now an idle keep-alive connection
            assert any(t.name.startswith("FaultProxy") for t in threading.enumerate())
            proxy.stop()
            assert idle.recv(1) == b""  # the proxy closed its side
    assert not any(t.name.startswith("FaultProxy") for t in threading.enumerate())
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_proxy_refuses_non_loopback_upstream() -> None:
    with pytest.raises(ValueError, match="loopback"):
        FaultProxy("192.0.2.1", 80)
