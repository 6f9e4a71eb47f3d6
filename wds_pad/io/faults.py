"""What a store's fault means: one judgement for every edge that talks to a store.

The filesystems (:mod:`wds_pad.io.fs`), the range reader (:mod:`wds_pad.io.ranges`),
``shard_info``, ``load_index`` and ``verify_index`` all turn a client's exception into
one of our errors here, so the same cause always gives the same error and advice.

Invariants:
    * One failed read attempt is ``stale``, ``permanent`` (raised at once, by
      :func:`attempt_error`) or ``transient`` (retried, then :func:`retries_exhausted`),
      looking through the causes an HTTP status hides behind (s3fs, botocore).
    * A fault of the store itself ("cannot reach the store", "no credentials") is a
      :class:`ReadError`; "does not exist" is the caller's error (:class:`ShardError`,
      :class:`IndexFormatError`), each with its own advice (:func:`call_store`).
    * An exception that is no store's fault (a bad argument, a bug) propagates as it is.
    * Every message passes through :func:`redact`; a cause whose text holds a credential
      is not chained (:func:`error_chain`), since tracebacks print it.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from typing import Any, Callable

from wds_pad.errors import ReadError, ShardError, StaleShardError, WdsPadError

from .redact import redact

__all__ = ["call_store"]


# ---------------------------------------------------------------- what kind of failure

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


# a body cut short: fewer bytes than its Content-Length, a reset or a truncated chunked
# body mid-way (aiohttp's ContentLengthError carries code 400, yet the request was fine)
_CUT_SHORT = ("payload", "contentlength", "transferencoding", "incompleteread", "responsestreaming",
              "serverdisconnected", "chunkedencoding", "protocolerror", "connectionclosed")


def _cut_short(exc: BaseException | None) -> bool:
    """Whether the answer's body was cut short, looking through up to 4 causes or contexts."""
    for _ in range(5):
        if exc is None:
            return False
        if any(w in c.__name__.lower() for c in type(exc).__mro__ for w in _CUT_SHORT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _classify(exc: BaseException) -> str:
    """Returns 'permanent', 'stale' or 'transient' for an exception of one attempt."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError,
                        NotADirectoryError)):
        return "permanent"
    if isinstance(exc, (TimeoutError, ConnectionError)) or _cut_short(exc):
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


def cause_text(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, TimeoutError) and not str(exc):
        return f"TimeoutError: no answer within {timeout} s"
    return redact(f"{type(exc).__name__}: {exc}")


def error_chain(exc: BaseException) -> BaseException | None:
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


def store_error(exc: BaseException, url: str, what: str, missing: type[WdsPadError],
                 fix: str, action: str = "read") -> WdsPadError | None:
    """Our error for a failed call to the store holding ``url`` (see :func:`call_store`)."""
    found = _store_fault(exc)
    if found is None:
        return None
    fault, culprit = found
    where = f"{what} {redact(url)!r}"
    cause = ("TimeoutError: no answer in time" if isinstance(culprit, TimeoutError)
             and not str(culprit) else cause_text(culprit, 0))
    advice = _advice(fault, url)
    if advice is not None:
        return ReadError(f"cannot {action} {where}: {advice[0]} ({cause}); {advice[1]}")
    if fault == "missing":
        return missing(f"{where} does not exist; {fix}")
    if fault == "forbidden":  # a shard: ShardError; an index (IndexFormatError is no OSError): ReadError
        forbidden = missing if issubclass(missing, OSError) else ReadError
        able = "writable" if action == "write" else "readable"
        return forbidden(f"{where} is not {able}: {cause}; check the credentials "
                         "(storage_options or the environment) and the object's permissions")
    return ReadError(f"cannot {action} {where}: {cause}; check the URL and storage_options, "
                     "then retry")


def call_store(fn: Callable[[], Any], url: str, *, what: str = "shard",
               missing: type[WdsPadError] = ShardError,
               fix: str = "check the URL or pattern", action: str = "read") -> Any:
    """Runs one call to a store, raising every fault of the store as one of our errors.

    Args:
        fn: The call, e.g. ``lambda: fs.info(path)``.
        url: What it reads (named, redacted, in the error).
        what: What ``url`` is, for the message ("shard", "index").
        missing: The error for an object that does not exist (or is forbidden, if an
            ``OSError``); e.g. :class:`ShardError` or :class:`IndexFormatError`.
        fix: The advice for a missing object.
        action: What ``fn`` does to ``url``, for the message: "read" or "write".

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
        error = store_error(exc, url, what, missing, fix, action)
        if error is None:
            raise
        failure: BaseException = exc
    # Raised outside the except clause so no __context__ holds an unredacted text.
    raise error from error_chain(failure)


# ---------------------------------------------------------------- a failed read attempt

def attempt_error(exc: BaseException, what: str, url: str, timeout: float) -> Exception | None:
    """The error a failed attempt to read ``what`` ends in at once; None if it is transient
    (to be retried; see :func:`retries_exhausted`)."""
    kind, cause = _classify(exc), cause_text(exc, timeout)
    if kind == "stale":
        return StaleShardError(f"{what} is past the end of the shard ({cause}): it changed "
                               "or shrank since it was indexed; rebuild the index")
    if kind == "permanent" and (isinstance(exc, OSError) or _status_of(exc)):
        return ShardError(f"cannot read {what}: {cause}; the shard is missing or not "
                          "readable with these credentials: check the URL and "
                          "storage_options, or rebuild the index")
    if kind == "permanent":
        advice = _advice_for(exc, url)
        if advice is not None:
            return ReadError(f"reading {what} failed: {advice[0]} ({cause}); {advice[1]}")
        return ReadError(f"reading {what} failed: {cause} (not retried: not a transient "
                         "error)")
    return None


def retries_exhausted(exc: BaseException, what: str, attempt: int, url: str, timeout: float,
                       retries: int) -> ReadError:
    """The error after a transient fault outlasted every retry: what to raise, and how."""
    cause, advice = cause_text(exc, timeout), _advice_for(exc, url)
    hint = (f"ReadOptions.timeout (now {timeout} s)" if isinstance(exc, TimeoutError)
            else f"ReadOptions.retries (now {retries}) or backoff_max")
    return ReadError(f"reading {what} failed after {attempt} attempts; last error: "
                     f"{cause}. If the store is slow or overloaded, raise {hint}"
                     + (f"; if it is down or the endpoint is wrong: {advice[1]}"
                        if advice is not None and not isinstance(exc, TimeoutError) else ""))


def _advice_for(exc: BaseException, url: str) -> tuple[str, str] | None:
    found = _store_fault(exc)
    return _advice(found[0], url) if found is not None else None
