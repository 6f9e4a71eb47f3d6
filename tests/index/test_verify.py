"""verify_index: shallow (size, change stamp) and deep (rescan, compare by key) checks."""

from __future__ import annotations

import os

from test_build import make_tar  # tests/index is on sys.path (pytest's rootdir-relative import)

from wds_pad.index.build import build_index
from wds_pad.index.verify import verify_index


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
