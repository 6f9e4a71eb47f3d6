"""Byte-range reads over any fsspec filesystem: concurrent, in order, bounded, retried.

Every streaming stage reads samples through :class:`RangeReader`. A sample is one
contiguous byte range ``(url, offset, length)`` recorded by the tar index.

Invariants:
    * ``read_many`` yields exactly one ``bytes`` per input range, in input order, each
      exactly ``length`` long; a shorter answer raises :class:`StaleShardError`.
    * At most ``max_in_flight`` requests are outstanding, and the bytes buffered by the
      reader (requested but not yet handed out) never exceed
      ``max(max_bytes_in_flight, largest single range)`` — so peak buffered bytes are at
      most ``max_bytes_in_flight`` plus one largest sample.
    * Local files are read inline with ``os.pread`` on cached descriptors: no threads, no
      fsspec call per read, a few microseconds per range.
    * Large local samples may instead be read (and parsed) ahead by ``local_threads``
      threads (:meth:`RangeReader.local_read_ahead`): results come back in input order,
      within the same ``max_in_flight`` / ``max_bytes_in_flight`` bounds, each error with
      its own item; the threads belong to one stream and stop when it is closed or
      collected. A descriptor in use by such a thread is never evicted from the cache.
    * Remote reads run as coroutines on fsspec's IO loop: async filesystems (s3fs,
      HTTP) natively, sync ones through a thread pool. Every attempt has a timeout;
      transient failures are retried with exponential backoff whose jitter derives from
      (url, offset, attempt), never the clock; permanent ones fail at once.
    * Filesystems, descriptors and pools belong to one process: after ``os.fork`` they
      are made anew (checked with ``os.getpid()``).
    * No message or log line carries a credential: all pass through :func:`redact`.
    * A failed range (or a closed iterator) cancels every request in flight; an error a
      cancelled one still ends in is retrieved, so asyncio prints nothing: the caller
      sees one error.
    * Every fault of a store, wherever it is met (filesystem, reader, shard info, index
      file), is judged in one place (``_store_fault``, behind :func:`call_store` and the
      reader): "cannot reach the store" and "no credentials" are a :class:`ReadError`,
      "does not exist" the caller's (:class:`ShardError`, :class:`IndexFormatError`),
      each with its own advice.
    * Given the indexed ``(size, stamp)`` of each shard (``expected``), a reader checks a
      shard once, when it first opens it: a local file by one ``fstat`` (size, mtime), an
      S3 or HTTP object by the Content-Range total size and ETag of its first ranged GET
      response (no extra request). A shard that differs raises :class:`StaleShardError`
      for every range of it. Other filesystems (chained caches, memory, ...) are not
      checked beyond the short-read test.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import logging
import operator
import os
import queue
import re
import sys
import threading
import weakref
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import fsspec
import fsspec.asyn
from fsspec.implementations.local import LocalFileSystem

from wds_pad.errors import ConfigError, ReadError, ShardError, StaleShardError, WdsPadError

__all__ = ["LocalReadAhead", "RangeReader", "ReadOptions", "ReadStats", "call_store", "change_stamp",
           "get_filesystem", "redact"]

logger = logging.getLogger(__name__)

_MAX_OPEN_FDS = 256
_CACHE_WRAPPERS = frozenset({"simplecache", "filecache", "blockcache", "cached"})
# the fields of an fsspec info dict that may stamp a shard's version, in order of trust
_STAMP_FIELDS = ("ETag", "etag", "checksum", "md5Hash", "crc32c", "mtime", "LastModified",
                 "last_modified", "updated", "created")


def change_stamp(info: Mapping[str, Any]) -> str:
    """A shard's change stamp, as the index records it: ``"<field>=<value>"``.

    The first of ETag, checksum, mtime, LastModified, ... that ``info`` (an fsspec info
    dict, or a dict of one field such as ``{"mtime": st.st_mtime}``) holds; ``""`` if none.

    Args:
        info: fsspec ``info()`` of the shard, or the fields a read response carried.

    Returns:
        The stamp; equal stamps of one kind (the part before ``=``) mean the same version.
    """
    for name in _STAMP_FIELDS:
        value = info.get(name)
        if value is not None and value != "":
            return f"{name}={value}"
    return ""


@dataclass(frozen=True)
class ReadOptions:
    """How a :class:`RangeReader` reads.

    Attributes:
        max_in_flight: Requests (single or merged ranges) outstanding at once, per
            process or DataLoader worker. 16-64 hide object-store latency. Also the
            number of large local samples read ahead (see ``local_threads``).
        max_bytes_in_flight: Read-ahead memory bound, remote requests and large local
            samples alike. Peak buffered bytes are at most this plus one largest sample.
        merge_gap: Consecutive ranges of one URL whose gap is at most this many bytes
            are fetched as one request and sliced (0: only exactly adjacent ranges).
        max_merged_bytes: Largest merged request (0 disables merging).
        retries: Retries of a transient failure (5xx, connection reset, timeout).
        backoff: First retry delay in seconds, doubled each retry, capped at backoff_max.
        backoff_max: Largest retry delay in seconds.
        timeout: Seconds one attempt may take before it is cancelled and retried.
        storage_options: Passed to fsspec (credentials, endpoint_url, ...). A value that
            is a dict under a protocol name (``{"s3": {...}}``) applies to that protocol
            only, which is how options for chained or mixed URLs are given.
        local_threads: Threads per process or DataLoader worker that read large local
            samples (the fetch stage's, 256 KB and more) ahead of the consumer, so the
            kernel's copy of the next samples overlaps the Python work on this one; the
            consumer joins in rather than wait. Order is kept; ``max_in_flight`` and
            ``max_bytes_in_flight`` bound what is read ahead. They start with a stream and
            stop with it. 0 reads every local sample inline in the consuming thread.
    """

    max_in_flight: int = 32
    max_bytes_in_flight: int = 256 * 2**20
    merge_gap: int = 0
    max_merged_bytes: int = 16 * 2**20
    retries: int = 5
    backoff: float = 0.2
    backoff_max: float = 5.0
    timeout: float = 60.0
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False, hash=False)
    local_threads: int = 2

    def __post_init__(self) -> None:
        for name, low in (("max_in_flight", 1), ("max_bytes_in_flight", 1), ("merge_gap", 0),
                          ("max_merged_bytes", 0), ("retries", 0), ("local_threads", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"ReadOptions.{name} must be an int >= {low}, got {value!r}")
        for name in ("backoff", "backoff_max", "timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"ReadOptions.{name} must be a number >= 0, got {value!r}")
        if not 0 < self.timeout < float("inf"):
            raise ConfigError("ReadOptions.timeout must be positive and finite, got "
                              f"{self.timeout!r}")
        if self.backoff_max < self.backoff:
            raise ConfigError(f"ReadOptions.backoff_max ({self.backoff_max}) must be >= backoff "
                              f"({self.backoff}); raise backoff_max or lower backoff")
        if not isinstance(self.storage_options, Mapping):
            raise ConfigError("ReadOptions.storage_options must be a mapping, got "
                              f"{type(self.storage_options).__name__}")
        object.__setattr__(self, "storage_options", _copy_dicts(self.storage_options))
        _register_secrets(self.storage_options)


@dataclass
class ReadStats:
    """Counters of one reader, for benchmarks and reports (``as_dict()`` to log them)."""

    ranges: int = 0
    requests: int = 0
    merged: int = 0
    bytes: int = 0
    retries: int = 0
    timeouts: int = 0
    peak_bytes_in_flight: int = 0
    peak_requests_in_flight: int = 0

    def as_dict(self) -> dict[str, int]:
        """Returns the counters as a plain dict."""
        return asdict(self)


# ---------------------------------------------------------------- credentials

_SECRET_NAME = re.compile(r"key|secret|token|passw|credential|auth|signature|sig$|sas", re.I)
_SECRETS: set[str] = set()
# words of an Authorization value that are not secret ("Bearer <token>"): never hidden
# on their own, or "Authorization: Bearer x" would turn into "Authorization: *** x"
_AUTH_SCHEMES = frozenset({"bearer", "basic", "digest", "token", "negotiate", "aws4-hmac-sha256"})
_SECRETS_LOCK = threading.Lock()
_USERINFO = re.compile(r"(\b[a-zA-Z][\w+.-]*://)[^/\s@?#]+@")
_SIGNED_PARAM = re.compile(
    r"([?&;][^=&\s#]*(?:sig|signature|credential|token|secret|key|password|auth)[^=&\s#]*=)"
    r"[^&\s#'\"]*", re.I)
# ``name=value``, ``"name": "value"``, ``name: value``, where name is a whole identifier
# holding a secret word (aws_secret_access_key, X-Amz-Credential, Authorization, ...)
_SECRET_ASSIGN = re.compile(
    r"(?<![\w-])(?P<name>[\w-]*?(?:secret|token|password|passwd|credential|access_key|"
    r"api_key|key_id|authorization|signature)[\w-]*)(?P<sep>['\"]?[ \t]*[=:][ \t]*)"
    r"(?P<quote>['\"]?)(?P<scheme>(?-i:Bearer|Basic|Digest|Token|\*\*\*)[ \t]+)?"
    r"(?P<value>[^\s'\",}&{\[(<][^\s'\",}&]*)", re.I)


# words and names: Unable, NoCredentialsError, AWS_PROFILE, aws_secret_access_key (but
# not AKIAIOSFODNNEXAMPLE: 16 capitals in a row are a key id)
_WORDS = re.compile(r"[A-Z]?[a-z]+(?:[A-Z][a-z]+)*|[a-z]+(?:_[a-z]+)+|[A-Z]{1,15}|[A-Z]+(?:_[A-Z]+)+")


def _looks_like_a_key(value: str) -> bool:
    """A word after ``name: `` in prose (``Unable``, ``see``) is no secret; a key is."""
    value = value.rstrip(".;:!?)")
    return len(value) >= 6 and (any(c.isdigit() for c in value) or any(c in "+/=" for c in value)
                                or not _WORDS.fullmatch(value))


_NAME_FOLLOWS = re.compile(r"['\"]?[ \t]*[=:]")


def _is_prose(match: re.Match[str]) -> bool:
    """"NoCredentialsError: Unable to locate credentials", "refresh your token: see the
    docs" are sentences; "token: 5b2c8d9e", "Authorization: Bearer x", "secret=x" are not."""
    name, sep, quote, scheme, value = match.group("name", "sep", "quote", "scheme", "value")
    prose = ":" in sep and sep.endswith((" ", "\t")) and not quote and not sep.startswith(("'", '"'))
    return prose and not _looks_like_a_key(value) and not (
        scheme and name.lower().endswith("authorization"))


def _hide_assigned(text: str) -> str:
    out, pos = [], 0
    while (match := _SECRET_ASSIGN.search(text, pos)) is not None:
        # keep prose, and a "value" that is the next name ("credentials: 'secret': 'x'"),
        # then look again right after "name: "
        if _is_prose(match) or match["value"].endswith(":") or _NAME_FOLLOWS.match(text, match.end()):
            out.append(text[pos:match.end("sep")])
            pos = match.end("sep")
        else:
            out.append(f"{text[pos:match.start('quote')]}{match['quote']}***")
            pos = match.end()
    out.append(text[pos:])
    return "".join(out)


def _register_secrets(options: Any, name: str = "") -> None:
    """Remembers credential values found in storage options so redact() can hide them."""
    if isinstance(options, Mapping):
        for key, value in options.items():
            _register_secrets(value, str(key))
    elif isinstance(options, (list, tuple)):
        for value in options:
            _register_secrets(value, name)
    elif isinstance(options, str) and _SECRET_NAME.search(name) and len(options) >= 4:
        with _SECRETS_LOCK:
            _SECRETS.add(options)
            _SECRETS.update(part for part in options.split()
                            if len(part) >= 6 and part.lower() not in _AUTH_SCHEMES)


def redact(text: str) -> str:
    """Removes credentials from a message.

    Hides values of secret-like storage options seen by this process (keys, secrets,
    tokens, passwords, auth headers), ``user:password@`` in URLs, signed query
    parameters (``X-Amz-Signature``, ``sig``, ``token``, ...) and the values of
    ``secret=...``, ``"token": "..."``, ``Authorization: Bearer ...`` assignments.
    Sentences about credentials stay as they are: in ``name: value`` prose only a value
    that looks like a key (digits, ``+/=``, random case) is hidden, so
    ``NoCredentialsError: Unable to locate credentials`` keeps every word.

    Args:
        text: Any message, URL or exception text.

    Returns:
        The text with each credential replaced by ``***``.
    """
    text = str(text)
    with _SECRETS_LOCK:
        secrets = sorted(_SECRETS, key=len, reverse=True)
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, "***")
    text = _USERINFO.sub(r"\1***@", text)
    text = _SIGNED_PARAM.sub(r"\1***", text)
    return _hide_assigned(text)


