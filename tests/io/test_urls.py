"""Tests of wds_pad.io.urls: the one rule for "is this URL a local file", and its callers.

Every form a caller meets is in one table: the rule's answer (``local_path``), the
reader's (``RangeReader.is_local``, decided by the filesystem fsspec resolves), and what
webdataset's opener reports as ``__local_path__`` (a rule of its own, reproduced by
``wds_pad.stream.shards.local_path`` so samples carry the same metadata).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from wds_pad.errors import ConfigError
from wds_pad.index.shardfile import plain_local
from wds_pad.io.ranges import RangeReader
from wds_pad.io.urls import canonical_url, is_local, local_path

ERROR = "error"  # get_filesystem refuses the URL

# url, local_path(url), RangeReader.is_local(url), webdataset's __local_path__
TABLE = [
    ("/data/a.tar", "/data/a.tar", True, "/data/a.tar"),
    ("rel/a.tar", "rel/a.tar", True, "rel/a.tar"),
    ("./a.tar", "./a.tar", True, "./a.tar"),
    ("../x/a.tar", "../x/a.tar", True, "../x/a.tar"),
    ("~/a.tar", "~/a.tar", True, "~/a.tar"),
    ("/data/a b.tar", "/data/a b.tar", True, "/data/a b.tar"),
    ("/data/a?b.tar", "/data/a?b.tar", True, "/data/a"),  # webdataset: the rest is a query
    ("/data/a#b.tar", "/data/a#b.tar", True, "/data/a"),  # ... or a fragment
    ("c:/data/a.tar", "c:/data/a.tar", True, None),  # webdataset: scheme "c"
    ("file:///data/a.tar", "/data/a.tar", True, "/data/a.tar"),
    ("file://rel/a.tar", "rel/a.tar", True, "/a.tar"),  # webdataset: host "rel"
    ("file://localhost/data/a.tar", "localhost/data/a.tar", True, "/data/a.tar"),
    ("file:/data/a.tar", "file:/data/a.tar", True, "/data/a.tar"),
    ("local:///data/a.tar", None, True, None),  # fsspec's other name of its local filesystem
    ("s3://b/a.tar", None, False, None),
    ("https://h/a.tar", None, False, None),
    ("http://h/a.tar?x=1", None, False, None),
    ("memory://a.tar", None, False, None),
    ("simplecache::s3://b/a.tar", None, False, None),
    ("simplecache::/data/a.tar", None, False, None),
    ("simplecache::file:///data/a.tar", None, False, None),
    ("file::/data/a.tar", None, True, ":/data/a.tar"),
    ("/data/a::b.tar", None, True, "/data/a::b.tar"),
    ("/data/x://y.tar", None, ERROR, "/data/x://y.tar"),
]
IDS = [row[0] for row in TABLE]


@pytest.mark.parametrize("url,path,reader,wds", TABLE, ids=IDS)
def test_local_path_and_is_local_follow_the_table(url: str, path: str | None, reader: object,
                                                  wds: str | None) -> None:
    assert local_path(url) == path
    assert is_local(url) is (path is not None)


@pytest.mark.parametrize("url,path,reader,wds", TABLE, ids=IDS)
def test_canonical_url_makes_local_paths_absolute_and_keeps_the_rest(url: str, path: str | None,
                                                                     reader: object, wds: str | None) -> None:
    expected = url if path is None else os.path.abspath(path)
    assert canonical_url(url) == expected


@pytest.mark.parametrize("url,path,reader,wds", TABLE, ids=IDS)
def test_the_indexer_stats_absolute_local_paths_without_fsspec(url: str, path: str | None,
                                                               reader: object, wds: str | None) -> None:
    assert plain_local(url) is (path is not None and url.startswith("/"))


@pytest.mark.parametrize("url,path,reader,wds", TABLE, ids=IDS)
def test_the_reader_asks_the_filesystem(url: str, path: str | None, reader: object, wds: str | None) -> None:
    if url.startswith("s3://") or url.startswith("simplecache::s3://"):
        pytest.importorskip("s3fs")
    with RangeReader() as r:
        if reader == ERROR:
            with pytest.raises(ConfigError):
                r.is_local(url)
        else:
            assert r.is_local(url) is reader
    # where the URL alone says local, the filesystem agrees
    if path is not None:
        assert reader is True


@pytest.mark.parametrize("url,path,reader,wds", TABLE, ids=IDS)
def test_samples_carry_the_local_path_webdataset_reports(url: str, path: str | None, reader: object,
                                                         wds: str | None) -> None:
    from wds_pad.stream.shards import local_path as wds_local_path

    assert wds_local_path(url) == wds


def test_the_rule_has_one_home() -> None:
    """No other module of the package tells a local path by its ``file://`` prefix."""
    root = Path(__file__).resolve().parents[2] / "wds_pad"
    home = root / "io" / "urls.py"
    found = [f"{p.relative_to(root)}:{n}" for p in sorted(root.rglob("*.py")) if p != home
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"""["']file://""", line)]
    assert found == []
