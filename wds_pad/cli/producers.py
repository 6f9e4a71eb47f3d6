"""Shards written the way real producers write them: webdataset's ``TarWriter`` and
``ShardWriter`` with their defaults, Python's ``tarfile`` and GNU ``tar`` in each of their
formats, so tests and benchmarks meet the header forms users' shards have.

Invariants:
    * Deterministic: the same samples give byte-identical shards (fixed mtime, owner and
      mode; GNU tar's own pax times fixed too).
    * Each shard appears atomically: written to a temporary name, then renamed.
    * Members are written in the mapping's order, except by webdataset's writers, which
      sort them by extension as ``wds.TarWriter`` does.
    * An unknown or unavailable producer, or a sample one cannot store, is a ConfigError
      naming it and the fix.
"""

from __future__ import annotations

import functools
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from wds_pad.errors import ConfigError

__all__ = ["PRODUCERS", "available_producers", "check_producer", "write_samples"]

_MTIME = 1_700_000_000.0  # fixed tar mtime: reproducible bytes

#: The programs :func:`write_samples` can write shards with, as real datasets are made:
#: webdataset's ``TarWriter`` and ``ShardWriter`` (pax header per member), Python's
#: ``tarfile`` and the GNU ``tar`` binary in each of their formats.
PRODUCERS: tuple[str, ...] = ("webdataset", "wds-shardwriter", "tarfile-pax", "tarfile-gnu", "tarfile-ustar",
                              "gnutar-posix", "gnutar-gnu", "gnutar-ustar")
_TARFILE_FORMATS = {"tarfile-pax": tarfile.PAX_FORMAT, "tarfile-gnu": tarfile.GNU_FORMAT,
                    "tarfile-ustar": tarfile.USTAR_FORMAT}
_GNUTAR_FORMATS = {"gnutar-posix": "posix", "gnutar-gnu": "gnu", "gnutar-ustar": "ustar"}
_WDS_PRODUCERS = ("webdataset", "wds-shardwriter")


@functools.lru_cache(maxsize=1)
def _gnu_tar() -> str | None:
    """The path of GNU tar on PATH, or None (no ``tar``, or another tar such as bsdtar)."""
    path = shutil.which("tar")
    if path is None:
        return None
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return path if done.returncode == 0 and "GNU tar" in done.stdout else None


def available_producers() -> tuple[str, ...]:
    """The :data:`PRODUCERS` this machine can run, in that order.

    The ``gnutar-*`` producers need GNU tar on PATH; the others need only Python and
    webdataset.
    """
    return tuple(p for p in PRODUCERS if p not in _GNUTAR_FORMATS or _gnu_tar() is not None)


def check_producer(producer: str) -> None:
    if producer not in PRODUCERS:
        raise ConfigError(f"unknown producer {producer!r}; choose one of {', '.join(PRODUCERS)}")
    if producer in _GNUTAR_FORMATS and _gnu_tar() is None:
        raise ConfigError(f"producer {producer!r} needs GNU tar on PATH (found: {shutil.which('tar') or 'no tar'}); "
                          f"this machine can run {', '.join(available_producers())}")


_Members = tuple[str, list[tuple[str, bytes]]]  # (key, [(extension, payload)] in archive order)


def _members(sample: Mapping[str, Any], producer: str, shard: int) -> _Members:
    """The key and members of one webdataset-style sample, in the order ``producer``
    writes them: webdataset's writers sort by extension, the others keep the mapping's."""
    key = sample.get("__key__")
    if not isinstance(key, str) or not key:
        raise ConfigError(f"shard {shard}: a sample needs a non-empty str '__key__', got {key!r}")
    if "." in PurePosixPath(key).name:
        raise ConfigError(f"shard {shard}, key {key!r}: a dot in the key's last path part splits it "
                          "differently when read back (webdataset splits a member name at that dot)")
    members = []
    for ext, value in sample.items():
        if ext.startswith("_"):  # __key__ and metadata: webdataset's TarWriter drops them too
            continue
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise ConfigError(f"shard {shard}, key {key!r}: member {ext!r} must be bytes, got {type(value).__name__}")
        members.append((ext, bytes(value)))
    if not members:
        raise ConfigError(f"shard {shard}, key {key!r}: a sample needs at least one member")
    if producer in _WDS_PRODUCERS:
        members.sort()
    return key, members


