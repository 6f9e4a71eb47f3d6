"""Shared test data: generated shards and their index, the same shards published on a
loopback server, webdataset's own reading of them, datasets with the tests' defaults,
and the keys of what a plan or a stream holds.

Test modules that stream real shards build them here, so each kind of test data is made
one way (shards are generated in the pytest tmp dir given, never committed). Module
fixtures stay in the modules: each picks its own sizes and seeds and calls these.

Invariants:
- :func:`aspect_index` and :func:`image_index` return the index loaded back from the
  file they wrote (memory-mapped, as a rank loads it), never the in-memory build;
- :func:`wds_reference` is ``wds.WebDataset``'s reading of the same shards from local
  disk: the oracle for every byte a test streams;
- :func:`make_dataset` starts from :data:`DS_DEFAULTS` (batch 4, one rank); keyword
  arguments override them, and nothing else is changed;
- :func:`open_descriptors` counts this process's descriptors of the given files only
  (sockets of earlier tests close on their own time).
"""

from __future__ import annotations

import io

import os
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import webdataset as wds

from wds_pad import BucketedWebDataset, Index, Topology, build_index, load_index
from wds_pad.cli.synth import make_image_shards

BUCKET_BY = "aspect:width,height"
DS_DEFAULTS: dict[str, Any] = dict(batch_size=4, topology=Topology(world_size=1, rank=0))


def aspect_index(paths: list[str], output: str | os.PathLike[str]) -> Index:
    """The aspect-bucket index of ``paths``, written to ``output`` and loaded back."""
    built = build_index(paths, BUCKET_BY, output=str(output))
    return load_index(built.path)  # type: ignore[arg-type]


def image_index(directory: Path, *, samples: int, shards: int, seed: int, name: str = "index.wdsidx") -> Index:
    """``make_image_shards`` in ``directory``, indexed by aspect into ``directory/name``."""
    paths = make_image_shards(directory, samples=samples, shards=shards, seed=seed)
    return aspect_index(paths, directory / name)


def upload_files(moto_server: Any, bucket: str, paths: Iterable[str | os.PathLike[str]]) -> str:
    """Create ``bucket`` on a ``servers.MotoServer`` and copy each local file into it under
    its file name; the bucket's name."""
    moto_server.make_bucket(bucket)
    client = moto_server.client()  # one client for every file: each new client costs a handshake
    for path in paths:
        client.upload_file(os.fspath(path), bucket, Path(path).name)
    return bucket


def serve_dir(server: Any, src: Path, name: str, ignore: Any = None) -> str:
    """Copy ``src`` to ``name`` under an HTTP server's ``root_dir`` (``shutil.copytree``'s
    ``ignore``); its base URL."""
    shutil.copytree(src, server.root_dir / name, ignore=ignore, dirs_exist_ok=True)
    return f"{server.url}/{name}"


def wds_reference(urls: Iterable[str], *, by_url: bool = False) -> dict[str, dict[str, Any]]:
    """Every sample as webdataset reads it, by ``__key__`` (``by_url``: by ``__url__/__key__``)."""
    samples = wds.WebDataset(list(urls), shardshuffle=False)
    return {(s["__url__"] + "/" + s["__key__"] if by_url else s["__key__"]): s for s in samples}


def assert_same_bytes(batches: Iterable[list[dict[str, Any]]], reference: dict[str, dict[str, Any]]) -> None:
    """Each streamed sample has exactly the members and bytes of its reference sample."""
    for batch in batches:
        for s in batch:
            ref = reference[s["__key__"]]
            members = {k for k in ref if not k.startswith("__")}
            assert members == {k for k in s if not k.startswith("__")}
            assert all(s[k] == ref[k] for k in members), s["__key__"]


