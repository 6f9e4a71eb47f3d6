"""Tests of wds_pad.io.fs: one filesystem per protocol chain and options, options per protocol.

That a forked child makes its own filesystems is tested with the reader
(tests/io/test_ranges.py).
"""

from __future__ import annotations

import pytest

from wds_pad.errors import ConfigError
from wds_pad.io.fs import get_filesystem
from wds_pad.io.ranges import RangeReader


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