# ---------------------------------------------------------------- filesystems

_FS_CACHE: dict[tuple[Any, ...], tuple[fsspec.AbstractFileSystem, str]] = {}
_FS_PID = [os.getpid()]
_FS_LOCK = threading.Lock()


def _copy_dicts(value: Any) -> Any:
    """Copies nested mappings (fsspec mutates them) and leaves other values shared."""
    if isinstance(value, Mapping):
        return {k: _copy_dicts(v) for k, v in value.items()}
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
    options = _copy_dicts(storage_options or {})
    _register_secrets(options)
    known = set(fsspec.available_protocols()) | set(fsspec.registry)
    bits = url.split("::")
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
        store = _store_error(exc, url, "the store of", ShardError, "check the URL")
        if store is None:
            raise
        failure = exc
    if store is not None:
        raise store from _chain(failure)
    error = ConfigError(f"cannot open a filesystem for {redact(url)!r}: {redact(repr(failure))}; "
                        "check the URL's protocol, that its fsspec implementation is installed, "
                        "and storage_options")
    raise error from _chain(failure)


# ---------------------------------------------------------------- error handling

def _status_of(exc: BaseException | None) -> int | None:
    """The HTTP status behind an error, looking through up to 4 causes.

    s3fs turns S3 error codes it does not know into a bare OSError whose __cause__ is
    the botocore error carrying the status; without looking there a 403 looks transient.
    """
    for _ in range(5):
        if exc is None:
            return None
        for attr in ("status", "status_code", "code"):
            value = getattr(exc, attr, None)
            if isinstance(value, int) and 100 <= value <= 599:
                return value
        response = getattr(exc, "response", None)
        if isinstance(response, Mapping):
            value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(value, int):
                return value
        exc = exc.__cause__
    return None


