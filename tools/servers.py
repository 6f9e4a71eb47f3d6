"""Object-storage and HTTP servers on loopback for tests and benchmarks.

Three servers share one shape: ``start()`` (also ``__enter__``) blocks until the server
answers, ``stop()`` (also ``__exit__``) ends it and waits, and is safe to call twice.

- :class:`MotoServer`: moto's S3-protocol server in a child process.
- :class:`NginxServer`: Debian's nginx serving a directory, in a child process.
- :class:`PythonHttpServer`: a range-capable ``ThreadingHTTPServer`` in a thread, the
  fallback where nginx is not installed.

Invariants:
- Every server listens on 127.0.0.1 only; nothing here opens a socket to any other
  address.
- A child process is reaped by ``stop()`` and by an ``atexit`` hook, and (Linux) gets
  SIGTERM when the thread that started it dies, even by SIGKILL (``PR_SET_PDEATHSIG``):
  start servers from the main thread or from a thread that outlives them.
- No pytest import: plain classes usable from benchmark scripts.
"""

from __future__ import annotations

import atexit
import contextlib
import email.utils
import functools
import grp
import http.server
import mimetypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any, Self

__all__ = ["MotoServer", "NginxServer", "PythonHttpServer", "free_port", "http_server"]

LOOPBACK = "127.0.0.1"
_LIVE: set[_ChildProcessServer] = set()


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port that was free on ``host`` a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# Runs first in every child: ask the kernel for SIGTERM when our parent (thread) dies
# (PR_SET_PDEATHSIG survives exec), give up if the parent is already gone, then exec the
# server. Done in a shim rather than preexec_fn, which may deadlock in a threaded parent.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


