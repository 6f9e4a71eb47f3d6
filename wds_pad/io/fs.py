"""Filesystems: one fsspec instance per process, protocol chain and options.

Invariants:
    * :func:`get_filesystem` returns the same instance for every URL of one protocol
      (chain) and options, so the shards of a bucket share one connection pool; after
      ``os.fork`` the child makes its own (an inherited async filesystem is bound to the
      parent's dead IO thread), and the finalizers fsspec registered to close the
      parent's sessions are detached in the child: each would wait 0.1 s on the parent's
      event loop, which does not run there (seen as a stall of most of a second when a
      DataLoader worker's first collection freed a few inherited filesystems), and their
      aiohttp connectors (HTTP's session, each of aiobotocore's sessions behind s3fs)
      marked closed, so a child collecting them neither closes the parent's connections
      nor prints "Unclosed client session".
    * Options under a protocol name (``{"s3": {...}}``) reach that protocol only; those of
      protocols absent from the URL are dropped. The caller's options are never mutated
      (:func:`copy_dicts`), and their credentials are registered for :func:`redact`.
    * A store refusing already here is judged as every store fault is
      (:mod:`wds_pad.io.faults`); an unknown protocol or refused options is a
      :class:`ConfigError`.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import fsspec

from wds_pad.errors import ConfigError, ShardError

from .faults import error_chain, store_error
from .redact import register_secrets, redact

__all__ = ["get_filesystem"]

_CACHE_WRAPPERS = frozenset({"simplecache", "filecache", "blockcache", "cached"})
_FS_CACHE: dict[tuple[Any, ...], tuple[fsspec.AbstractFileSystem, str]] = {}
_FS_PID = [os.getpid()]
_FS_LOCK = threading.Lock()


def _forget_parent_sessions() -> None:
    """In a forked child: disown the parent's fsspec sessions (http, s3fs).

    fsspec closes a session when its filesystem is collected (a ``weakref.finalize``
    calling ``close_session``), and aiohttp closes a connector when it is collected. In a
    forked child both are wrong: the sessions' event loop looks running but has no
    thread there (``sync(..., timeout=0.1)`` waits out its timeout for each one), and
    closing a connector unregisters its sockets from the event loop's epoll set, which
    the child shares with the parent: the parent's next request on such a pooled
    connection then waits for its whole timeout (seen as 60 s stalls after DataLoader
    workers started, and as a first batch most of a second late in each worker). So the
    finalizers are detached and the connectors marked closed without closing anything;
    the child's copies of the sockets close with the process.

    The registry is copied first (``dict.copy`` makes no object a collection could start
    on): reading it item by item, a collection started by the read runs finalizers, which
    remove themselves from it while it is read (a RuntimeError the child printed).
    """
    registry = getattr(weakref.finalize, "_registry", {})
    for ref, info in list(registry.copy().items()):
        if getattr(getattr(info, "func", None), "__name__", "") != "close_session":
            continue
        ref.detach()
        for obj in getattr(info, "args", ())[1:]:
            for connector in _connectors(obj):
                connector._closed = True  # its __del__, and its session's, then close nothing


def _connectors(obj: Any) -> list[Any]:
    """The aiohttp connectors behind one fsspec session: HTTP's ClientSession itself, or
    s3fs's client (or the context that made it), whose aiobotocore HTTP session holds one
    ClientSession (``_session``, older aiobotocore) or one per proxy (``_sessions``)."""
    http = obj
    for name in ("_client", "_endpoint", "http_session"):
        http = getattr(http, name, None)
    if http is None:  # the client itself, not the context that made it
        http = getattr(getattr(obj, "_endpoint", None), "http_session", None)
    sessions = [obj, http, getattr(http, "_session", None)]
    more = getattr(http, "_sessions", None)
    if isinstance(more, Mapping):
        sessions.extend(more.values())
    found = (getattr(s, "_connector", None) for s in sessions if s is not None)
    return [c for c in found if c is not None and hasattr(c, "_closed")]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parent_sessions)


def copy_dicts(value: Any) -> Any:
    """Copies nested mappings (fsspec mutates them) and leaves other values shared."""
    if isinstance(value, Mapping):
        return {k: copy_dicts(v) for k, v in value.items()}
    return value


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


def _protocol_of(bit: str, known: set[str]) -> str:
    if "://" in bit:
        return bit.split("://", 1)[0]
    return bit if bit in known else "file"


def get_filesystem(url: str, storage_options: Mapping[str, Any] | None = None,
                   ) -> tuple[fsspec.AbstractFileSystem, str]:
    """Returns the filesystem for ``url`` and the path to pass to it.

    Instances are cached per process, per protocol chain and options, so every shard
    of a bucket shares one connection pool; after ``os.fork`` the child makes its own
    (an inherited async filesystem is bound to the parent's dead IO thread).

    Args:
        url: A path, ``scheme://`` URL or chained URL (``simplecache::s3://b/x.tar``).
        storage_options: fsspec options; dicts under protocol names apply to that
            protocol only, and those of protocols absent from ``url`` are dropped.

    Returns:
        ``(filesystem, path)``.

    Raises:
        ConfigError: If the URL's protocol is unknown or the options are refused.
        ReadError, ShardError: If making the filesystem already asks the store and that
            fails (see :func:`call_store`).
    """
    if not isinstance(url, str) or not url:
        raise ConfigError(f"a shard URL must be a non-empty str, got {redact(repr(url))}")
    options = copy_dicts(storage_options or {})
    register_secrets(options)
    bits = url.split("::")
    # the protocol names, only when a bit or an option could be one (a plain local path
    # with no options, the common case, skips building the set: 0.1 ms a shard)
    plain = all("://" in bit or bit.startswith("/") for bit in bits) and not options
    known = set() if plain else set(fsspec.available_protocols()) | set(fsspec.registry)
    protocols = [_protocol_of(bit, known) for bit in bits]
    for proto in [k for k, v in options.items() if k in known and isinstance(v, Mapping)]:
        if proto not in protocols:
            alias = {"http": "https", "https": "http"}.get(proto)
            if alias in protocols and alias not in options:
                options[alias] = options.pop(proto)
            else:
                del options[proto]
    try:
        inner_cls = fsspec.get_filesystem_class(protocols[-1])
        if len(bits) == 1:
            where: Any = _freeze(inner_cls._get_kwargs_from_urls(url))
        elif all(p in _CACHE_WRAPPERS for p in protocols[:-1]):
            where = (tuple(protocols), _freeze(inner_cls._get_kwargs_from_urls(bits[-1])))
        else:  # outer layers depend on the inner path (zip::, tar::): one instance per URL
            where = url
        key = (protocols[0], where, _freeze(options))
        with _FS_LOCK:
            if _FS_PID[0] != os.getpid():  # forked: the parent's instances are unusable
                _FS_CACHE.clear()
                _FS_PID[0] = os.getpid()
            hit = _FS_CACHE.get(key)
        if hit is None:
            fresh = fsspec.core.url_to_fs(url, **options)
            with _FS_LOCK:
                return _FS_CACHE.setdefault(key, fresh)[0], fresh[1]
        if where == url:
            return hit
        fs = hit[0]
        if len(bits) == 1:
            return fs, fs._strip_protocol(url)
        return fs, inner_cls._strip_protocol(bits[-1])
    except (ValueError, ImportError, TypeError) as exc:
        failure: BaseException = exc
        store = None
    except Exception as exc:  # noqa: BLE001 - a store refusing already here (credentials, DNS)
        store = store_error(exc, url, "the store of", ShardError, "check the URL")
        if store is None:
            raise
        failure = exc
    if store is not None:
        raise store from error_chain(failure)
    error = ConfigError(f"cannot open a filesystem for {redact(url)!r}: {redact(repr(failure))}; "
                        "check the URL's protocol, that its fsspec implementation is installed, "
                        "and storage_options")
    raise error from error_chain(failure)
