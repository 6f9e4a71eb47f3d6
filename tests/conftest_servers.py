"""Pytest fixtures for loopback servers: moto (S3), nginx (HTTP ranges), fault proxy.

Load as a plugin: ``pytest_plugins = ["conftest_servers"]`` in a test module or in the
top-level ``tests/conftest.py`` (``tests/`` is on ``sys.path`` under pytest's default
import mode, so no ``tests/__init__.py`` is needed).

Fixtures:
- ``moto_server`` (session): a running :class:`servers.MotoServer`. Use a bucket of
  your own (``s3_bucket``) so tests stay independent.
- ``s3_bucket`` (function): a new, empty bucket on ``moto_server``; returns its name.
- ``nginx_server`` (session): :class:`servers.NginxServer` serving ``.root_dir`` (a
  session tmp dir: write files there, read them at ``.url + "/name"``). Without nginx it
  is a :class:`servers.PythonHttpServer`, whose repr says "nginx fallback".
- ``fault_proxy`` (function): a factory ``make(upstream, **kwargs) -> FaultProxy``;
  ``upstream`` is a server object, a ``(host, port)`` pair or an ``http://host:port``
  URL. Every proxy it made is stopped after the test.
"""

from __future__ import annotations

import itertools
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from faultproxy import FaultProxy  # tools/ is on sys.path: tests/conftest.py
from servers import MotoServer, NginxServer, PythonHttpServer, http_server

_BUCKETS = itertools.count()


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """A moto S3 server for the whole session, stopped (and reaped) at the end."""
    with MotoServer() as server:
        yield server


@pytest.fixture
def s3_bucket(moto_server: MotoServer, request: pytest.FixtureRequest) -> str:
    """A fresh bucket named after the test (S3 rules: 3-63 chars, lowercase, digits, '-')."""
    stem = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    return moto_server.make_bucket(f"t{next(_BUCKETS):04d}-{stem}".rstrip("-"))


@pytest.fixture(scope="session")
def nginx_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NginxServer | PythonHttpServer]:
    """nginx serving a session tmp dir, or the Python fallback where nginx is missing."""
    with http_server(tmp_path_factory.mktemp("www")) as server:
        yield server


def _address(upstream: Any) -> tuple[str, int]:
    if isinstance(upstream, tuple):
        return str(upstream[0]), int(upstream[1])
    if isinstance(upstream, str):
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.hostname is None or parsed.port is None:
            raise ValueError(f"fault_proxy upstream URL needs host and port, got {upstream!r}")
        return parsed.hostname, parsed.port
    return str(upstream.host), int(upstream.port)


@pytest.fixture
def fault_proxy() -> Iterator[Callable[..., FaultProxy]]:
    """Factory of started FaultProxy instances; all are stopped after the test."""
    proxies: list[FaultProxy] = []

    def make(upstream: Any, **kwargs: Any) -> FaultProxy:
        proxy = FaultProxy(*_address(upstream), **kwargs)
        proxies.append(proxy)
        return proxy.start()

    yield make
    for proxy in proxies:
        proxy.stop()
