"""Tests of wds_pad.io.faults: every fault of a store judged in one place, as one of our errors.

How the reader retries or fails on each kind of fault is tested with the reader
(tests/io/test_ranges.py) and through a fault proxy (tests/io/test_faults.py).
"""

from __future__ import annotations

from typing import Any

import botocore.exceptions
import pytest

from wds_pad.errors import IndexFormatError, ReadError, ShardError, WdsPadError
from wds_pad.io.faults import call_store


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
        call_store(fail, url)
    assert url in str(info.value) and isinstance(info.value, WdsPadError)
    assert isinstance(info.value, OSError)


def test_store_faults_of_an_index_and_bugs() -> None:
    def missing() -> None:
        raise FileNotFoundError("gone")

    with pytest.raises(IndexFormatError, match="index 'memory://i.wdsidx' does not exist; build it"):
        call_store(missing, "memory://i.wdsidx", what="index", missing=IndexFormatError,
                   fix="build it with `wds-pad index`")

    def forbidden() -> None:
        raise PermissionError("denied")

    with pytest.raises(ReadError, match="not readable"):  # an index: not IndexFormatError
        call_store(forbidden, "memory://i.wdsidx", what="index", missing=IndexFormatError,
                   fix="")

    def bug() -> None:
        raise KeyError("ours")

    with pytest.raises(KeyError):  # not a store's fault: raised as it is
        call_store(bug, "s3://b/x.tar")