_PERMANENT_ERRNOS = frozenset({errno.EINVAL, errno.EPERM, errno.EACCES, errno.ENOSYS,
                               errno.ENOENT, errno.ENAMETOOLONG, errno.EMSGSIZE})


def _classify(exc: BaseException) -> str:
    """Returns 'permanent', 'stale' or 'transient' for an exception of one attempt."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError,
                        NotADirectoryError)):
        return "permanent"
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return "transient"
    status = _status_of(exc)
    if status is not None:
        if status == 416:
            return "stale"
        return "transient" if status in (408, 425, 429) or status >= 500 else "permanent"
    if isinstance(exc, OSError):
        if exc.errno in _PERMANENT_ERRNOS:  # s3fs maps S3's 4xx codes to these
            text = str(exc).lower()
            return "stale" if "range" in text and "satisf" in text else "permanent"
        return "transient"
    names = " ".join(c.__name__ for c in type(exc).__mro__).lower()
    if any(w in names for w in ("timeout", "connection", "disconnect", "payload", "throttl")):
        return "transient"
    return "permanent"


def _cause(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, TimeoutError) and not str(exc):
        return f"TimeoutError: no answer within {timeout} s"
    return redact(f"{type(exc).__name__}: {exc}")


def _chain(exc: BaseException) -> BaseException | None:
    """The cause to chain, or None when its text holds a credential (tracebacks print it)."""
    text = f"{exc} {exc.__cause__ or ''} {exc.__context__ or ''}"
    return exc if redact(text) == text else None


# ---------------------------------------------------------------- what a store's fault means
# One place decides, for every edge that talks to a store (get_filesystem, the reader,
# shard_info, load_index, verify_index), which of our errors a client's exception is.

_UNREACHABLE_ERRNOS = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH,
                                 errno.EHOSTDOWN, errno.ENETDOWN, errno.ETIMEDOUT})
# exceptions of these packages are the store's answer (or its absence), never our bug
_STORE_PACKAGES = frozenset({"botocore", "aiobotocore", "boto3", "s3fs", "aiohttp", "fsspec",
                             "gcsfs", "google", "adlfs", "azure", "requests", "urllib3"})


def _advice(fault: str, url: str) -> tuple[str, str] | None:
    """(what is wrong, how to fix it) for a fault of the store itself, not of an object."""
    s3 = url.split("::")[-1].startswith(("s3://", "s3a://"))
    if fault == "credentials":
        where = ("in the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                 "AWS_PROFILE) or in storage_options (key and secret; anon=True for a public "
                 "bucket)") if s3 else "in the environment or in storage_options"
        return "the store found no credentials", f"set them {where}"
    if fault == "unreachable":
        endpoint = ("the endpoint URL (client_kwargs.endpoint_url in storage_options, or "
                    "AWS_ENDPOINT_URL)") if s3 else "the host and port in the URL"
        return ("cannot reach the store",
                f"check {endpoint}, that the server is up and the network to it, then retry")
    return None


def _store_fault(exc: BaseException) -> tuple[str, BaseException] | None:
    """What a failed store call means, looking through its causes.

    Returns:
        ``(fault, the exception that shows it)``, the fault one of ``"credentials"`` (none
        found), ``"unreachable"`` (no connection, DNS, connect or read timeout),
        ``"missing"`` (404, no such key or bucket), ``"forbidden"`` (401, 403) or
        ``"other"`` (any other I/O or store-client error); None when ``exc`` is not a
        store's fault (a bad argument, a bug) and must propagate as it is.
    """
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and len(chain) < 6 and link not in chain:
        chain.append(link)
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)
    for link in chain:  # fsspec's HTTP info() says FileNotFoundError for a refused connection
        names = [c.__name__.lower() for c in type(link).__mro__]
        if any("credential" in n or "tokenretrieval" in n or n.startswith(("sso", "unauthorizedsso"))
               for n in names):
            return "credentials", link
        if isinstance(link, (ConnectionError, TimeoutError)) or getattr(link, "errno", None) \
                in _UNREACHABLE_ERRNOS or any("connect" in n or "timeout" in n for n in names):
            return "unreachable", link
    status = _status_of(exc)
    if isinstance(exc, FileNotFoundError) or status in (404, 410):
        return "missing", exc
    if isinstance(exc, PermissionError) or status in (401, 403):
        return "forbidden", exc
    if isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in _STORE_PACKAGES:
        return "other", exc
    return None


def _store_error(exc: BaseException, url: str, what: str, missing: type[WdsPadError],
                 fix: str) -> WdsPadError | None:
    """Our error for a failed call to the store holding ``url`` (see :func:`call_store`)."""
    found = _store_fault(exc)
    if found is None:
        return None
    fault, culprit = found
    where = f"{what} {redact(url)!r}"
    cause = ("TimeoutError: no answer in time" if isinstance(culprit, TimeoutError)
             and not str(culprit) else _cause(culprit, 0))
    advice = _advice(fault, url)
    if advice is not None:
        return ReadError(f"cannot read {where}: {advice[0]} ({cause}); {advice[1]}")
    if fault == "missing":
        return missing(f"{where} does not exist; {fix}")
    if fault == "forbidden":  # a shard: ShardError; an index (IndexFormatError is no OSError): ReadError
        forbidden = missing if issubclass(missing, OSError) else ReadError
        return forbidden(f"{where} is not readable: {cause}; check the credentials "
                         "(storage_options or the environment) and the object's permissions")
    return ReadError(f"cannot read {where}: {cause}; check the URL and storage_options, "
                     "then retry")


def call_store(fn: Callable[[], Any], url: str, *, what: str = "shard",
               missing: type[WdsPadError] = ShardError,
               fix: str = "check the URL or pattern") -> Any:
    """Runs one call to a store, raising every fault of the store as one of our errors.

    Args:
        fn: The call, e.g. ``lambda: fs.info(path)``.
        url: What it reads (named, redacted, in the error).
        what: What ``url`` is, for the message ("shard", "index").
        missing: The error for an object that does not exist (or is forbidden, if an
            ``OSError``); e.g. :class:`ShardError` or :class:`IndexFormatError`.
        fix: The advice for a missing object.

    Returns:
        What ``fn`` returns.

    Raises:
        ReadError: The store cannot be reached (connection refused, DNS, timeouts), no
            credentials were found, or another I/O fault; the message says what to check.
        WdsPadError: ``missing`` for an object that does not exist or is forbidden.
    """
    try:
        return fn()
    except WdsPadError:
        raise
    except Exception as exc:  # noqa: BLE001 - judged below, raised as ours
        error = _store_error(exc, url, what, missing, fix)
        if error is None:
            raise
        failure: BaseException = exc
    # Raised outside the except clause so no __context__ holds an unredacted text.
    raise error from _chain(failure)


def _backoff(options: ReadOptions, url: str, offset: int, attempt: int) -> float:
    base = min(options.backoff * 2 ** (attempt - 1), options.backoff_max)
    jitter = zlib.crc32(f"{url}|{offset}|{attempt}".encode()) / 2**32
    return base * (0.5 + 0.5 * jitter)


# ---------------------------------------------------------------- the reader

class _Target:
    """A shard's filesystem and path; ``get`` says how a ranged GET shows its headers:
    "s3" (s3fs), "http" (fsspec's aiohttp HTTPFileSystem) or "" (``_cat_file``, no headers)."""

    __slots__ = ("fs", "path", "local", "is_async", "loop", "get")

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self.fs, self.path = fs, path
        self.local = isinstance(fs, LocalFileSystem)
        self.is_async = bool(getattr(fs, "async_impl", False)) and not self.local
        self.get = "" if self.local or not self.is_async else _get_kind(fs)
        self.loop = None
        if self.is_async:
            try:
                self.loop = fs.loop
            except (NotImplementedError, RuntimeError, AttributeError):
                self.loop = fsspec.asyn.get_loop()


def _get_kind(fs: fsspec.AbstractFileSystem) -> str:
    # the modules are loaded already when fs is one of theirs: nothing is imported here
    s3 = sys.modules.get("s3fs.core")
    if s3 is not None and isinstance(fs, s3.S3FileSystem) and hasattr(s3, "_error_wrapper"):
        return "s3"
    http = sys.modules.get("fsspec.implementations.http")
    if http is not None and isinstance(fs, http.HTTPFileSystem):
        return "http"
    return ""


def _total_size(content_range: Any) -> int | None:
    """The object size of a Content-Range header (``bytes 0-99/12345``); None if unknown."""
    if not isinstance(content_range, str):
        return None
    total = content_range.rpartition("/")[2].strip()
    return int(total) if total.isdigit() else None


async def _s3_get(fs: Any, path: str, start: int, end: int) -> tuple[bytes, Any, Any]:
    """s3fs's ``_cat_file`` for one range, keeping ContentRange and ETag of the response."""
    from s3fs.core import _error_wrapper

    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}

    async def call_and_read() -> tuple[bytes, Any, Any]:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key,
                                 Range=f"bytes={start}-{end - 1}", **extra)
        try:
            data = await resp["Body"].read()
        finally:
            resp["Body"].close()
        return data, resp.get("ContentRange"), resp.get("ETag")

    return await _error_wrapper(call_and_read, retries=fs.retries)


