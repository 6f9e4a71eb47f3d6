"""verify_index: shallow (size, change stamp) and deep (rescan, compare every sample and
member with the index) checks; a shard rewritten in place (size and mtime kept) as deep
verification, the stream's fast path and an update with ``rescan`` see it."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import webdataset as wds
from test_build import make_tar  # tests/index is on sys.path (pytest's rootdir-relative import)

from wds_pad import BucketedWebDataset, Topology
from wds_pad.errors import ConfigError, StaleShardError
from wds_pad.index.build import build_index
from wds_pad.index.codec import load_index
from wds_pad.index.verify import verify_index

from data_helpers import rewrite_member_header


def test_verify_finds_touched_missing_and_moved_shards(tmp_path) -> None:
    a = [("x.txt", b"1" * 700), ("y.txt", b"2" * 700)]
    urls = [make_tar(str(tmp_path / "s0.tar"), a), make_tar(str(tmp_path / "s1.tar"), a[::-1]),
            make_tar(str(tmp_path / "s2.tar"), a)]
    index = build_index(urls)
    assert verify_index(index) == [] and verify_index(index, deep=True) == []
    st = os.stat(urls[0])
    make_tar(urls[0], a[::-1])  # same size, samples swapped ...
    os.utime(urls[0], ns=(st.st_atime_ns, st.st_mtime_ns))  # ... and the old mtime
    os.remove(urls[1])
    with open(urls[2], "ab") as f:
        f.write(b"\0" * 512)
    shallow = verify_index(index)
    assert [(p.url, p.reason.split()[0]) for p in shallow] == [(urls[1], "missing:"), (urls[2], "size")]
    deep = verify_index(index, deep=True)
    assert [p.url for p in deep] == urls
    assert "moved" in deep[0].reason


def test_deep_verify_says_what_differs_in_plain_ints(tmp_path) -> None:
    url = make_tar(str(tmp_path / "s.tar"), [("a.txt", b"1" * 700), ("b.txt", b"2" * 700)])
    index = build_index([url])
    st = os.stat(url)

    def rewrite(members) -> str:  # same size and mtime: only --deep sees it
        make_tar(url, members)
        os.utime(url, ns=(st.st_atime_ns, st.st_mtime_ns))
        [problem] = verify_index(index, deep=True)
        assert "np." not in problem.reason
        return problem.reason

    assert rewrite([("c.txt", b"1" * 700), ("b.txt", b"2" * 700)]) == (
        "sample 'a' was renamed: the sample at byte offset 0 is now key 'c' (1536 bytes; indexed: 1536 bytes)")
    assert rewrite([("b.txt", b"2" * 700), ("a.txt", b"1" * 700)]) == (
        "sample 'a' moved to another offset: indexed at byte offset 0 (1536 bytes), now at 1536 (1536 bytes)")


# -- a member header rewritten in place, the shard's size and mtime kept ----------------------
def _producer_shards(root, producer: str) -> list[str]:
    from wds_pad.cli.producers import write_samples

    meta = json.dumps({"width": 4, "height": 3}).encode()
    shards = [[{"__key__": f"s{s}k{i}", "bin": bytes([i]) * 1000, "json": meta} for i in range(4)] for s in range(2)]
    return write_samples(root, shards, producer)


def _in_place(url: str, key: str, how: str) -> None:
    """Rewrite the header of sample ``key``'s 1000-byte member (``rewrite_member_header``),
    then restore the shard's mtime: its size and change stamp are as indexed."""
    from wds_pad.tar.scan import scan_tar

    with open(url, "rb") as f:
        sample = next(s for s in scan_tar(f, url) if s.key == key)
    st = os.stat(url)
    blob = bytearray(open(url, "rb").read())
    rewrite_member_header(blob, next(m for m in sample.members if m.size == 1000), how)
    with open(url, "r+b") as f:
        f.write(blob)
    os.utime(url, ns=(st.st_atime_ns, st.st_mtime_ns))


def _stream(index) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = BucketedWebDataset(index, batch_size=2, seed=0, topology=Topology(world_size=1, rank=0),
                                check_agreement=False)
    return [s for b in ds for s in b]


@pytest.mark.parametrize("how", ["size", "ext"])
@pytest.mark.parametrize("producer", ["tarfile-ustar", "webdataset", "tarfile-gnu"])  # ustar, pax per member, gnu
def test_deep_verify_and_the_stream_see_a_header_rewritten_in_place(tmp_path, producer, how) -> None:
    urls = _producer_shards(tmp_path / "shards", producer)
    out = str(tmp_path / "i.wdsidx")
    index = build_index(urls, "aspect:width,height", output=out)
    assert verify_index(out, deep=True) == []
    _in_place(urls[1], "s1k2", how)
    seen = {s["__key__"]: s for s in wds.WebDataset(urls, shardshuffle=False)}
    assert (len(seen["s1k2"]["bin"]) == 1010) if how == "size" else ("bix" in seen["s1k2"])  # what webdataset reads
    assert verify_index(out) == []  # size and mtime as indexed: only a rescan sees it
    [problem] = verify_index(out, deep=True)
    assert problem.url == urls[1] and problem.rescan
    assert problem.reason == ("sample 's1k2': member 's1k2.bin' now holds 1010 bytes, 1000 indexed" if how == "size"
                              else "sample 's1k2' has members .bix, .json now, .bin, .json indexed")
    # the fast path checks each member's header against the member table
    with pytest.raises(StaleShardError) as info:
        _stream(load_index(out))
    assert f"{urls[1]}: sample 's1k2'" in str(info.value)
    assert ("now holds 1010 bytes, 1000 indexed" if how == "size" else "'s1k2.bin' is now named 's1k2.bix'") \
        in str(info.value)
    # an update decides on size and stamp: it keeps the stale rows, unless told to rescan
    kept = build_index(urls, "aspect:width,height", output=out, update=True)
    assert verify_index(kept, deep=True) == [problem]
    fixed = build_index(urls, "aspect:width,height", output=out, update=True, rescan=[urls[1]])
    assert verify_index(out, deep=True) == [] and len(fixed) == len(index)
    got = {s["__key__"]: s for s in _stream(load_index(out))}
    assert {k: {e: v for e, v in s.items() if not e.startswith("__")} for k, s in got.items()} == \
        {k: {e: v for e, v in s.items() if not e.startswith("__")} for k, s in seen.items()}


def test_rescan_is_refused_without_an_update_or_for_another_shard(tmp_path) -> None:
    urls = _producer_shards(tmp_path / "shards", "tarfile-ustar")
    out = str(tmp_path / "i.wdsidx")
    build_index(urls, output=out)
    with pytest.raises(ConfigError, match="needs --update"):
        build_index(urls, output=out, rescan=urls[:1])
    with pytest.raises(ConfigError, match=r"to rescan \(--rescan\) is not one of the 1 shards being indexed"):
        build_index(urls[:1], output=out, update=True, rescan=[urls[1]])
    with pytest.raises(ConfigError, match="no output is given"):
        build_index(urls, update=True)


def test_verify_refuses_a_deep_that_is_not_a_bool(tmp_path) -> None:
    shard = make_tar(str(tmp_path / "a.tar"), [("000.json", b"{}"), ("001.json", b"{}")])
    index = build_index([shard], "none")
    with pytest.raises(ConfigError, match="deep must be True or False, got str 'no'"):
        verify_index(index, deep="no")
    assert verify_index(index, deep=False) == []
