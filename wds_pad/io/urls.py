"""Shard URL patterns: brace expansion, then globs, into canonical URLs.

Every function that takes shard URLs goes through :func:`expand_urls` (the indexer) or
:func:`canonical_url` (comparing a pipeline's URLs with an index's), so a URL means the
same shard everywhere.

Invariants:
- braces first (``train-{000..099}.tar``, ``{a,b}``), then each result that holds a glob
  character (``*``, ``?``, ``[...]``; ``**`` spans directories) is listed on its
  filesystem and replaced by the files it matches, sorted; the results of one item keep
  the order of the brace expansion;
- a URL that names an existing file is taken literally even if it holds glob
  characters (``data[1].tar``);
- http(s) cannot be listed: there ``?`` and ``[]`` are literal (a query string, an IPv6
  host) and a ``*`` is refused;
- local paths come out absolute (ranks may run in another working directory) and
  without ``file://``; a pattern that matches nothing is an error naming it;
- whether a URL names a local file is decided here, by :func:`local_path` alone: a plain
  path or ``file://`` + path is local; another scheme (``s3://``, ``https://``,
  ``local://``) or an fsspec chain (``simplecache::...``) is read through fsspec. A
  reader that holds the filesystem answers for itself (``RangeReader.is_local``).
"""

from __future__ import annotations

import glob as _glob
import os
from typing import Any, Iterable, Mapping

from braceexpand import UnbalancedBracesError, braceexpand

from ..errors import ConfigError, ShardError
from .redact import redact

__all__ = ["canonical_url", "expand_urls", "is_local", "local_path"]

_MAGIC = frozenset("*?[")
_UNLISTABLE = ("http", "https")
_TYPES = "shard URLs must be a str or a list of str"


def local_path(url: str) -> str | None:
    """The path on this machine that ``url`` names, or None if fsspec must read it.

    A plain path is itself (a relative one stays relative); ``file://`` + path is the
    path. A URL with another scheme (``s3://``, ``https://``, ``memory://``, ``local://``)
    or an fsspec chain (``simplecache::/data/a.tar``) is not a local file here.
    """
    if url.startswith("file://"):
        return url[len("file://"):]
    if "://" in url or "::" in url:
        return None
    return url


def is_local(url: str) -> bool:
    """Whether ``url`` names a file on this machine (see :func:`local_path`)."""
    return local_path(url) is not None


def canonical_url(url: str) -> str:
    """The URL as the index stores it: local paths absolute, ``file://`` stripped."""
    path = local_path(url)
    if path is None:
        return url
    return path if os.path.isabs(path) else os.path.abspath(path)


def expand_urls(urls: str | Iterable[str], storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Brace-expand and glob one URL pattern or a list of them, into canonical URLs.

    Args:
        urls: ``s3://b/train-{000..099}.tar``, ``shards/*.tar``, or a list of such.
        storage_options: fsspec options (credentials, endpoint) for listing remote globs.

    Returns:
        The shard URLs, in order: per item its brace expansion, each glob's matches sorted.

    Raises:
        ConfigError: not a str or list of str, unbalanced braces, a glob on http(s), a
            shard listed twice, or nothing given.
        ShardError: a glob matches no file, or listing its directory or bucket failed.
    """
    if isinstance(urls, str):
        items: list[Any] = [urls]
    elif isinstance(urls, (bytes, bytearray, Mapping)) or not isinstance(urls, Iterable):
        raise ConfigError(f"{_TYPES}, got {type(urls).__name__}: pass e.g. 'shards/train-{{000..009}}.tar' "
                          "or a list of URLs")
    else:
        items = list(urls)
    out: list[str] = []
    for item in items:
        if not isinstance(item, str) or not item:
            raise ConfigError(f"{_TYPES}; an item is {item!r}: pass non-empty strings")
        try:
            expanded = list(braceexpand(item))
        except UnbalancedBracesError as exc:
            raise ConfigError(
                f"shard URL pattern {redact(item)!r} has unbalanced braces; write a range as "
                "{000..099} and a list as {a,b}, or escape a literal brace as \\{"
            ) from exc
        for url in expanded:
            out.extend(_glob_one(canonical_url(url), storage_options))
    if not out:
        raise ConfigError("no shard URLs given")
    if len(set(out)) != len(out):
        seen: set[str] = set()
        dup = next(u for u in out if u in seen or seen.add(u))  # type: ignore[func-returns-value]
        raise ConfigError(f"shard {redact(dup)!r} is listed twice (directly or through a pattern); list each shard once")
    return out


def _glob_one(url: str, storage_options: Mapping[str, Any] | None) -> list[str]:
    """``url`` itself, or the sorted files its glob matches."""
    bits = url.split("::")
    inner = bits[-1]
    scheme = inner.split("://", 1)[0] if "://" in inner else ""
    path_part = inner.split("://", 1)[1] if scheme else inner
    if scheme in _UNLISTABLE:
        if "*" in path_part.split("?", 1)[0]:
            raise ConfigError(
                f"shard URL {redact(url)!r} holds a glob, but {scheme}:// cannot list files; globs need "
                "a listable store (local paths, s3://, gs://, ...): spell the shards with braces, "
                "e.g. https://host/train-{000000..000099}.tar"
            )
        return [url]
    if not _MAGIC.intersection(path_part):
        return [url]
    if not scheme and len(bits) == 1:  # a local path: no fsspec needed
        if os.path.isfile(url):
            return [url]
        try:
            found = [p for p in _glob.glob(url, recursive=True) if os.path.isfile(p)]
        except (OSError, ValueError) as exc:
            raise ShardError(f"listing the shards of pattern {url!r} failed: {exc}") from exc
        return sorted(found) or _no_match(url, "directory")
    from .fs import get_filesystem  # here: modules that need only the is-local rule import no fsspec

    fs, path = get_filesystem(inner, storage_options)
    try:
        if fs.isfile(path):
            return [url]
        found = [p for p, info in fs.glob(path, detail=True).items() if info.get("type", "file") == "file"]
    except (OSError, ValueError) as exc:
        raise ShardError(f"listing the shards of pattern {redact(url)!r} failed: {redact(str(exc))}; "
                         "check the bucket, the credentials (storage_options) and the pattern") from exc
    prefix = "::".join(bits[:-1]) + "::" if len(bits) > 1 else ""
    return sorted(prefix + fs.unstrip_protocol(p) for p in found) or _no_match(url, "bucket or directory")


def _no_match(url: str, where: str) -> list[str]:
    raise ShardError(
        f"shard pattern {redact(url)!r} matches no files; check the {where} and the pattern "
        "(globs: * ? [...], ** across directories; braces: {000..099}, {a,b})"
    )
