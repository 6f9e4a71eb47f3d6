"""The identity check of the member-table fast path (wds_pad.tar.names): the header
before each payload names its sample in every header form, another sample's name is
refused, and slice_sample cuts a sample's bytes as the parser does."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from wds_pad.tar.names import NAME, names_sample, slice_sample
from wds_pad.tar.scan import ScannedSample, parse_sample, scan_tar

FORMS = ["ustar-prefix", "pax-non-ascii", "pax-long", "gnu-long"]


def _shard(path: Path, form: str) -> ScannedSample:
    """A shard of samples whose names take ``form``'s header; its first sample, scanned."""
    fmt = {"ustar-prefix": tarfile.USTAR_FORMAT, "gnu-long": tarfile.GNU_FORMAT}.get(form, tarfile.PAX_FORMAT)
    with tarfile.open(path, "w", format=fmt) as tf:
        for i in range(3):
            key = {"ustar-prefix": "dir.v1/" + "p" * 90 + f"/k{i:03d}", "pax-non-ascii": f"caf\u00e9-{i:03d}",
                   "pax-long": "l" * 130 + f"{i:03d}", "gnu-long": "g" * 130 + f"{i:03d}"}[form]
            for ext, data in (("bin", os.urandom(50 + i)), ("json", json.dumps({"i": i}).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime = len(data), 0
                tf.addfile(info, io.BytesIO(data))
    with open(path, "rb") as f:
        return next(iter(scan_tar(f, str(path))))


def _table(s: ScannedSample) -> tuple[bytes, list[str], list[int], list[int]]:
    """The sample's member table entry, as streaming builds it from an index."""
    token = (s.key + ".").encode("utf-8")[:NAME]
    return (token, [m.ext for m in s.members], [m.data_offset - 512 - s.offset for m in s.members],
            [m.size for m in s.members])


@pytest.mark.parametrize("form", FORMS)
def test_names_sample_accepts_each_header_form_and_refuses_another_name(tmp_path: Path, form: str) -> None:
    s = _shard(tmp_path / "s.tar", form)
    data = (tmp_path / "s.tar").read_bytes()[s.offset : s.offset + s.length]
    head = s.members[0].data_offset - 512 - s.offset
    assert names_sample(data, head, s.key)
    # another name: refused (beyond a name field's 100 bytes a long name is not compared)
    assert not names_sample(data, head, "z" + s.key[1:])
    assert names_sample(data, head, s.key[:-1] + "x") == (form in ("pax-long", "gnu-long"))


@pytest.mark.parametrize("form", FORMS)
def test_slice_sample_gives_the_parsed_sample_or_none(tmp_path: Path, form: str) -> None:
    s = _shard(tmp_path / "s.tar", form)
    data = (tmp_path / "s.tar").read_bytes()[s.offset : s.offset + s.length]
    table = _table(s)
    assert slice_sample(data, s.key, table) == parse_sample(data, str(tmp_path / "s.tar"), s.offset, s.key)
    assert slice_sample(data, "z" + s.key[1:], _table(ScannedSample("z" + s.key[1:], s.offset, s.length,
                                                                   s.members))) is None
    tok, exts, heads, sizes = table
    assert slice_sample(data, s.key, (tok, exts, heads, [*sizes[:-1], len(data)])) is None  # past the range