def make_dataset(index: Index | str, *, quiet: bool = False, **kw: Any) -> BucketedWebDataset:
    """A :class:`BucketedWebDataset` of ``index`` with :data:`DS_DEFAULTS` overridden by ``kw``.

    ``quiet``: warnings raised while it is built (dropped buckets, oversubscription) are
    ignored.
    """
    args = {**DS_DEFAULTS, **kw}
    if not quiet:
        return BucketedWebDataset(index, **args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BucketedWebDataset(index, **args)


def plan_keys(plan: Iterable[Any], index: Index) -> list[list[str]]:
    """The keys of each planned batch (``batch.samples`` through ``index.key``)."""
    return [[index.key(int(i)) for i in b.samples] for b in plan]


def batch_keys(batches: Iterable[list[dict[str, Any]]]) -> list[list[str]]:
    """The ``__key__`` of each streamed sample, batch by batch."""
    return [[s["__key__"] for s in b] for b in batches]


class NonSeekable(io.RawIOBase):
    """A streaming body: no seek, and short reads of at most ``step`` bytes."""

    def __init__(self, data: bytes, step: int = 1 << 20) -> None:
        self._f, self._step = io.BytesIO(data), step

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
        n = min(len(b), self._step)
        chunk = self._f.read(n)
        b[: len(chunk)] = chunk
        return len(chunk)


def write_pax_raw_path(path: str | os.PathLike[str], samples: Iterable[dict[str, Any]]) -> str:
    """A shard whose members each follow a pax header holding the member's name as a raw
    ``path`` record with no ``hdrcharset`` (as GNU tar 1.23 and older wrote names it could
    not convert to UTF-8); the ustar name field holds a stand-in. A key's surrogate
    escapes (``'k\\udcff1'``) become those raw bytes, as ``tarfile`` writes them."""

    def header(name: bytes, size: int, kind: bytes) -> bytes:
        h = bytearray(512)
        h[: len(name)] = name
        h[100:108], h[108:116], h[116:124] = b"0000444\0", b"0000000\0", b"0000000\0"
        h[124:136], h[136:148], h[156:157], h[257:265] = b"%011o\0" % size, b"%011o\0" % 0, kind, b"ustar\x0000"
        h[148:156] = b" " * 8
        h[148:156] = b"%06o\0 " % sum(h)
        return bytes(h)

    def padded(b: bytes) -> bytes:
        return b + bytes(-len(b) % 512)

    out = []
    for s in samples:
        for ext, data in s.items():
            if ext.startswith("__"):
                continue
            name = s["__key__"].encode("utf-8", "surrogateescape") + b"." + ext.encode()
            body = b" path=" + name + b"\n"
            digits = len(str(len(body)))
            length = len(body) + digits + (len(str(len(body) + digits)) > digits)  # the length counts itself
            record = b"%d" % length + body
            out += [header(b"PaxHeader", len(record), b"x"), padded(record),
                    header(b"stand-in." + ext.encode(), len(data), b"0"), padded(data)]
    Path(path).write_bytes(b"".join(out) + bytes(1024))
    return os.fspath(path)


def rewrite_member_header(blob: bytearray, member: Any, how: str, size: int | None = None) -> None:
    """Rewrite a member's headers in ``blob`` (a shard's bytes) in place, every offset kept,
    checksums fixed: ``"size"``: its size field says ``size`` (default: 10 bytes more,
    within the same padding); ``"ext"``: its extension ``x`` becomes ``bix`` (3 letters);
    ``"key"``: its key's last character becomes ``~``. ``member`` is a scanned
    ``wds_pad.tar.scan.Member``; the name is changed wherever the headers spell it (the
    name field, or its ``?`` form for a non-ASCII name; a pax ``path`` record; a GNU long
    name; the name field under a ustar prefix)."""
    own = member.data_offset - 512
    heads, pos = [], member.header_offset  # every header block from the member's first to its own
    while pos <= own:
        heads.append(pos)
        pos += 512 + (int(blob[pos + 124 : pos + 135], 8) + 511) // 512 * 512
    if how == "size":
        blob[own + 124 : own + 136] = b"%011o\0" % (member.size + 10 if size is None else size)
    else:
        raw = member.name.encode("utf-8", "surrogateescape")
        stem, ext = raw.rsplit(b".", 1)
        new = stem + b".bix" if how == "ext" else stem[:-1] + b"~." + ext
        for tail in (b"\0", b"\n"):
            for old, repl in ((raw, new), (raw.replace(b"\xc3\xa9", b"?"), new.replace(b"\xc3\xa9", b"?"))):
                blob[member.header_offset : own + 512] = bytes(blob[member.header_offset : own + 512]).replace(
                    old + tail, repl + tail)
        if b"/" in raw:  # under a ustar prefix the name field holds the file name only
            base, renamed = raw.rsplit(b"/", 1)[1], new.rsplit(b"/", 1)[1]
            blob[own : own + 100] = bytes(blob[own : own + 100]).replace(base + b"\0", renamed + b"\0")
    for h in heads:
        blob[h + 148 : h + 156] = b" " * 8
        blob[h + 148 : h + 156] = b"%06o\0 " % sum(blob[h : h + 512])


def open_descriptors(paths: Iterable[str]) -> int:
    """How many of this process's open descriptors are of ``paths`` (resolved)."""
    wanted = {os.path.realpath(p) for p in paths}
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            held += os.readlink(f"/proc/self/fd/{fd}") in wanted
        except OSError:  # the listing's own, closed by now
            pass
    return held