async def _http_get(fs: Any, url: str, start: int, end: int) -> tuple[bytes, Any, Any]:
    """fsspec HTTPFileSystem's ``_cat_file`` for one range, keeping Content-Range and ETag."""
    kw = fs.kwargs.copy()
    headers = kw.pop("headers", {}).copy()
    headers["Range"] = f"bytes={start}-{end - 1}"
    kw["headers"] = headers
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), **kw) as r:
        data = await r.read()
        fs._raise_not_found_for_status(r, url)
        return data, r.headers.get("Content-Range"), r.headers.get("ETag")


class _Request:
    """One fetch serving one or more consecutive input ranges of one URL."""

    __slots__ = ("url", "target", "start", "end", "parts", "future", "data")

    def __init__(self, url: str, target: _Target, offset: int, length: int) -> None:
        self.url, self.target = url, target
        self.start, self.end = offset, offset + length
        self.parts = [(offset, length)]
        self.future: concurrent.futures.Future[bytes] | None = None
        self.data: bytes | None = None

    def merge(self, url: str, offset: int, length: int, gap: int, cap: int) -> bool:
        end = max(self.end, offset + length)
        if url != self.url or not self.start <= offset <= self.end + gap \
                or end - self.start > cap:
            return False
        self.end = end
        self.parts.append((offset, length))
        return True


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # seen: asyncio no longer prints it when the future is collected