def _wait_http(url: str, proc: subprocess.Popen[bytes] | None, log: Path | None, timeout: float) -> None:
    """Poll ``url`` until any HTTP answer comes back; fail early if ``proc`` died."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
            raise RuntimeError(f"server for {url} exited with code {proc.returncode} while starting:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:  # noqa: S310 (loopback URL)
                resp.read()
            return
        except urllib.error.HTTPError:
            return  # it answered, only not with 2xx
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"server at {url} did not answer within {timeout:.0f} s; see {log}") from None
            time.sleep(0.05)


_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class RangeRequestHandler(http.server.SimpleHTTPRequestHandler):
    """Serves files with single byte ranges (206 / 416), keep-alive, ETag; lists directories."""

    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in two writes: avoid Nagle + delayed-ACK 40 ms stalls.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        pass  # quiet: thousands of requests per test

    def do_GET(self) -> None:  # noqa: N802 (stdlib naming)
        self._serve(body=True)

    def do_HEAD(self) -> None:  # noqa: N802 (stdlib naming)
        self._serve(body=False)

    def _serve(self, body: bool) -> None:
        self.server.count_request()  # type: ignore[attr-defined]
        path = self.translate_path(self.path)
        if not os.path.isfile(path):  # directory listing, redirect or 404: the stdlib way
            f = self.send_head()
            if f is not None:
                with f:
                    if body:
                        self.copyfile(f, self.wfile)
            return
        st = os.stat(path)
        size, start, end, status = st.st_size, 0, st.st_size - 1, 200
        match = _RANGE.match(self.headers.get("Range", "").strip())
        if match and (match[1] or match[2]):
            if not match[1]:  # suffix range: the last N bytes
                start, end = max(0, size - int(match[2])), size - 1
            else:
                start = int(match[1])
                end = min(int(match[2]), size - 1) if match[2] else size - 1
            if start >= size or start > end:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", mimetypes.guess_type(path)[0] or "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{st.st_mtime_ns:x}-{size:x}"')
        self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if body and end >= start:
            with open(path, "rb") as f:
                self.connection.sendfile(f, start, end - start + 1)


class _RangeServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default listen backlog (5) drops connection attempts when a stream
    # opens many at once; the kernel retries them after 1 s, a timeout's length in tests
    request_queue_size = 128
    requests_served = 0
    _lock = threading.Lock()

    def count_request(self) -> None:
        with self._lock:
            self.requests_served += 1


def make_range_server(address: tuple[str, int], root_dir: str) -> _RangeServer:
    """A bound, not yet serving, range-capable ThreadingHTTPServer over ``root_dir``."""
    return _RangeServer(address, functools.partial(RangeRequestHandler, directory=root_dir))


class _ChildProcessServer:
    """A server run as a child process in its own session, logs in a private temp dir."""

    name = "server"

    def __init__(self, startup_timeout: float) -> None:
        self.host = LOOPBACK
        self.port = 0
        self.startup_timeout = startup_timeout
        self.workdir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL, ``http://127.0.0.1:PORT`` (no trailing slash)."""
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path | None:
        """File that receives the child's stdout and stderr."""
        return self.workdir / f"{self.name}.log" if self.workdir else None

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _probe_url(self) -> str:
        return self.url + "/"

    def start(self) -> Self:
        """Start the child and block until it answers HTTP. Returns ``self``."""
        if self.proc is not None:
            return self
        self.workdir = Path(tempfile.mkdtemp(prefix=f"wds_pad_{self.name}_"))
        self.port = free_port(self.host)
        cmd = self._command()
        assert self.log_path is not None
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(  # noqa: S603 (fixed argv)
                [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=self.workdir,
            )
        _LIVE.add(self)
        try:
            _wait_http(self._probe_url(), self.proc, self.log_path, self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the child (then its process group if needed) and wait for it."""
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is not None and proc.poll() is None:
            # Signal the whole group (nginx workers too) while the unreaped leader still
            # holds the group id, so it cannot name someone else's processes.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    @property
    def pid(self) -> int | None:
        """Process id of the running child, or None."""
        return self.proc.pid if self.proc is not None else None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.proc else "stopped"
        return f"{type(self).__name__}({self.url}, {state})"


# werkzeug writes headers and body separately: without TCP_NODELAY, Nagle plus the
# client's delayed ACK cost ~40 ms per response. Its per-request log line is silenced too.
_MOTO_MAIN = """
import logging, socket, sys
import werkzeug.serving as ws
logging.getLogger("werkzeug").setLevel(logging.WARNING)
_setup = ws.WSGIRequestHandler.setup
def setup(self):
    _setup(self)
    self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
ws.WSGIRequestHandler.setup = setup
from moto.server import main
main(sys.argv[1:])
"""


class MotoServer(_ChildProcessServer):
    """moto's S3-protocol server in a child process on ``127.0.0.1:free_port``.

    Example:
        >>> with MotoServer() as s3:
        ...     s3.make_bucket("b"); s3.upload("x.tar", "s3://b/x.tar")
        ...     fs = s3fs.S3FileSystem(**s3.storage_options)
    """

    name = "moto"

    def __init__(self, *, key: str = "testing", secret: str = "testing", region: str = "us-east-1",
                 startup_timeout: float = 60.0) -> None:
        super().__init__(startup_timeout)
        self.key, self.secret, self.region = key, secret, region

    def _command(self) -> list[str]:
        return [sys.executable, "-c", _MOTO_MAIN, "-H", self.host, "-p", str(self.port)]

    def _probe_url(self) -> str:
        return self.url + "/moto-api/data.json"

    @property
    def endpoint_url(self) -> str:
        """The S3 endpoint, ``http://127.0.0.1:PORT``."""
        return self.url

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem`` / fsspec ``storage_options``."""
        return {"key": self.key, "secret": self.secret,
                "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": self.region}}

    def storage_options_via(self, endpoint_url: str) -> dict[str, Any]:
        """``storage_options`` with another endpoint, e.g. a FaultProxy's ``url``."""
        options = self.storage_options
        options["client_kwargs"]["endpoint_url"] = endpoint_url
        return options

    @property
    def env(self) -> dict[str, str]:
        """AWS_* variables that point boto3/s3fs at this server (for child processes)."""
        return {"AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": self.secret,
                "AWS_DEFAULT_REGION": self.region, "AWS_REGION": self.region,
                "AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ENDPOINT_URL_S3": self.endpoint_url,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self) -> Any:
        """A fresh synchronous boto3 S3 client for this server."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name=self.region,
                            aws_access_key_id=self.key, aws_secret_access_key=self.secret)

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (no error if it exists already); return the name."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=name)
        return name

    @staticmethod
    def _split(url: str) -> tuple[str, str]:
        if not url.startswith("s3://") or "/" not in url[5:]:
            raise ValueError(f"expected s3://bucket/key, got {url!r}")
        bucket, key = url[5:].split("/", 1)
        return bucket, key

    def upload(self, local_path: str | os.PathLike[str], url: str) -> str:
        """Copy a local file to ``s3://bucket/key`` (the bucket must exist). Returns ``url``."""
        bucket, key = self._split(url)
        self.client().upload_file(os.fspath(local_path), bucket, key)
        return url

    def put_bytes(self, url: str, data: bytes) -> str:
        """Write ``data`` to ``s3://bucket/key`` (the bucket must exist). Returns ``url``."""
        bucket, key = self._split(url)
        self.client().put_object(Bucket=bucket, Key=key, Body=data)
        return url

    def reset(self) -> None:
        """Forget every bucket and object (moto's ``/moto-api/reset``)."""
        req = urllib.request.Request(self.url + "/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 (loopback URL)
            resp.read()


class NginxServer(_ChildProcessServer):
    """Debian's nginx serving ``root_dir`` (Range, keep-alive, sendfile) in a child process."""

    name = "nginx"

    def __init__(self, root_dir: str | os.PathLike[str], *, workers: int = 1, binary: str | None = None,
                 startup_timeout: float = 15.0) -> None:
        super().__init__(startup_timeout)
        self.root_dir = Path(root_dir).resolve()
        self.workers = workers
        found = binary or shutil.which("nginx") or next(
            (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)
        if found is None:
            raise FileNotFoundError("nginx is not installed; run .ci/install-services or use PythonHttpServer")
        self.binary = found

    @staticmethod
    def available() -> bool:
        """True if an nginx binary is on PATH or in /usr/sbin."""
        return shutil.which("nginx") is not None or os.access("/usr/sbin/nginx", os.X_OK)

    def _config(self) -> str:
        assert self.workdir is not None
        tmp = self.workdir
        # Workers drop to 'nobody' by default and then cannot read a 0700 pytest tmp dir.
        user = f"user root {grp.getgrgid(0).gr_name};" if os.geteuid() == 0 else ""
        temps = "\n".join(f"    {kind}_temp_path {tmp}/{kind}_temp;"
                          for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        return f"""{user}
daemon off;
worker_processes {self.workers};
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
{temps}
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    tcp_nodelay on;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    server {{
        listen {self.host}:{self.port};
        root {self.root_dir};
        location / {{ autoindex on; }}
    }}
}}
"""

    def _command(self) -> list[str]:
        assert self.workdir is not None
        conf = self.workdir / "nginx.conf"
        conf.write_text(self._config())
        return [self.binary, "-p", str(self.workdir), "-e", str(self.workdir / "error.log"), "-c", str(conf)]

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, root={self.root_dir})"


class PythonHttpServer:
    """A range-capable HTTP/1.1 server in a daemon thread; same interface as NginxServer.

    The fallback where nginx is missing: correct, but it shares the GIL with the client,
    so never use it for throughput numbers.
    """

    def __init__(self, root_dir: str | os.PathLike[str]) -> None:
        self.root_dir = Path(root_dir).resolve()
        self.host = LOOPBACK
        self.port = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL, ``http://127.0.0.1:PORT`` (no trailing slash)."""
        return f"http://{self.host}:{self.port}"

    @property
    def requests_served(self) -> int:
        """Number of requests handled so far."""
        return self._server.requests_served if self._server else 0

    def start(self) -> PythonHttpServer:
        """Bind to a free loopback port and serve in a thread. Returns ``self``."""
        if self._server is None:
            self._server = make_range_server((self.host, 0), str(self.root_dir))
            self.port = int(self._server.server_address[1])
            self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                            name=f"PythonHttpServer:{self.port}", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving, close the socket and join the thread."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> PythonHttpServer:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self._server else "stopped"
        return f"PythonHttpServer({self.url}, {state}, root={self.root_dir}; nginx fallback)"


def http_server(root_dir: str | os.PathLike[str]) -> NginxServer | PythonHttpServer:
    """NginxServer if nginx is installed, else PythonHttpServer (not started)."""
    return NginxServer(root_dir) if NginxServer.available() else PythonHttpServer(root_dir)


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()

