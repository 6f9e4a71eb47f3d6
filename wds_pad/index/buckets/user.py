"""Bucket keys the user supplies: a key -> bucket table, or a function of the sample.

Invariants:
    * :class:`MappingBuckets` reads its table once, at construction (the one bucket
      function that does I/O, and only there); every entry is checked by
      :func:`~.protocol.check_bucket_key`; a key not in the table
      is excluded (``None``). ``describe()`` holds the sha256 of the table's canonical
      JSON, so indexes built from different maps never describe alike.
    * :class:`CallableBuckets` passes the members exactly as read, never decoded; any
      exception of the user's function becomes a :class:`BucketError` naming the
      sample key, and its result is checked as by ``check_bucket_key``.
    * Bad configuration (unreadable or malformed map, non-callable, bad members or
      head_bytes) raises :class:`ConfigError` at construction.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import BucketError, ConfigError
from .protocol import BucketKey, check_member, check_bucket_key

__all__ = ["CallableBuckets", "MappingBuckets", "wrap_callable"]

def _read_text(url: str) -> str:
    import fsspec  # I/O at the edge: only a mapping file needs it

    try:
        with fsspec.open(url, "rb") as fh:
            raw = fh.read()
        return raw.decode("utf-8-sig")
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(f"cannot read bucket map {url!r}: {type(exc).__name__}: {exc}") from exc


def _parse_table(text: str, url: str) -> dict[str, Any]:
    if url.endswith(".json") or text.lstrip()[:1] in ("{", "["):
        try:
            table = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"bucket map {url!r} is not valid JSON: {exc}") from exc
        return table
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    delimiter = "\t" if lines and "\t" in lines[0] else ","
    table: dict[str, Any] = {}
    for lineno, row in enumerate(csv.reader(io.StringIO("\n".join(lines)), delimiter=delimiter), 1):
        if len(row) != 2:
            raise ConfigError(
                f"bucket map {url!r}, data line {lineno}: expected 'key{delimiter!r}bucket', got {row!r}"
            )
        key, bucket = row[0].strip(), row[1].strip()
        if key in table and table[key] != bucket:
            raise ConfigError(f"bucket map {url!r}: key {key!r} maps to both {table[key]!r} and {bucket!r}")
        table[key] = bucket
    return table


@dataclass(frozen=True)
class MappingBuckets:
    """Bucket keys looked up by sample key; samples not in the map are excluded.

    The source is an in-memory mapping or a file (local path or fsspec URL): a JSON
    object ``{"key": bucket}`` (bucket a str, int, float, or null to exclude; a file
    ending in ``.json`` or starting with ``{`` or ``[`` is read as JSON), or lines
    ``key<TAB>bucket`` (TSV) / ``key,bucket`` (CSV, quoting allowed), where buckets are
    strings; blank lines and lines starting with ``#`` are skipped.

    Args:
        source: A mapping, or the path / URL of a mapping file.
    """

    source: str | Mapping[str, Any]
    members: tuple[str, ...] = field(default=(), init=False)
    head_bytes: int | None = field(default=None, init=False)
    _table: dict[str, BucketKey | None] = field(init=False, repr=False, compare=False)
    _digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.source, str):
            raw, where = _parse_table(_read_text(self.source), self.source), repr(self.source)
        elif isinstance(self.source, Mapping):
            raw, where = self.source, "the given mapping"
        else:
            raise ConfigError(
                f"MappingBuckets needs a mapping or a file path/URL, got {type(self.source).__name__}"
            )
        if not isinstance(raw, Mapping) or not raw:
            raise ConfigError(f"bucket map {where} must be a non-empty key -> bucket object")
        table: dict[str, BucketKey | None] = {}
        for key, bucket in raw.items():
            try:
                table[str(key)] = check_bucket_key(bucket, str(key))
            except BucketError as exc:
                raise ConfigError(f"bucket map {where}: {exc}") from exc
        canonical = json.dumps(table, sort_keys=True, separators=(",", ":"))
        object.__setattr__(self, "_table", table)
        object.__setattr__(self, "_digest", hashlib.sha256(canonical.encode()).hexdigest())

    def __call__(self, key: str, data: Mapping[str, bytes]) -> BucketKey | None:
        return self._table.get(key)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "map",
            "source": self.source if isinstance(self.source, str) else None,
            "entries": len(self._table),
            "sha256": self._digest,
        }


@dataclass(frozen=True)
class CallableBuckets:
    """A user function ``fn(key, data) -> bucket | None`` as a :class:`BucketFn`.

    ``data`` is exactly what the indexer read: ``{extension: raw bytes}`` for the
    ``members`` present in the sample (at most ``head_bytes`` each). Nothing is decoded,
    not even ``json`` members: call ``json.loads(data["json"])`` yourself. The result is
    checked as in :func:`check_bucket_key`; any exception the function raises becomes a
    :class:`BucketError` naming the key. To index with several processes the function
    must pickle (a module-level function, not a lambda).
    """

    fn: Callable[[str, Mapping[str, bytes]], object]
    members: tuple[str, ...] = ("json",)
    head_bytes: int | None = None

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ConfigError(f"wrap_callable needs a callable fn(key, data), got {self.fn!r}")
        if isinstance(self.members, str):
            raise ConfigError(
                f"members must be a tuple of extensions like ('json',), got the string {self.members!r}"
            )
        object.__setattr__(self, "members", tuple(self.members))
        for ext in self.members:
            check_member(ext, "wrap_callable members item")
        hb = self.head_bytes
        if hb is not None and (isinstance(hb, bool) or not isinstance(hb, int) or hb < 1):
            raise ConfigError(f"head_bytes must be None or a positive int, got {hb!r}")

    @property
    def name(self) -> str:
        """``module.qualname`` of the wrapped function."""
        fn = self.fn
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"

    def __call__(self, key: str, data: Mapping[str, bytes]) -> BucketKey | None:
        try:
            result = self.fn(key, data)
        except Exception as exc:  # a user function may raise anything: name the sample
            raise BucketError(
                f"sample {key!r}: bucket function {self.name} raised {type(exc).__name__}: {exc}"
            ) from exc
        return check_bucket_key(result, key)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "callable",
            "function": self.name,
            "members": list(self.members),
            "head_bytes": self.head_bytes,
        }


def wrap_callable(
    fn: Callable[[str, Mapping[str, bytes]], object],
    members: Sequence[str] = ("json",),
    head_bytes: int | None = None,
) -> CallableBuckets:
    """Make a :class:`BucketFn` of a user function ``fn(key, data) -> bucket | None``.

    ``fn`` receives the sample key and ``{extension: raw bytes}``; JSON members are NOT
    decoded (see :class:`CallableBuckets`). Example::

        def by_lang(key, data):
            return json.loads(data["json"]).get("lang")  # None excludes the sample

        bucket_fn = wrap_callable(by_lang, members=("json",))

    Args:
        fn: The function; module-level so that it pickles into indexing workers.
        members: Member extensions it needs.
        head_bytes: Read only this many bytes of each member (None: whole members).

    Raises:
        ConfigError: ``fn`` is not callable, or members / head_bytes are malformed.
    """
    if isinstance(members, str):
        raise ConfigError(f"members must be a tuple of extensions like ('json',), got the string {members!r}")
    return CallableBuckets(fn, tuple(members), head_bytes)
