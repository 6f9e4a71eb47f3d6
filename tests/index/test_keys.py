"""Keys exactly as webdataset reads them: a member name that is not UTF-8 (raw bytes in a
ustar or GNU header, a pax ``path`` with or without ``hdrcharset=BINARY``) is kept, its
key (``'k\\udcff1'``) round-trips through the index file, ``--update`` and the merge of
parts, and streaming (local and over HTTP, 0 and 2 DataLoader workers) yields the same
keys and bytes as ``wds.WebDataset``."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from wds_pad import BucketedWebDataset, Loader, Topology
from wds_pad.cli.producers import write_samples
from wds_pad.index.build import build_index
from wds_pad.index.codec import load_index, serialize
from wds_pad.index.merge import merged_parts
from wds_pad.stream.stages import _keys

from data_helpers import serve_dir, wds_reference, write_pax_raw_path

pytest_plugins = ["conftest_servers"]

#: form -> producer (None: a pax path record of raw bytes, no hdrcharset)
FORMS = {"ustar": "tarfile-ustar", "gnu": "tarfile-gnu", "pax-binary": "tarfile-pax", "webdataset": "webdataset",
         "pax-raw-path": None}
KEYS = ["k000", "k\udcff1", "caf\u00e9\udce9", "d\udc80/\udcc3x", "k\udcff" * 60]  # the last: a long name


def _samples(form: str) -> list[dict[str, Any]]:
    keys = [k for k in KEYS if form not in ("ustar",) or len(k) < 100]  # ustar: no record for a long name
    return [{"__key__": k, "bin": os.urandom(100 + i), "json": json.dumps({"width": 4 + i % 2, "height": 3}).encode()}
            for i, k in enumerate(keys)]


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("keys")
    for i, (form, producer) in enumerate(FORMS.items()):
        if producer is None:
            write_pax_raw_path(root / f"shard-{i:06d}.tar", _samples(form))
        else:
            written = write_samples(root / form, [_samples(form)], producer)[0]
            os.replace(written, root / f"shard-{i:06d}.tar")
    return root


@pytest.fixture(scope="module")
def urls(shard_dir: Path) -> list[str]:
    return [str(shard_dir / f"shard-{i:06d}.tar") for i in range(len(FORMS))]


def _keys_in_order(index: Any) -> list[str]:
    """The index's keys in shard then byte order."""
    order = np.lexsort((index.offset, index.shard))
    return [index.key(int(i)) for i in order]


def _same_as_webdataset(batches: list[list[dict[str, Any]]], urls: list[str]) -> None:
    """Every streamed sample has the key, members and bytes webdataset reads from its shard,
    and every sample is streamed (keys repeat across the shards: compared per shard)."""
    def payload(s: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in s.items() if not k.startswith("__")}

    want = {(Path(s["__url__"]).name, s["__key__"]): payload(s) for s in wds_reference(urls, by_url=True).values()}
    got = {(Path(s["__url__"]).name, s["__key__"]): payload(s) for b in batches for s in b}
    assert got == want


def _dataset(index: Any, **kw: Any) -> BucketedWebDataset:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BucketedWebDataset(index, batch_size=2, seed=1, topology=Topology(world_size=1, rank=0),
                                  check_agreement=False, **kw)


def test_webdataset_reads_the_names_as_escaped_keys(urls: list[str]) -> None:
    """The oracle: each form's names come back as the keys written, surrogate escapes included."""
    reference = list(wds_reference(urls, by_url=True).values())
    assert [s["__key__"] for s in reference] == [s["__key__"] for form in FORMS for s in _samples(form)]


def test_keys_round_trip_through_the_index_file(urls: list[str], tmp_path: Path) -> None:
    want = [s["__key__"] for s in wds_reference(urls, by_url=True).values()]
    index = build_index(urls, "aspect:width,height", output=str(tmp_path / "k.wdsidx"))
    loaded = load_index(str(tmp_path / "k.wdsidx"))
    assert _keys_in_order(index) == _keys_in_order(loaded) == want
    assert loaded.excluded["count"] == 0 and all(s.error is None for s in loaded.shards)
    ids = np.arange(len(loaded))
    assert _keys(loaded, ids) == [loaded.key(int(i)) for i in ids]  # the stream's gather decodes alike
    # --update reuses every row (keys re-packed from the file), the bytes unchanged
    again = build_index(urls, "aspect:width,height", update=str(tmp_path / "k.wdsidx"), name="k")
    assert b"".join(map(bytes, serialize(again))) == (tmp_path / "k.wdsidx").read_bytes()
    # parts merged (a distributed build) give the bytes of one build
    parts = [build_index(urls[:2], "aspect:width,height"), build_index(urls[2:], "aspect:width,height")]
    merged = b"".join(map(bytes, merged_parts(parts, name="k")))
    assert merged == (tmp_path / "k.wdsidx").read_bytes()


@pytest.mark.parametrize("workers", [0, 2])
def test_stream_yields_webdataset_keys_and_bytes_local(urls: list[str], tmp_path: Path, workers: int) -> None:
    build_index(urls, "aspect:width,height", output=str(tmp_path / "k.wdsidx"))
    ds = _dataset(str(tmp_path / "k.wdsidx"))
    batches = list(Loader(ds, num_workers=workers)) if workers else list(ds)
    _same_as_webdataset(batches, urls)
    if not workers:
        assert ds.read_stats.exact_batches == 0  # the fast path read every one


@pytest.mark.parametrize("workers", [0, 2])
def test_stream_yields_webdataset_keys_and_bytes_over_http(shard_dir: Path, urls: list[str], nginx_server: Any,
                                                           tmp_path: Path, workers: int) -> None:
    base = serve_dir(nginx_server, shard_dir, f"keys-{tmp_path.name}")
    remote = [f"{base}/{Path(u).name}" for u in urls]
    index = build_index(remote, "aspect:width,height", output=str(tmp_path / "k.wdsidx"))
    assert _keys_in_order(index) == [s["__key__"] for s in wds_reference(urls, by_url=True).values()]
    ds = _dataset(str(tmp_path / "k.wdsidx"))
    batches = list(Loader(ds, num_workers=workers)) if workers else list(ds)
    _same_as_webdataset(batches, urls)
