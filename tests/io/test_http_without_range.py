"""Shards served by an HTTP server that ignores ``Range`` (``python -m http.server``):
indexing works, ``locality="shard"`` streams whole shards without Range, and every read
that needs Range is refused with what works instead."""

from __future__ import annotations

import functools
import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from data_helpers import BUCKET_BY, assert_same_bytes, make_dataset, wds_reference
from wds_pad import ReadOptions, Topology, build_index, load_index
from wds_pad.cli.synth import make_image_shards
from wds_pad.cli.readfigures import figures
from wds_pad.core.local.locality import shard_map_of
from wds_pad.core.planning.plan import plan_epoch
from wds_pad.errors import ReadError, StaleShardError


class _Handler(http.server.SimpleHTTPRequestHandler):
    """The standard library's file server (it never answers a Range with 206), which
    notes each request's method, path and Range header."""

    seen: list[tuple[str, str, str | None]]

    def do_GET(self) -> None:
        self.seen.append(("GET", self.path, self.headers.get("Range")))
        super().do_GET()

    def do_HEAD(self) -> None:
        self.seen.append(("HEAD", self.path, self.headers.get("Range")))
        super().do_HEAD()

    def log_message(self, *args: Any) -> None:
        pass


class _Quiet(http.server.ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that has what it needs hangs up on the rest of a whole-file answer


class NoRangeServer:
    def __init__(self, root: Path) -> None:
        self.seen: list[tuple[str, str, str | None]] = []
        handler = type("Handler", (_Handler,), {"seen": self.seen})
        self.httpd = _Quiet(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def gets(self) -> list[tuple[str, str | None]]:
        return [(path, rng) for method, path, rng in self.seen if method == "GET"]


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[NoRangeServer]:
    srv = NoRangeServer(tmp_path / "www")
    srv.thread.start()
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()
    srv.thread.join(10)


@pytest.fixture()
def served(tmp_path: Path, server: NoRangeServer) -> tuple[list[str], list[str], Any]:
    """(local shard paths, their URLs on the server, the index built over HTTP)."""
    paths = make_image_shards(tmp_path / "www" / "s", samples=96, shards=4, seed=4)
    urls = [f"{server.url}/s/{os.path.basename(p)}" for p in paths]
    index = build_index(urls, BUCKET_BY, output=str(tmp_path / "http.wdsidx"))
    return paths, urls, load_index(str(tmp_path / "http.wdsidx"))


def test_indexing_over_a_server_that_ignores_range_finds_the_local_rows(served, tmp_path) -> None:
    paths, urls, index = served
    local = build_index(paths, BUCKET_BY)
    assert [s.size for s in index.shards] == [s.size for s in local.shards]
    assert np.array_equal(index.offset, local.offset) and np.array_equal(index.length, local.length)


def test_single_sample_reads_are_refused_saying_what_works(served, server) -> None:
    _, urls, index = served
    with pytest.raises(ReadError) as info:
        list(make_dataset(index, seed=0, batch_size=1, locality="none"))
    message = str(info.value)
    assert "the server ignored the Range header (as python -m http.server does)" in message
    assert "a server that honours Range (nginx" in message
    assert "or stream with locality='shard', which reads each shard whole in one GET without Range" in message
    assert any(u.replace(server.url, "") in message for u in urls)


def test_shard_locality_streams_whole_shards_without_range(served, server) -> None:
    paths, urls, index = served
    server.seen.clear()
    batches = list(make_dataset(index, seed=0, batch_size=1, locality="shard"))
    assert sum(len(b) for b in batches) == len(index)
    assert_same_bytes(batches, wds_reference(paths))
    gets = server.gets()
    assert sorted(path for path, _ in gets) == sorted(u.replace(server.url, "") for u in urls)  # each shard once
    assert all(rng is None for _, rng in gets), gets  # whole shards: asked for without Range


def test_a_shard_larger_than_a_block_says_how_large_a_block_must_be(served) -> None:
    _, _, index = served
    largest = max(s.size for s in index.shards)
    block = 8192
    assert largest > block
    with pytest.raises(ReadError) as info:
        list(make_dataset(index, seed=0, batch_size=1, locality="shard", read_options=ReadOptions(block_bytes=block)))
    message = str(info.value)
    assert "the server ignored the Range header" in message
    assert "raise ReadOptions(block_bytes=...) to the largest shard's size" in message
    assert f"a block {block})" in message
    ok = list(make_dataset(index, seed=0, batch_size=1, locality="shard", read_options=ReadOptions(block_bytes=largest)))
    assert sum(len(b) for b in ok) == len(index)


def test_a_foreign_sample_of_shard_locality_needs_range_and_says_so(served) -> None:
    _, _, index = served
    topo = Topology(world_size=2, rank=0)
    plan = plan_epoch(shard_map_of(index, index.to_dataset()), topo, seed=1, batch_size=2, locality="shard",
                      warn=False)
    reading = figures(plan, [index.shard], [index.length], [[s.size for s in index.shards]],
                      ReadOptions().block_bytes)
    assert reading.foreign > 0  # this rank reads some samples of another rank's shards
    with pytest.raises(ReadError, match=r"this sample is read alone \(a foreign sample of locality='shard'"):
        list(make_dataset(index, seed=1, batch_size=2, topology=topo, locality="shard", quiet=True))


def test_a_changed_shard_is_stale_though_the_server_sends_no_content_range(served) -> None:
    paths, urls, index = served
    with open(paths[2], "ab") as f:  # grown by a zero block: its indexed bytes are all still there
        f.write(b"\0" * 512)
    with pytest.raises(StaleShardError, match=rf"shard '{urls[2]}' changed since it was indexed: it now has "
                                              rf"{index.shards[2].size + 512} bytes"):
        list(make_dataset(index, seed=0, batch_size=1, locality="shard"))
