"""Where an index's shards are: URLs stored relative to the index file, and relocation.

An index file stores each shard URL relative to its own folder when the shard sits
beside or below it (``/data/train.wdsidx`` with ``/data/shards/x.tar`` stores
``shards/x.tar``; ``s3://b/data/train.wdsidx`` with ``s3://b/data/shards/x.tar`` alike),
and as given otherwise. Loading resolves them against where the file is now, so a
dataset folder moved whole (another mount point, a bucket copied elsewhere) loads and
streams without indexing again; a relocation (``{"OLD": "NEW"}``, ``--relocate
OLD=NEW``) moves the rest, shards outside the index's folder.

Invariants:
- a URL is stored relative only when it starts with the index's folder (its own
  scheme, bucket and path, up to a ``/``) and what follows is a plain relative path (no
  scheme, no chain, no ``..``, not absolute); the header then says so
  (``RELATIVE_KEY``), and only then is a stored URL read as relative: a file written
  before (or with no shard below it) holds URLs that mean what they always meant;
- resolving is string joining (the folder's URL + the stored path), the inverse of
  storing: an index written and loaded at the same place gives back the URLs it was
  given;
- a relocation replaces the longest matching prefix, on whole path components
  (``/data/a`` moves ``/data/a/x.tar``, never ``/data/ab/x.tar``), of the URL as
  resolved against the index's location; a prefix that matches no shard is refused
  (``ConfigError``), so a typo never passes unnoticed;
- nothing here touches a filesystem: sizes and change stamps are checked where shards
  are read, against the values indexed.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

from ..errors import ConfigError
from ..io.redact import redact
from ..io.urls import local_path

__all__ = ["RELATIVE_KEY", "Relocation", "check_relocation", "excluded_urls", "index_folder", "is_relative",
           "resolve_url", "store_url", "unmatched"]

RELATIVE_KEY = "relative_urls"  # header field: true when some shard URL is stored relative to the index

Relocation = tuple[tuple[str, str], ...]  # (old prefix, new prefix), longest old prefix first


def index_folder(path: str | None) -> str | None:
    """The folder an index file at ``path`` lies in, as a URL prefix ending in ``/``
    (None without a path): a local path made absolute, a remote URL cut at its last
    ``/`` (before any query string)."""
    if not path:
        return None
    local = local_path(path)
    if local is not None:
        return os.path.dirname(os.path.abspath(local)).rstrip("/") + "/"
    head = path.split("?", 1)[0]
    cut = head.rfind("/")
    return head[: cut + 1] if cut >= 0 and "://" in head[:cut + 1] else None


def is_relative(url: str) -> bool:
    """Whether a stored ``url`` is a plain relative path (what :func:`store_url` writes)."""
    return bool(url) and not url.startswith("/") and "://" not in url and "::" not in url \
        and not url.startswith("file:") and ".." not in url.split("?", 1)[0].split("/")


def store_url(url: str, folder: str | None) -> str:
    """``url`` as an index in ``folder`` stores it: relative when beside or below it."""
    if folder is None or not url.startswith(folder):
        return url
    rest = url[len(folder):]
    return rest if is_relative(rest) else url


def resolve_url(stored: str, folder: str | None, relocation: Relocation = ()) -> str:
    """The URL a stored one names: a relative one joined to ``folder``, then relocated."""
    url = folder + stored if folder is not None and is_relative(stored) else stored
    for old, new in relocation:
        if _under(url, old):
            return new + url[len(old):]
    return url


def _under(url: str, prefix: str) -> bool:
    """``url`` is ``prefix`` or lies below it (whole path components)."""
    return url == prefix or url.startswith(prefix if prefix.endswith("/") else prefix + "/")


def check_relocation(relocate: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> Relocation:
    """A relocation as pairs, longest old prefix first (trailing ``/`` dropped).

    Raises:
        ConfigError: not a mapping of non-empty strings, or two old prefixes that are the
            same once normalised.
    """
    if relocate is None:
        return ()
    if isinstance(relocate, (str, bytes)):
        raise ConfigError(f"relocate must map old URL prefixes to new ones, e.g. {{'/old/data': '/new/data'}}, "
                          f"got {relocate!r}")
    try:
        items = list(relocate.items()) if isinstance(relocate, Mapping) else [tuple(p) for p in relocate]
    except TypeError:
        raise ConfigError(f"relocate must map old URL prefixes to new ones, got {type(relocate).__name__}") from None
    pairs: dict[str, str] = {}
    for item in items:
        if len(item) != 2 or not all(isinstance(s, str) and s.strip("/") for s in item):
            raise ConfigError(f"relocate: {item!r} is not an (old prefix, new prefix) pair of non-empty URLs or "
                              "paths; write OLD=NEW, e.g. --relocate /mnt/old=/mnt/new")
        old, new = (_prefix(s) for s in item)
        if old in pairs:
            raise ConfigError(f"relocate: the prefix {old!r} is given twice; give each old prefix once")
        pairs[old] = new
    return tuple(sorted(pairs.items(), key=lambda p: (-len(p[0]), p[0])))


def _prefix(url: str) -> str:
    """A prefix without a trailing ``/`` (but ``s3://`` stays whole), local ones absolute
    and without ``file://`` (as an index records local shards)."""
    local = local_path(url)
    if local:
        url = os.path.abspath(local)
    return url if url.endswith("://") else url.rstrip("/")


def unmatched(relocation: Relocation, urls: Iterable[str], where: str) -> None:
    """Refuse an old prefix that matches none of ``urls`` (as resolved, before relocating).

    Raises:
        ConfigError: naming the prefix, the index and a URL it records.
    """
    urls = list(urls)
    for old, _ in relocation:
        if not any(_under(u, old) for u in urls):
            first = f" (its first is {redact(urls[0])!r})" if urls else ""
            partial = any(u.startswith(old) for u in urls)
            raise ConfigError(
                f"relocate {redact(old)!r}: no shard URL of index {redact(where)!r} starts with it at a path "
                f"boundary{first}"
                + (" (some start with those characters, but a prefix ends where a folder or URL part ends, "
                   "not inside a name)" if partial else "")
                + "; give the prefix as the index records it, a whole folder (`wds-pad verify INDEX` lists the "
                "shards it cannot find), e.g. --relocate /old/mount=/new/mount")


def excluded_urls(excluded: Mapping[str, Any], convert: Any) -> dict[str, Any]:
    """The excluded-samples record with every ``url`` field passed through ``convert``."""
    out = dict(excluded)
    for part in ("samples", "shards"):
        if isinstance(out.get(part), list):
            out[part] = [{**e, "url": convert(e["url"])} if isinstance(e, dict) and isinstance(e.get("url"), str)
                         else e for e in out[part]]
    return out