def _sample_members(samples: Iterable[Mapping[str, Any]], producer: str, shard: int) -> Iterator[_Members]:
    return (_members(s, producer, shard) for s in samples)


def _atomic(final: Path, write: Callable[[Path], None]) -> str:
    """Run ``write(tmp)`` then rename ``tmp`` to ``final``; no temporary file is left."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return str(final)


def _write_webdataset(path: Path, samples: Iterator[_Members]) -> None:
    import webdataset as wds  # heavy import only when shards are written

    with open(path, "wb") as fh:
        # TarWriter's defaults (its `format` argument is ignored by webdataset 1.0: the
        # stream is tarfile's pax); a fixed float mtime instead of time.time() keeps the
        # bytes reproducible and, like the default, puts a pax header before every member
        writer = wds.TarWriter(fh, encoder=False, mtime=_MTIME)
        for key, members in samples:
            writer.write({"__key__": key, **dict(members)})
        writer.close()


def _write_shardwriter(out: Path, shards: Sequence[Iterator[_Members]]) -> list[str]:
    """wds.ShardWriter into a temporary directory, its parts then renamed to our names."""
    import webdataset as wds

    if not shards:
        return []
    parts = Path(tempfile.mkdtemp(dir=out, prefix=f".shardwriter-{os.getpid()}-"))
    try:
        # ShardWriter starts a new part at maxcount samples; our shards have uneven
        # lengths, so it starts one at each shard boundary instead (next_stream is what
        # its write() calls at maxcount) and maxcount never triggers
        writer = wds.ShardWriter(str(parts / "part-%06d.tar"), maxcount=2**62, maxsize=float("inf"), verbose=0,
                                 encoder=False, mtime=_MTIME)
        for k, samples in enumerate(shards):
            if k:
                writer.next_stream()
            for key, members in samples:
                writer.write({"__key__": key, **dict(members)})
        writer.close()
        paths = []
        for k in range(len(shards)):
            final = out / f"shard-{k:06d}.tar"
            os.replace(parts / f"part-{k:06d}.tar", final)
            paths.append(str(final))
        return paths
    finally:
        shutil.rmtree(parts, ignore_errors=True)


def _write_tarfile(path: Path, samples: Iterator[_Members], producer: str) -> None:
    with tarfile.open(path, "w", format=_TARFILE_FORMATS[producer]) as tf:
        for key, members in samples:
            for ext, data in members:
                info = tarfile.TarInfo(f"{key}.{ext}")
                # the owner and mode wds.TarWriter wrote here before producers existed:
                # tarfile-ustar shards are byte for byte those of earlier versions
                info.size, info.mtime, info.mode = len(data), int(_MTIME), 0o444
                info.uname = info.gname = "wds_pad"
                try:
                    tf.addfile(info, io.BytesIO(data))
                except ValueError as exc:  # e.g. ustar: "name is too long"
                    raise ConfigError(f"{producer} cannot store member {info.name!r} of {path.name}: {exc}; "
                                      "use a pax or GNU producer for such keys") from exc


def _write_gnutar(path: Path, samples: Iterator[_Members], producer: str) -> None:
    """The members as files in a temporary directory, archived by GNU tar in sample order."""
    fmt = _GNUTAR_FORMATS[producer]
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".gnutar-{os.getpid()}-") as tmp:
        names: list[str] = []
        seen: set[str] = set()
        for key, members in samples:
            for ext, data in members:
                name = f"{key}.{ext}"
                pure = PurePosixPath(name)
                if pure.is_absolute() or ".." in pure.parts or name in seen:
                    raise ConfigError(f"{producer}: member {name!r} of {path.name} is absolute, climbs out "
                                      "with '..' or repeats an earlier one; tar stores files by path")
                seen.add(name)
                file = Path(tmp, name)
                try:
                    file.parent.mkdir(parents=True, exist_ok=True)
                    file.write_bytes(data)
                except OSError as exc:  # a key that is also another key's directory, a name too long ...
                    raise ConfigError(f"{producer}: cannot stage member {name!r} of {path.name} as a file: "
                                      f"{exc}") from exc
                names.append(name)
        cmd = [_gnu_tar() or "tar", "-c", "-f", str(path), f"--format={fmt}", "--no-recursion", "--sort=none",
               f"--mtime=@{int(_MTIME)}", "--owner=0", "--group=0", "--numeric-owner", "--mode=u=rw,go=r"]
        if fmt == "posix":
            # tar's own pax records (atime, ctime) kept in every member's pax header, as
            # `tar --format=posix` writes them, but with fixed values: reproducible bytes
            cmd.append(f"--pax-option=exthdr.name=%d/PaxHeaders/%f,atime:={int(_MTIME)},ctime:={int(_MTIME)}")
        # names on stdin (NUL-separated, verbatim): no ARG_MAX limit, exactly this order
        cmd += ["-C", tmp, "--null", "--verbatim-files-from", "-T", "-"]
        listing = b"".join(n.encode("utf-8") + b"\0" for n in names)
        done = subprocess.run(cmd, input=listing, capture_output=True, env={**os.environ, "LC_ALL": "C.UTF-8"},
                              timeout=600, check=False)
        if done.returncode != 0:
            err = done.stderr.decode("utf-8", "replace").strip()
            raise ConfigError(f"{producer}: `tar --format={fmt}` failed writing {path.name} "
                              f"(exit {done.returncode}): {err}")


def write_samples(
    out_dir: str | os.PathLike[str],
    shards: Iterable[Iterable[Mapping[str, Any]]],
    producer: str = "webdataset",
) -> list[str]:
    """Write webdataset-style samples into tar shards as ``producer`` writes them.

    Shard ``k`` (``out_dir/shard-{k:06d}.tar``) holds the samples of ``shards[k]``, in
    order; a sample ``{"__key__": "dir.v1/sub/000001", "jpg": b"...", "json": b"..."}``
    becomes members ``dir.v1/sub/000001.jpg`` and ``.json``. Entries starting with
    ``_`` other than ``__key__`` are not written (as ``wds.TarWriter`` does). Members
    keep the mapping's order except for ``webdataset`` and ``wds-shardwriter``, which
    sort them by extension. Inner iterables are consumed one shard at a time, in order.

    The header forms each producer writes:

    * ``webdataset``, ``wds-shardwriter``: ``wds.TarWriter`` / ``wds.ShardWriter`` with
      their defaults: a pax header before every member (float mtime; path too when
      long or non-ASCII).
    * ``tarfile-pax``: pax headers only where needed (long or non-ASCII names; integer
      mtime, owner ``wds_pad``, mode 0444 in every tarfile producer).
    * ``tarfile-gnu``, ``gnutar-gnu``: GNU ``././@LongLink`` headers for names > 100 bytes.
    * ``tarfile-ustar``, ``gnutar-ustar``: plain ustar; names > 100 bytes split into the
      prefix field (at most 255 bytes in all).
    * ``gnutar-posix``: a pax header before every member (atime, ctime; path when
      needed), named ``<dir>/PaxHeaders/<file>``.

    Args:
        out_dir: Local directory, created if missing.
        shards: One iterable of sample mappings per shard; values are bytes.
        producer: One of :data:`PRODUCERS` (see :func:`available_producers`).

    Returns:
        The shard paths, in order.

    Raises:
        ConfigError: An unknown or unavailable producer, a sample without a str
            ``__key__`` or with a non-bytes member, or a key the producer cannot store
            (ustar: paths over 255 bytes).
    """
    check_producer(producer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    per_shard = [_sample_members(samples, producer, k) for k, samples in enumerate(shards)]
    if producer == "wds-shardwriter":
        return _write_shardwriter(out, per_shard)
    paths = []
    for k, samples in enumerate(per_shard):
        if producer == "webdataset":
            write: Callable[[Path], None] = functools.partial(_write_webdataset, samples=samples)
        elif producer in _TARFILE_FORMATS:
            write = functools.partial(_write_tarfile, samples=samples, producer=producer)
        else:
            write = functools.partial(_write_gnutar, samples=samples, producer=producer)
        paths.append(_atomic(out / f"shard-{k:06d}.tar", write))
    return paths
