"""A fault-injecting HTTP/1.1 proxy on loopback, for tests of retries and timeouts.

``FaultProxy(upstream_host, upstream_port)`` listens on 127.0.0.1 and forwards each
request of a keep-alive connection to the upstream over one upstream connection per
client connection. Before forwarding, it decides what happens to that request:

- latency: ``latency_ms`` is slept once per request, before anything else;
- then the first matching fault rule fires (rules are tried in the order added):
  ``fail`` answers with a 5xx itself, ``reset`` aborts the client connection with a
  TCP RST (SO_LINGER 0), ``stall`` never answers (``StallMode.REQUEST``) or forwards
  the status line, headers and half the body, then hangs (``StallMode.BODY``).

A rule fires for the next N matching requests, or with probability p drawn from the
proxy's seeded RNG (``random.Random(seed)``), so a run is reproducible for a given
request order. Setters are thread-safe and take effect from the next request on.

Invariants:
- It listens on and forwards to loopback addresses only (ValueError otherwise).
- Requests are parsed in full (request line, headers, Content-Length or chunked body),
  and responses are relayed by Content-Length, chunked framing, or until close, so
  faults apply per request, never per connection.
- ``stop()`` closes every socket and joins the event-loop thread.

CLI: ``python tools/faultproxy.py --upstream 127.0.0.1:PORT --latency-ms 20``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import enum
import ipaddress
import random
import signal
import socket
import struct
import sys
import threading
from collections import Counter, deque
from collections.abc import Callable
from types import TracebackType

__all__ = ["Fault", "FaultProxy", "Request", "Rule", "StallMode"]

_CHUNK = 1 << 16
_HEAD_LIMIT = 1 << 20
_REASONS = {500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable",
            504: "Gateway Timeout", 429: "Too Many Requests"}


class Fault(enum.Enum):
    """What a rule does to a request."""

    FAIL = "fail"
    RESET = "reset"
    STALL = "stall"


class StallMode(enum.Enum):
    """Where a stalled request hangs."""

    REQUEST = "request"  # the request is read, nothing is ever answered
    BODY = "body"  # status line, headers and half the body are sent, then nothing
    CUT = "cut"  # status line, headers and half the body are sent, then the connection closes


@dataclasses.dataclass(frozen=True)
class Request:
    """A parsed request head, as rules and the request log see it."""

    method: str
    target: str
    headers: tuple[tuple[str, str], ...]

    def header(self, name: str, default: str | None = None) -> str | None:
        """Value of the first header called ``name`` (case-insensitive)."""
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), default)


@dataclasses.dataclass
class Rule:
    """One fault: fires for ``remaining`` matching requests (None: unlimited), each with
    ``probability``; ``match`` restricts it to some requests (e.g. ranged GETs only)."""

    fault: Fault
    remaining: int | None = 1
    probability: float = 1.0
    status: int = 503
    stall_mode: StallMode = StallMode.REQUEST
    match: Callable[[Request], bool] | None = None

    def __post_init__(self) -> None:
        if self.remaining is not None and self.remaining < 0:
            raise ValueError(f"Rule.remaining must be >= 0 or None, got {self.remaining}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"Rule.probability must be in [0, 1], got {self.probability}")
        if self.fault is Fault.FAIL and not 400 <= self.status <= 599:
            raise ValueError(f"Rule.status must be a 4xx/5xx code, got {self.status}")


def _check_loopback(host: str, what: str) -> None:
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{what} {host!r} is not a loopback address; the fault proxy only runs on 127.0.0.0/8")


def _parse_head(raw: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = raw.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
    return lines[0], headers


def _get(headers: list[tuple[str, str]], name: str) -> str | None:
    return next((v for k, v in headers if k.lower() == name), None)


async def _relay_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None,
                      headers: list[tuple[str, str]], until_eof: bool, limit: int | None = None) -> bool:
    """Copy one message body (framing included) from reader to writer.

    Returns True if the body was delimited (connection reusable), False if read to EOF.
    With ``limit``, stops after that many body bytes (used by the BODY stall).
    """
    if "chunked" in (_get(headers, "transfer-encoding") or "").lower():
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0].strip(), 16)
            data = await reader.readexactly(size + 2) if size else b""
            if writer is not None:
                writer.write(size_line + data)
            if size == 0:
                while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                    if writer is not None:
                        writer.write(trailer)
                if writer is not None:
                    writer.write(b"\r\n")
                    await writer.drain()
                return True
            if writer is not None:
                await writer.drain()
    length = _get(headers, "content-length")
    remaining = int(length) if length is not None else (-1 if until_eof else 0)
    if limit is not None and remaining >= 0:
        remaining = min(remaining, limit)
    while remaining != 0:
        data = await reader.read(_CHUNK if remaining < 0 else min(_CHUNK, remaining))
        if not data:
            if remaining > 0:
                raise asyncio.IncompleteReadError(b"", remaining)
            return False
        if writer is not None:
            writer.write(data)
            await writer.drain()
        if remaining > 0:
            remaining -= len(data)
    return length is not None or not until_eof


def _abort_with_rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """Fault-injecting HTTP/1.1 proxy on ``127.0.0.1:port`` in front of an upstream.

    Args:
        upstream_host: Loopback host of the real server.
        upstream_port: Its port.
        port: Port to listen on; 0 picks a free one (read ``.port`` after ``start()``).
        latency_ms: Delay added once per request before it is handled.
        seed: Seed of the RNG used by probabilistic rules.
        log_size: How many recent requests ``.requests`` keeps.
    """

    def __init__(self, upstream_host: str, upstream_port: int, *, port: int = 0, latency_ms: float = 0.0,
                 seed: int = 0, log_size: int = 10_000) -> None:
        _check_loopback(upstream_host, "upstream host")
        self.upstream = (upstream_host, int(upstream_port))
        self.host, self.port = "127.0.0.1", port
        self._lock = threading.Lock()
        self._latency_s = latency_ms / 1000.0
        self._rng = random.Random(seed)
        self._rules: list[Rule] = []
        self._seen = 0
        self._faults: Counter[str] = Counter()
        self._log: deque[Request] = deque(maxlen=log_size)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._error: BaseException | None = None

    # -- configuration, thread-safe -------------------------------------------------
    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``: use as endpoint_url (S3) or URL base (HTTP)."""
        return f"http://{self.host}:{self.port}"

    endpoint_url = url

    def set_latency(self, ms: float) -> None:
        """Add ``ms`` milliseconds before each request from now on (0 disables)."""
        if ms < 0:
            raise ValueError(f"latency must be >= 0 ms, got {ms}")
        with self._lock:
            self._latency_s = ms / 1000.0

    def add_rule(self, rule: Rule) -> Rule:
        """Append a rule; rules fire in the order added, the first match wins."""
        with self._lock:
            self._rules.append(rule)
        return rule

    def fail_next(self, n: int = 1, status: int = 503, match: Callable[[Request], bool] | None = None) -> Rule:
        """Answer the next ``n`` matching requests with ``status`` (S3-style XML error body)."""
        return self.add_rule(Rule(Fault.FAIL, remaining=n, status=status, match=match))

    def fail_randomly(self, probability: float, status: int = 503,
                      match: Callable[[Request], bool] | None = None) -> Rule:
        """Answer each matching request with ``status`` with ``probability`` (seeded RNG)."""
        return self.add_rule(Rule(Fault.FAIL, remaining=None, probability=probability, status=status, match=match))

    def reset_next(self, n: int = 1, match: Callable[[Request], bool] | None = None) -> Rule:
        """Abort the client connection with a TCP RST on the next ``n`` matching requests."""
        return self.add_rule(Rule(Fault.RESET, remaining=n, match=match))

    def stall_next(self, n: int = 1, mode: StallMode = StallMode.REQUEST,
                   match: Callable[[Request], bool] | None = None) -> Rule:
        """Never finish the next ``n`` matching requests (see :class:`StallMode`)."""
        return self.add_rule(Rule(Fault.STALL, remaining=n, stall_mode=StallMode(mode), match=match))

    def clear_faults(self) -> None:
        """Remove every rule and the latency; counters are kept."""
        with self._lock:
            self._rules.clear()
            self._latency_s = 0.0

    @property
    def requests_seen(self) -> int:
        """Number of requests parsed so far (faulted ones included)."""
        with self._lock:
            return self._seen

    @property
    def faults_injected(self) -> dict[str, int]:
        """How many times each fault fired, keyed by ``Fault.value``."""
        with self._lock:
            return dict(self._faults)

    @property
    def requests(self) -> list[Request]:
        """The most recent requests, oldest first."""
        with self._lock:
            return list(self._log)

    def reset_counters(self) -> None:
        """Zero ``requests_seen``, ``faults_injected`` and the request log."""
        with self._lock:
            self._seen = 0
            self._faults.clear()
            self._log.clear()

    def _decide(self, request: Request) -> tuple[float, Rule | None]:
        with self._lock:
            self._seen += 1
            self._log.append(request)
            for rule in self._rules:
                if rule.remaining == 0 or (rule.match is not None and not rule.match(request)):
                    continue
                if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                    continue
                if rule.remaining is not None:
                    rule.remaining -= 1
                self._faults[rule.fault.value] += 1
                return self._latency_s, rule
            return self._latency_s, None

    # -- lifecycle ----------------------------------------------------------------
    def start(self) -> FaultProxy:
        """Start the event-loop thread and block until the proxy listens."""
        if self._thread is not None:
            return self
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"FaultProxy->{self.upstream}",
                                        daemon=True)
        self._thread.start()
        ready.wait(10)
        if self._error is not None or not ready.is_set():
            self.stop()
            raise RuntimeError(f"fault proxy for {self.upstream} failed to start") from self._error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Close the listener and every connection, then join the thread."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if self._loop is not None and self._stopping is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                self._loop.call_soon_threadsafe(self._stopping.set)
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(f"fault proxy thread {thread.name} did not stop within {timeout} s")

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"FaultProxy({self.url} -> {self.upstream[0]}:{self.upstream[1]}, seen={self._seen})"

    def _run(self, ready: threading.Event) -> None:
        try:
            asyncio.run(self._main(ready))
        except BaseException as exc:  # noqa: BLE001 (reported by start())
            self._error = exc
            ready.set()

    async def _main(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._on_client, self.host, self.port, limit=_HEAD_LIMIT)
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        try:
            await self._stopping.wait()
        finally:
            # Stop accepting but keep the server open until accepted connections reach their
            # handler: closing it first makes 3.11 drop (and leak) a socket being accepted.
            for sock in server.sockets:
                self._loop.remove_reader(sock.fileno())
            for _ in range(10):  # accept -> transport -> connection_made -> handler task
                await asyncio.sleep(0)
            server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await server.wait_closed()

    # -- per connection -------------------------------------------------------------
    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # client closed between requests
                keep, upstream = await self._handle(head, reader, writer, upstream)
                if not keep:
                    return
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            return  # a broken peer ends only its own connection
        except asyncio.CancelledError:
            # stop() cancels us; ending as cancelled trips a 3.11 asyncio.streams callback bug.
            return
        finally:
            self._tasks.discard(task)
            for w in (writer, upstream[1] if upstream else None):
                if w is not None:
                    w.close()
                    with contextlib.suppress(Exception):
                        await w.wait_closed()

    async def _handle(self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None,
                      ) -> tuple[bool, tuple[asyncio.StreamReader, asyncio.StreamWriter] | None]:
        request_line, headers = _parse_head(head)
        method, target, version = [*request_line.split(" "), "", ""][:3]
        request = Request(method, target, tuple(headers))
        latency_s, rule = self._decide(request)
        if latency_s:
            await asyncio.sleep(latency_s)
        expect = (_get(headers, "expect") or "").lower() == "100-continue"
        if expect:  # answer the interim response ourselves; the upstream never sees Expect
            headers = [(k, v) for k, v in headers if k.lower() != "expect"]
            if rule is None or rule.fault is Fault.FAIL or rule.stall_mode in (StallMode.BODY, StallMode.CUT):
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        client_close = (_get(headers, "connection") or "").lower() == "close" or version == "HTTP/1.0"
        if rule is not None and rule.fault is Fault.RESET:
            _abort_with_rst(writer)
            return False, upstream
        if rule is not None and rule.fault is Fault.STALL and rule.stall_mode is StallMode.REQUEST:
            await self._hang(reader)
            return False, upstream
        if rule is not None and rule.fault is Fault.FAIL:
            await _relay_body(reader, None, headers, until_eof=False)
            self._send_error(writer, rule.status, method, target)
            await writer.drain()
            return not client_close, upstream
        # Forward (possibly with a BODY stall after the headers).
        if upstream is None or upstream[0].at_eof():
            if upstream is not None:
                upstream[1].close()
            try:
                upstream = await asyncio.open_connection(*self.upstream, limit=_HEAD_LIMIT)
            except OSError:
                await _relay_body(reader, None, headers, until_eof=False)
                self._send_error(writer, 502, method, target)
                await writer.drain()
                return False, None
        up_reader, up_writer = upstream
        head_out = "\r\n".join([request_line] + [f"{k}: {v}" for k, v in headers]) + "\r\n\r\n"
        up_writer.write(head_out.encode("latin-1"))
        await _relay_body(reader, up_writer, headers, until_eof=False)
        await up_writer.drain()
        while True:  # skip interim 1xx responses from the upstream
            resp_head = await up_reader.readuntil(b"\r\n\r\n")
            status_line, resp_headers = _parse_head(resp_head)
            status = int(status_line.split(" ")[1])
            if status >= 200 or status == 101:
                break
            if not expect:
                writer.write(resp_head)
        writer.write(resp_head)
        if rule is not None:  # StallMode.BODY: half the body, then silence
            length = _get(resp_headers, "content-length")
            if length is not None and method != "HEAD":
                await _relay_body(up_reader, writer, resp_headers, until_eof=False, limit=int(length) // 2)
            await writer.drain()
            if rule.stall_mode is StallMode.CUT:  # a body shorter than its Content-Length
                writer.close()
                return False, upstream
            await self._hang(reader)
            return False, upstream
        no_body = method == "HEAD" or status in (204, 304)
        delimited = True if no_body else await _relay_body(up_reader, writer, resp_headers, until_eof=True)
        await writer.drain()
        upstream_close = (_get(resp_headers, "connection") or "").lower() == "close"
        if upstream_close or not delimited:
            return False, upstream
        return not client_close, upstream

    async def _hang(self, reader: asyncio.StreamReader) -> None:
        """Wait until the client gives up (EOF) or the proxy stops; answer nothing."""
        assert self._stopping is not None
        stop = asyncio.ensure_future(self._stopping.wait())
        read: asyncio.Future[bytes] | None = None
        try:
            while True:  # bytes the client sends meanwhile (a pipelined request) are dropped
                read = asyncio.ensure_future(reader.read(_CHUNK))
                done, _ = await asyncio.wait({read, stop}, return_when=asyncio.FIRST_COMPLETED)
                if read not in done or not read.result():
                    return
        finally:
            stop.cancel()
            if read is not None:
                read.cancel()

    @staticmethod
    def _send_error(writer: asyncio.StreamWriter, status: int, method: str, target: str) -> None:
        code = "SlowDown" if status == 503 else "InternalError"
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>fault injected by faultproxy for {method} {target}</Message>"
                "<RequestId>faultproxy</RequestId></Error>").encode()
        reason = _REASONS.get(status, "Error")
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")
        writer.write(head.encode("latin-1") + (b"" if method == "HEAD" else body))


def main(argv: list[str] | None = None) -> int:
    """Run the proxy in the foreground until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the real server (loopback)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: a free one)")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--fail-probability", type=float, default=0.0)
    parser.add_argument("--fail-next", type=int, default=0)
    parser.add_argument("--fail-status", type=int, default=503)
    parser.add_argument("--reset-next", type=int, default=0)
    parser.add_argument("--stall-next", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    proxy = FaultProxy(host, int(port), port=args.port, latency_ms=args.latency_ms, seed=args.seed)
    for n, add in ((args.reset_next, proxy.reset_next), (args.stall_next, proxy.stall_next)):
        if n:
            add(n)
    if args.fail_next:
        proxy.fail_next(args.fail_next, status=args.fail_status)
    if args.fail_probability:
        proxy.fail_randomly(args.fail_probability, status=args.fail_status)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    # SIGUSR1: print the requests seen so far (benchmarks count a run's GETs at the server)
    signal.signal(signal.SIGUSR1, lambda *_: print(f"requests seen: {proxy.requests_seen}", flush=True))
    with proxy:
        print(f"faultproxy listening on {proxy.url} -> {args.upstream}", flush=True)
        done.wait()
        print(f"requests seen: {proxy.requests_seen}, faults: {proxy.faults_injected}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