def _watched(aw: Any) -> Any:
    """``aw`` as a future whose failure counts as retrieved once it is done.

    A request whose consumer stopped (or failed on an earlier range) is cancelled, but it
    may still end in an error, racing the cancel; nobody is left to read that error, and
    asyncio would print each one as "Task exception was never retrieved" with its traceback.
    A consumer still waiting gets the error as before.
    """
    if aw is None:
        return None
    fut = asyncio.ensure_future(aw)
    fut.add_done_callback(_retrieve)
    return fut


def _check_range(rng: Any) -> tuple[str, int, int]:
    try:
        url, offset, length = rng
        offset, length = operator.index(offset), operator.index(length)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"a range must be (url, offset, length) with int offset and "
                          f"length, got {redact(repr(rng))}") from exc
    if not isinstance(url, str):
        raise ConfigError(f"a range's URL must be a str, got {redact(repr(url))}")
    if offset < 0 or length < 0:
        raise ConfigError(f"range of {redact(str(url))!r} has a negative byte offset "
                          f"({offset}) or length ({length}); the index is damaged")
    return url, offset, length


def _close_fds(fds: dict[str, int]) -> None:
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


class RangeReader:
    """Reads byte ranges from any fsspec filesystem, concurrently and in order.

    One reader per process or DataLoader worker; it pickles as its options, and after
    ``os.fork`` rebuilds its descriptors, pool and filesystems on first use. Several
    ``read_many`` iterators may be interleaved in one thread; a reader is not meant to be
    shared by threads (give each thread its own).

    Args:
        options: How to read; defaults to ``ReadOptions()``.
        expected: The indexed ``(size, change stamp)`` of shard URLs (the index's
            ``ShardInfo``). Each listed shard is checked once, when first opened (see the
            module invariants); a shard that changed raises :class:`StaleShardError`.
            None (or a URL not listed): no check beyond short reads.
    """

    def __init__(self, options: ReadOptions | None = None, *,
                 expected: Mapping[str, tuple[int, str]] | None = None) -> None:
        self.options = options if options is not None else ReadOptions()
        if not isinstance(self.options, ReadOptions):
            raise ConfigError(f"options must be a ReadOptions, got {type(options).__name__}")
        self.expected = expected
        # url -> None (checked, unchanged) or the StaleShardError message: one check per shard
        self._verdicts: dict[str, str | None] = {}
        self.stats = ReadStats()
        self._stats_lock = threading.Lock()
        self._pid = os.getpid()
        self._targets: dict[str, _Target] = {}
        self._fds: dict[str, int] = {}  # never replaced: the finalizer closes what it holds
        self._busy: dict[int, int] = {}  # descriptor -> reads in flight on read-ahead threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # a reader per stream is common (BucketedWebDataset makes one per iteration): its
        # descriptors must not outlive it, or every epoch leaks one per shard
        weakref.finalize(self, _close_fds, self._fds)

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "expected": self.expected}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["options"], expected=state.get("expected"))  # type: ignore[misc]

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes cached file descriptors and the thread pool (the reader stays usable).

        Also done when the reader is garbage collected (descriptors only).
        """
        if self._pid == os.getpid() and self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        _close_fds(self._fds)  # after a fork: the child's inherited copies
        self._targets, self._pool, self._busy = {}, None, {}
        self._pid = os.getpid()

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            self.close()

    def local_fd(self, url: str) -> int | None:
        """The cached read-only descriptor of a local shard; None on other filesystems.

        Raises:
            ShardError: the local file cannot be opened.
        """
        self._check_fork()
        if not self._target(url).local:
            return None
        return self._fd(url, 0)

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = _Target(
                *get_filesystem(url, self.options.storage_options))
        return target

    def _fd(self, url: str, offset: int) -> int:
        fd = self._fds.get(url)
        if fd is None:
            path = self._target(url).path
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise ShardError(f"cannot open shard {redact(url)!r} to read byte offset "
                                 f"{offset}: {_cause(exc, 0)}; check the path, or rebuild the "
                                 "index if shards moved") from exc
            if self.expected is not None and url not in self._verdicts:
                try:
                    st = os.fstat(fd)
                except OSError:
                    st = None  # unknowable: the reads themselves will tell
                if st is not None:
                    self._verdicts[url] = self._changed(url, st.st_size,
                                                        change_stamp({"mtime": st.st_mtime}))
            if self._verdicts.get(url) is not None:
                os.close(fd)
                raise StaleShardError(self._verdicts[url])
            if len(self._fds) >= _MAX_OPEN_FDS:
                # the oldest descriptor no read-ahead thread is reading from
                idle = next((u for u, d in self._fds.items() if d not in self._busy), None)
                if idle is not None:
                    os.close(self._fds.pop(idle))
            self._fds[url] = fd
        return fd

    def local_read_ahead(self) -> LocalReadAhead:
        """A read-ahead of large local ranges for one stream (see :class:`LocalReadAhead`)."""
        return LocalReadAhead(self, self.options.local_threads)

    def _pread(self, url: str, offset: int, length: int) -> bytes:
        try:
            return os.pread(self._fd(url, offset), length, offset)
        except OSError as exc:
            raise ReadError(f"reading {length} bytes at byte offset {offset} of "
                            f"{redact(url)!r} failed: {_cause(exc, 0)}; check the disk") from exc

    def read(self, url: str, offset: int, length: int) -> bytes:
        """Reads one byte range.

        Raises:
            ShardError: The shard is missing or forbidden (no retries).
            StaleShardError: The shard is shorter than the range (it changed).
            ReadError: Transient failures outlasted ``retries`` or a timeout.
        """
        it = self.read_many(((url, offset, length),))
        try:
            return next(it)
        finally:
            it.close()

    def read_many(self, ranges: Iterable[tuple[str, int, int]]) -> Iterator[bytes]:
        """Yields the bytes of each range in input order, reading ahead concurrently.

        Consecutive ranges of one URL within ``merge_gap`` are fetched as one request
        and sliced. Up to ``max_in_flight`` requests and ``max_bytes_in_flight`` bytes are
        kept ahead of the consumer. Closing the iterator cancels what is in flight.

        Args:
            ranges: ``(url, offset, length)`` triples, e.g. from the tar index.

        Yields:
            Exactly ``length`` bytes per range.

        Raises:
            ShardError, StaleShardError, ReadError: As for :meth:`read`, after every
                earlier range was yielded.
        """
        self._check_fork()
        it = iter(ranges)
        first = yield from self._read_local(it)
        if first is not None:
            yield from self._read_general(it, first)

    def _read_local(self, it: Iterator[Any]) -> Iterator[bytes]:
        """Fast path while every range is local: inline pread; returns the first other."""
        fds, pread, count, nbytes = self._fds, os.pread, 0, 0
        try:
            for rng in it:
                try:
                    url, offset, length = rng
                    fd = fds.get(url)
                except (TypeError, ValueError):
                    _check_range(rng)
                    raise
                if fd is None:
                    url, offset, length = _check_range(rng)
                    if not self._target(url).local:
                        return (url, offset, length)
                    fd = self._fd(url, offset)
                try:
                    data = pread(fd, length, offset)
                except (OSError, ValueError, TypeError, OverflowError):
                    _check_range(rng)
                    data = self._pread(url, offset, length)
                if len(data) != length:
                    raise self._stale(url, offset, length, len(data))
                count += 1
                nbytes += length
                yield data
            return None
        finally:
            st = self.stats
            st.ranges += count
            st.requests += count
            st.bytes += nbytes

    def _changed(self, url: str, size: int | None, stamp: str) -> str | None:
        """None if the shard is as indexed (or unlisted), else the StaleShardError message.

        The size is compared when both are known; the stamp only when the index recorded
        one of the same kind (an ETag with an ETag, an mtime with an mtime).
        """
        want = self.expected.get(url) if self.expected is not None else None
        if want is None:
            return None
        want_size, want_stamp = want
        differs = size is not None and want_size >= 0 and size != want_size
        same_kind = bool(stamp) and stamp.partition("=")[0] == want_stamp.partition("=")[0]
        differs = differs or (same_kind and stamp != want_stamp)
        if not differs:
            return None
        now = f"{size} bytes" if size is not None else "size unknown"
        return (f"shard {redact(url)!r} changed since it was indexed: it now has {now}"
                f"{f', {stamp}' if same_kind else ''}, the index records {want_size} bytes"
                f"{f', {want_stamp}' if same_kind else ''}; its samples may no longer be at the "
                "indexed byte ranges. Re-index the changed shards: `wds-pad index SHARDS -o INDEX "
                "--update` (or restore the shard)")

    async def _get(self, target: _Target, url: str, start: int, end: int) -> bytes:
        """One ranged GET; the first response of a listed S3/HTTP shard also checks it."""
        if self.expected is None or not target.get:
            return await target.fs._cat_file(target.path, start=start, end=end)
        if self._verdicts.get(url) is not None:  # known to have changed: no more requests
            raise StaleShardError(self._verdicts[url])
        get = _s3_get if target.get == "s3" else _http_get
        data, content_range, etag = await get(target.fs, target.path, start, end)
        if url not in self._verdicts:  # the first answer decides; all run on one IO loop
            self._verdicts[url] = self._changed(url, _total_size(content_range),
                                                change_stamp({"ETag": etag}))
        verdict = self._verdicts[url]
        if verdict is not None:
            raise StaleShardError(verdict)
        return data

    def _stale(self, url: str, offset: int, length: int, got: int) -> StaleShardError:
        return StaleShardError(
            f"shard {redact(url)!r} returned {got} of {length} bytes at byte offset {offset}: "
            "it changed or shrank since it was indexed; rebuild the index (wds-pad index)")

    def _pool_for_sync(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.options.max_in_flight, thread_name_prefix="wds_pad-read")
        return self._pool

    def _submit(self, req: _Request) -> None:
        target, st, length = req.target, self.stats, req.end - req.start
        st.requests += 1
        if length == 0:
            req.data = b""
        elif target.local:
            req.data = self._pread(req.url, req.start, length)
        else:
            pool = None if target.is_async else self._pool_for_sync()
            loop = target.loop or fsspec.asyn.get_loop()
            req.future = asyncio.run_coroutine_threadsafe(
                self._fetch(target, pool, req.url, req.start, length, len(req.parts)), loop)

    async def _fetch(self, target: _Target, pool: concurrent.futures.Executor | None,
                     url: str, start: int, length: int, nparts: int) -> bytes:
        opts, attempt = self.options, 0
        _watched(asyncio.current_task())  # cancelled by a consumer gone, it may still fail
        what = f"{length} bytes at byte offset {start} of {redact(url)!r}" + (
            f" (one request for {nparts} merged ranges)" if nparts > 1 else "")
        while True:
            attempt += 1
            try:
                if pool is None:
                    call = self._get(target, url, start, start + length)
                else:
                    call = asyncio.get_running_loop().run_in_executor(pool, functools.partial(
                        target.fs.cat_file, target.path, start=start, end=start + length))
                return await asyncio.wait_for(_watched(call), opts.timeout)
            except WdsPadError:
                raise
            except Exception as exc:  # noqa: BLE001 - judged below, raised as ours
                failure: BaseException = exc
            # Raised outside the except clause so no __context__ holds an unredacted text.
            error = self._judge(failure, what, attempt, url)
            if error is not None:
                raise error from _chain(failure)
            delay = _backoff(opts, url, start, attempt)
            logger.info("retrying %s in %.2f s after %s", what, delay,
                        _cause(failure, opts.timeout))
            await asyncio.sleep(delay)

    def _judge(self, exc: BaseException, what: str, attempt: int, url: str = "",
               ) -> Exception | None:
        """Returns the error to raise for a failed attempt, or None to retry it."""
        opts = self.options
        kind, cause = _classify(exc), _cause(exc, opts.timeout)
        if kind == "stale":
            return StaleShardError(f"{what} is past the end of the shard ({cause}): it changed "
                                   "or shrank since it was indexed; rebuild the index")
        if kind == "permanent" and (isinstance(exc, OSError) or _status_of(exc)):
            return ShardError(f"cannot read {what}: {cause}; the shard is missing or not "
                              "readable with these credentials: check the URL and "
                              "storage_options, or rebuild the index")
        found = _store_fault(exc)
        advice = _advice(found[0], url) if found is not None else None
        if kind == "permanent":
            if advice is not None:
                return ReadError(f"reading {what} failed: {advice[0]} ({cause}); {advice[1]}")
            return ReadError(f"reading {what} failed: {cause} (not retried: not a transient "
                             "error)")
        with self._stats_lock:
            self.stats.timeouts += isinstance(exc, TimeoutError)
            if attempt <= opts.retries:
                self.stats.retries += 1
                return None
        hint = (f"ReadOptions.timeout (now {opts.timeout} s)" if isinstance(exc, TimeoutError)
                else f"ReadOptions.retries (now {opts.retries}) or backoff_max")
        return ReadError(f"reading {what} failed after {attempt} attempts; last error: "
                         f"{cause}. If the store is slow or overloaded, raise {hint}"
                         + (f"; if it is down or the endpoint is wrong: {advice[1]}"
                            if advice is not None and not isinstance(exc, TimeoutError) else ""))

    def _read_general(self, it: Iterator[Any], nxt: tuple[str, int, int] | None,
                      ) -> Iterator[bytes]:
        """Read-ahead loop for remote (or mixed) streams; see the module invariants."""
        opts, st = self.options, self.stats
        cap = min(opts.max_merged_bytes, opts.max_bytes_in_flight)
        gap, max_n, max_b = opts.merge_gap, opts.max_in_flight, opts.max_bytes_in_flight
        guard = (opts.retries + 1) * (opts.timeout + opts.backoff_max) + 30.0
        pending: deque[_Request] = deque()
        held: _Request | None = None  # being merged, not yet submitted
        inflight, exhausted = 0, False

        def fits(req: _Request) -> bool:
            return not pending or (len(pending) < max_n
                                   and inflight + req.end - req.start <= max_b)

        def submit(req: _Request) -> None:
            nonlocal inflight
            self._submit(req)
            pending.append(req)
            inflight += req.end - req.start
            st.peak_bytes_in_flight = max(st.peak_bytes_in_flight, inflight)
            st.peak_requests_in_flight = max(st.peak_requests_in_flight, len(pending))

        try:
            while True:
                while True:
                    if nxt is None and not exhausted:
                        try:
                            nxt = _check_range(next(it))
                        except StopIteration:
                            exhausted = True
                    if nxt is None:
                        if held is not None and fits(held):
                            submit(held)
                            held = None
                        break
                    if held is not None and held.merge(*nxt, gap, cap):
                        st.merged += 1
                        nxt = None
                        continue
                    if held is not None:
                        if not fits(held):
                            break
                        submit(held)
                    held, nxt = _Request(nxt[0], self._target(nxt[0]), nxt[1], nxt[2]), None
                if not pending:
                    if held is None:
                        return
                    submit(held)
                    held = None
                head = pending[0]
                data = head.data
                if data is None and head.future is not None:
                    try:
                        data = head.future.result(timeout=guard)
                    except concurrent.futures.TimeoutError:
                        raise ReadError(f"reading byte offset {head.start} of "
                                        f"{redact(head.url)!r} hung past {guard:.0f} s; the IO "
                                        "loop is blocked") from None
                size = head.end - head.start
                if len(data) != size:
                    if len(data) > size:
                        raise ReadError(f"{redact(head.url)!r} returned {len(data)} bytes for a "
                                        f"range of {size} at byte offset {head.start}: the "
                                        "server ignored the Range header")
                    for off, ln in head.parts:
                        if off + ln - head.start > len(data):
                            raise self._stale(head.url, off, ln,
                                              max(0, len(data) - (off - head.start)))
                st.bytes += size
                st.ranges += len(head.parts)
                if len(head.parts) == 1:
                    yield data
                else:
                    for off, ln in head.parts:
                        yield data[off - head.start:off - head.start + ln]
                pending.popleft()
                inflight -= size
        finally:
            for req in pending:
                if req.future is not None:
                    req.future.cancel()


# ---------------------------------------------------------------- local read-ahead

class _Job:
    """One local range to parse, run by whoever acquires ``claim`` first: a read-ahead
    thread, or the consumer when it would otherwise wait. ``done`` is released after."""

    __slots__ = ("claim", "done", "parse", "fd", "url", "offset", "length", "arg", "result",
                 "error")

    def __init__(self, parse: Callable[..., Any], fd: int, url: str, offset: int, length: int,
                 arg: Any) -> None:
        self.claim = threading.Lock()
        self.done = threading.Lock()
        self.done.acquire()
        self.parse, self.fd, self.url, self.offset, self.length, self.arg = (
            parse, fd, url, offset, length, arg)
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.parse(self.fd, self.url, self.offset, self.length, self.arg)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer with its item
            self.error = exc
        finally:
            self.done.release()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.release()


def _serve(jobs: queue.SimpleQueue[_Job | None], stopped: list[bool]) -> None:
    """A read-ahead thread: runs the jobs it claims, in arrival order, until it takes None.

    It holds only the queue and the flag, never the stream, so a stream dropped without
    being closed is still collected (and its finalizer stops the thread).
    """
    while True:
        job = jobs.get()
        if job is None:
            return
        if job.claim.acquire(False):
            if stopped[0]:
                job.fail(ReadError(f"the read-ahead was closed before byte offset {job.offset} "
                                   f"of {redact(job.url)!r} was read"))
            else:
                job.run()
        job = None  # type: ignore[assignment]  # no finished sample stays alive while idle


def _stop(jobs: queue.SimpleQueue[_Job | None], stopped: list[bool], threads: int) -> None:
    stopped[0] = True  # jobs still queued are skipped, not read
    for _ in range(threads):
        jobs.put(None)


class LocalReadAhead:
    """Large local ranges read (and parsed) ahead of one consumer by a few threads.

    ``os.pread`` releases the GIL, so while the consumer turns item i into a sample, the
    kernel copies the bytes of the next items on another core. When the next item is not
    ready, the consumer runs the first item no thread has started itself instead of
    waiting: ``threads`` threads plus the consumer keep that many cores busy. One object
    per stream, made by :meth:`RangeReader.local_read_ahead`.

    Invariants:
        * :meth:`run` yields one ``(arg, result, error)`` per item, in input order;
          ``error`` is what that item's parse (or opening its shard) raised, and later
          items are still read. An error of the item iterator itself is raised after
          every item before it was yielded.
        * At most ``max_in_flight`` items and ``max(max_bytes_in_flight, largest item)``
          bytes are taken ahead of the consumer (the reader's ``ReadOptions``), as for
          ``read_many``; ``peak_*_in_flight`` in the reader's stats show the peaks.
        * Threads start on first use in the current process and stop on :meth:`close`
          or when this object is garbage collected, without waiting for an item in
          progress; a :meth:`run` abandoned half way drops the items no thread started.
          After ``os.fork`` the child starts its own threads and reads again what the
          parent's had not finished.
        * A descriptor stays open (pinned in the reader's cache) while a thread may read it.
        * With 0 threads every item is parsed inline, in the consumer.

    Args:
        reader: Opens the shards (in the consumer's thread) and counts stats.
        threads: Read-ahead threads; 0 parses inline.
    """

    def __init__(self, reader: RangeReader, threads: int) -> None:
        self.reader = reader
        self.threads = threads
        self._jobs: queue.SimpleQueue[_Job | None] | None = None
        self._pid = -1
        self._stopper: weakref.finalize | None = None
        self._workers: list[threading.Thread] = []

    def __enter__(self) -> LocalReadAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def workers(self) -> list[threading.Thread]:
        """The threads started in this process (none before first use and after close)."""
        return list(self._workers) if self._pid == os.getpid() else []

    def close(self) -> None:
        """Stops the threads (queued items are skipped); the object stays usable."""
        if self._stopper is not None:
            if self._pid == os.getpid():
                self._stopper()
            else:
                self._stopper.detach()  # forked: those threads live in the parent only
        self._jobs, self._stopper, self._workers, self._pid = None, None, [], -1

    def _queue(self) -> queue.SimpleQueue[_Job | None]:
        if self._jobs is None or self._pid != os.getpid():
            self.close()
            jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
            stopped = [False]
            self._workers = [threading.Thread(target=_serve, args=(jobs, stopped), daemon=True,
                                              name=f"wds_pad-local-read-{i}")
                             for i in range(self.threads)]
            for thread in self._workers:
                thread.start()
            self._stopper = weakref.finalize(self, _stop, jobs, stopped, self.threads)
            self._jobs, self._pid = jobs, os.getpid()
        return self._jobs

    def _submit(self, parse: Callable[..., Any], url: str, offset: int, length: int,
                arg: Any) -> _Job:
        reader = self.reader
        try:
            fd = reader.local_fd(url)
            if fd is None:
                raise ConfigError(f"{redact(url)!r} is not a local file; only local ranges "
                                  "are read ahead by threads")
        except Exception as exc:  # noqa: BLE001 - delivered with this item, in order
            job = _Job(parse, -1, url, offset, length, arg)
            job.claim.acquire()
            job.fail(exc)
            return job
        job = _Job(parse, fd, url, offset, length, arg)
        busy = reader._busy  # the descriptor stays open while a thread may read it
        busy[fd] = busy.get(fd, 0) + 1
        self._queue().put(job)
        return job

    def _unpin(self, job: _Job) -> None:
        busy = self.reader._busy
        n = busy.get(job.fd, 0)
        if n > 1:
            busy[job.fd] = n - 1
        elif n:
            del busy[job.fd]

    def run(self, items: Iterable[tuple[str, int, int, Any]],
            parse: Callable[[int, str, int, int, Any], Any],
            ) -> Iterator[tuple[Any, Any, BaseException | None]]:
        """Yields ``(arg, parse(fd, url, offset, length, arg), None)`` per item, in order.

        Args:
            items: ``(url, offset, length, arg)`` of ranges of local files.
            parse: Called on a read-ahead thread (or in the consumer) with the shard's
                cached descriptor; it must not keep the descriptor.

        Yields:
            ``(arg, result, None)``, or ``(arg, None, error)`` for an item whose parse or
            shard failed.
        """
        if self.threads == 0:
            yield from self._inline(items, parse)
            return
        st, opts = self.reader.stats, self.reader.options
        max_n, max_b = opts.max_in_flight, opts.max_bytes_in_flight
        window: deque[_Job] = deque()
        inflight, pid = 0, os.getpid()
        it = iter(items)
        held: tuple[str, int, int, Any] | None = None
        exhausted, failure = False, None
        try:
            while True:
                if os.getpid() != pid:  # forked while suspended: the parent's threads are gone
                    pid = os.getpid()
                    self._resubmit(window)
                while not exhausted:
                    if held is None:
                        try:
                            held = next(it)
                        except StopIteration:
                            exhausted = True
                            break
                        except Exception as exc:  # noqa: BLE001 - raised after the items before it
                            exhausted, failure = True, exc
                            break
                    if window and (len(window) >= max_n or inflight + held[2] > max_b):
                        break
                    window.append(self._submit(parse, *held))
                    inflight += held[2]
                    held = None
                    if inflight > st.peak_bytes_in_flight:
                        st.peak_bytes_in_flight = inflight
                    if len(window) > st.peak_requests_in_flight:
                        st.peak_requests_in_flight = len(window)
                if not window:
                    break
                job = window[0]
                while not job.done.acquire(False):
                    for other in window:  # the first item no thread has started
                        if other.claim.acquire(False):
                            other.run()
                            if other.error is not None and not isinstance(other.error, Exception):
                                raise other.error  # KeyboardInterrupt: at once, not in turn
                            break
                    else:
                        job.done.acquire()
                        break
                window.popleft()
                inflight -= job.length
                self._unpin(job)
                if job.error is None:
                    st.ranges += 1
                    st.requests += 1
                    st.bytes += job.length
                yield job.arg, job.result, job.error
                job = None  # type: ignore[assignment]
            if failure is not None:
                raise failure
        finally:
            for job in window:  # abandoned: claim what no thread started, so none will
                if job.claim.acquire(False):
                    job.fail(ReadError(f"the stream was closed before byte offset {job.offset} "
                                       f"of {redact(job.url)!r} was read"))
                self._unpin(job)

    def _resubmit(self, window: deque[_Job]) -> None:
        """In a forked child: submits again every item the parent had not finished."""
        old = list(window)
        window.clear()
        for job in old:
            if job.done.locked():
                job = self._submit(job.parse, job.url, job.offset, job.length, job.arg)
            else:
                job.fd = -1  # finished; that number may now be one of the child's own
            window.append(job)

    def _inline(self, items: Iterable[tuple[str, int, int, Any]],
                parse: Callable[[int, str, int, int, Any], Any],
                ) -> Iterator[tuple[Any, Any, BaseException | None]]:
        reader, st = self.reader, self.reader.stats
        for url, offset, length, arg in items:
            try:
                fd = reader.local_fd(url)
                if fd is None:
                    raise ConfigError(f"{redact(url)!r} is not a local file")
                result = parse(fd, url, offset, length, arg)
            except Exception as exc:  # noqa: BLE001 - the caller decides, as with threads
                yield arg, None, exc
                continue
            st.ranges += 1
            st.requests += 1
            st.bytes += length
            yield arg, result, None
