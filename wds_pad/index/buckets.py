"""Bucket-key functions: which bucket a sample belongs to, computed at index time.

The indexer scans each sample's tar headers and reads only the members a bucket
function asks for (``members``), optionally only their first ``head_bytes`` bytes, then
calls ``fn(key, data)`` with ``data = {extension: raw bytes}``. The result is the
sample's bucket key, or ``None`` to exclude the sample from the index.

Invariants:
    * Bucket keys are JSON-safe scalars: ``str``, ``int`` or finite ``float`` (never
      ``bool``). Built-ins return readable strings: aspect ratios as the ratio's label
      (``"4:3"``, ``"1.333"``), length bands as ``"<128"`` / ``"128-256"`` / ``">=1024"``.
    * A bucket function is a pure function of ``(key, data)``: no I/O, no clock, no
      randomness, so every rank and every re-index computes the same keys.
    * ``describe()`` returns a JSON-safe dict that says how the buckets were computed;
      it is stored in the index.
    * Bad configuration raises :class:`ConfigError` at construction; bad sample data
      raises :class:`BucketError` naming the sample key and the field or member at
      fault (the indexer adds the shard URL and byte offset).

Image sizes are read from PNG, JPEG and WebP headers without decoding by
:mod:`wds_pad.index.imagesize`; its :func:`image_size` is re-exported here.
"""

from __future__ import annotations

import bisect
import csv
import functools
import hashlib
import io
import itertools
import json
import json.scanner
import math
import numbers
import operator
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Protocol, runtime_checkable

import numpy as np

from wds_pad.index.imagesize import image_size, image_size_or_none
from wds_pad.errors import BucketError, ConfigError

__all__ = [
    "DEFAULT_RATIOS",
    "AspectBuckets",
    "BucketFn",
    "BucketKey",
    "CallableBuckets",
    "ImageBuckets",
    "JsonField",
    "MappingBuckets",
    "SingleBucket",
    "check_bucket_key",
    "image_size",
    "parse_bucket_by",
    "parse_ratios",
    "wrap_callable",
]

BucketKey = str | int | float


@runtime_checkable
class BucketFn(Protocol):
    """What the indexer needs from a bucket-key function.

    Attributes:
        members: Member extensions whose bytes are needed (``()`` for none). For a
            tuple of image extensions, the indexer passes the first present one.
        head_bytes: Read only the first N bytes of those members (``None``: whole).
    """

    members: tuple[str, ...]
    head_bytes: int | None

    def __call__(self, key: str, data: Mapping[str, bytes]) -> Hashable | None:
        """Return the sample's bucket key, or ``None`` to exclude the sample."""
        ...

    def describe(self) -> dict[str, Any]:
        """Return a JSON-safe description of how buckets are computed."""
        ...


def check_bucket_key(value: object, key: str) -> BucketKey | None:
    """Validate a bucket key returned for sample ``key``; return it normalised.

    ``numpy`` integers and floats become ``int`` / ``float``. ``None`` passes through.

    Raises:
        BucketError: ``value`` is not a str, int or finite float (``bool`` is refused
            because a keep/drop predicate passed by mistake would return one).
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BucketError(
            f"sample {key!r}: bucket key {value!r} of type {type(value).__name__} is not "
            "a str, int or float; return one of those (or None to exclude the sample)"
        )
    if isinstance(value, numbers.Integral):
        return int(value)
    if not math.isfinite(float(value)):
        raise BucketError(f"sample {key!r}: bucket key {value!r} is not finite (not JSON-safe)")
    return float(value)


RatioLike = str | float | int | tuple[float, float]


def _fmt_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


#: Default candidates of :class:`AspectBuckets` / :class:`ImageBuckets` (w:h).
DEFAULT_RATIOS: tuple[str, ...] = (
    "1:1", "5:4", "4:5", "4:3", "3:4", "3:2", "2:3", "16:9", "9:16", "2:1", "1:2", "21:9", "9:21",
)


def _positive(text: object, item: object) -> float:
    try:
        value = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(text, bool) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"ratio {item!r} is not a positive ratio; write it as '4:3', '1.333' or (4, 3)")
    return value


def _ratio_entry(item: RatioLike) -> tuple[str, float]:
    """Return (canonical label, value) of one ratio."""
    if isinstance(item, str) and ":" in item:
        w_text, _, h_text = item.partition(":")
        width, height = _positive(w_text.strip(), item), _positive(h_text.strip(), item)
        return f"{_fmt_number(width)}:{_fmt_number(height)}", width / height
    if isinstance(item, (tuple, list)):
        if len(item) != 2:
            raise ConfigError(f"ratio {item!r} must be a (width, height) pair")
        width, height = _positive(item[0], item), _positive(item[1], item)
        return f"{_fmt_number(width)}:{_fmt_number(height)}", width / height
    value = _positive(item.strip() if isinstance(item, str) else item, item)
    return _fmt_number(value), value


def parse_ratios(text: str) -> tuple[str, ...]:
    """Parse a CLI ratio list such as ``"1:1,4:3,3:4,16:9"`` or ``"1,1.333,0.75"``.

    Raises:
        ConfigError: An item is empty or not a positive ratio.
    """
    items = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part for part in items):
        raise ConfigError(
            f"--ratios {text!r}: write a comma-separated list such as '1:1,4:3,3:4,16:9' or '1,1.333'"
        )
    return tuple(_ratio_entry(part)[0] for part in items)


def _normalize_ratios(
    ratios: Sequence[RatioLike] | str | None, step: float | None, owner: str
) -> tuple[tuple[str, ...] | None, tuple[float, ...]]:
    """Validate ``ratios`` / ``step``; return (labels or None, log values)."""
    if ratios is not None and step is not None:
        raise ConfigError(f"{owner}: give either ratios or step, not both")
    if step is not None:
        numeric = isinstance(step, (int, float)) and not isinstance(step, bool)
        if not (numeric and math.isfinite(step) and step > 0):
            raise ConfigError(f"{owner}: step must be a positive number such as 0.25, got {step!r}")
        return None, ()
    if isinstance(ratios, str):
        ratios = parse_ratios(ratios)
    entries = [_ratio_entry(item) for item in (DEFAULT_RATIOS if ratios is None else ratios)]
    if not entries:
        raise ConfigError(f"{owner}: ratios is empty; give at least one ratio such as '1:1'")
    logs = tuple(math.log(value) for _, value in entries)
    for i, a in enumerate(logs):
        for j in range(i):
            if abs(a - logs[j]) < 1e-12:
                raise ConfigError(
                    f"{owner}: ratios {entries[j][0]!r} and {entries[i][0]!r} are the same ratio; drop one"
                )
    return tuple(label for label, _ in entries), logs


def _quantize(
    ratio: float, labels: tuple[str, ...] | None, logs: tuple[float, ...], step: float | None
) -> str:
    """Bucket label of ``ratio``: nearest candidate in log space (first on ties), or rounded to ``step``."""
    if step is not None:
        decimals = _decimals(step)
        return f"{max(1, round(ratio / step)) * step:.{decimals}f}"
    target = math.log(ratio)
    order, sorted_logs = _sorted_logs(logs)
    # the nearest candidate is a neighbour of target's place in the sorted logs; among
    # equally near ones the first listed wins, as min(range(...)) would pick
    j = bisect.bisect_left(sorted_logs, target)
    best = min((abs(target - sorted_logs[c]), order[c]) for c in (j - 1, j) if 0 <= c < len(order))[1]
    return (labels or ())[best]


@functools.lru_cache(maxsize=64)
def _sorted_logs(logs: tuple[float, ...]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    order = tuple(sorted(range(len(logs)), key=lambda i: (logs[i], i)))
    return order, tuple(logs[i] for i in order)


@functools.lru_cache(maxsize=64)
def _decimals(step: float) -> int:
    return max(0, -int(Decimal(repr(float(step))).normalize().as_tuple().exponent))


def _load_json(key: str, data: Mapping[str, bytes], member: str) -> Any:
    raw = data.get(member)
    if raw is None:
        raise BucketError(
            f"sample {key!r} has no .{member} member; every sample needs one for this "
            "bucket function (or bucket with another --bucket-by)"
        )
    try:
        try:  # JSON members are UTF-8 in practice: decoding first skips json's encoding sniffing
            return _json_decode(raw.decode("utf-8"))
        except UnicodeDecodeError:
            return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BucketError(f"sample {key!r}: .{member} member is not valid JSON: {exc}") from exc


_json_decode = json.JSONDecoder().decode
_json_scan = json.scanner.make_scanner(json.JSONDecoder())  # one value at an offset: (value, end)
_NUMBER = frozenset((int, float))  # JSON numbers (bool is not one)
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def _get_path(doc: Any, path: str, key: str, member: str) -> Any:
    node = doc
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise BucketError(
                f"sample {key!r}: field {path!r} is missing from its .{member} member "
                f"(no {part!r}); fix the data or choose another field"
            )
        node = node[part]
    return node


def _positive_number(doc: Any, path: str, key: str, member: str) -> float:
    value = doc.get(path) if type(doc) is dict and "." not in path else None  # fast path: a top-level field
    if type(value) is int or type(value) is float:
        if value > 0 and value != math.inf:
            return float(value)
    value = _get_path(doc, path, key, member)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BucketError(f"sample {key!r}: field {path!r} = {value!r} is not a number")
    if not (math.isfinite(value) and value > 0):
        raise BucketError(f"sample {key!r}: field {path!r} = {value!r} must be a positive number")
    return float(value)


def _check_path(path: object, what: str) -> None:
    if not isinstance(path, str) or "" in path.split("."):
        raise ConfigError(f"{what} must be a dotted field name like 'width' or 'meta.lang', got {path!r}")


def _check_member(name: str, what: str) -> None:
    if not isinstance(name, str) or not name or name.startswith("."):
        raise ConfigError(f"{what} must be a member extension like 'json', got {name!r}")


@dataclass(frozen=True)
class SingleBucket:
    """Every sample in one bucket, keyed ``"all"`` (CLI ``--bucket-by none``)."""

    members: tuple[str, ...] = field(default=(), init=False)
    head_bytes: int | None = field(default=None, init=False)

    def __call__(self, key: str, data: Mapping[str, bytes]) -> str:
        return "all"

    def describe(self) -> dict[str, Any]:
        return {"kind": "none"}


class _OneMember:
    """Bucket functions that read one whole member, named by their ``member`` field."""

    member: str

    @property
    def members(self) -> tuple[str, ...]:
        return (self.member,)

    @property
    def head_bytes(self) -> int | None:
        return None


@dataclass(frozen=True)
class AspectBuckets(_OneMember):
    """Aspect ratio ``width / height`` read from numeric fields of a JSON member.

    The key is the label of the nearest of ``ratios`` in log space (``"16:9"``), or, with
    ``step``, the ratio rounded to a multiple of ``step`` with the step's decimals
    (``step=0.25`` gives ``"1.25"``, ``"1.00"``; never below one step).

    Args:
        width_field: Dotted path of the width in the JSON document.
        height_field: Dotted path of the height.
        ratios: Candidate ratios (``"4:3"``, ``(4, 3)``, ``1.333``); default: common
            image-trainer ratios. Mutually exclusive with ``step``.
        step: Round the ratio to this multiple instead of choosing a candidate.
        member: Extension of the JSON member.
    """

    width_field: str = "width"
    height_field: str = "height"
    ratios: Sequence[RatioLike] | str | None = None
    step: float | None = None
    member: str = "json"
    _logs: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("width_field", "height_field"):
            _check_path(getattr(self, name), f"AspectBuckets.{name}")
        _check_member(self.member, "AspectBuckets.member")
        labels, logs = _normalize_ratios(self.ratios, self.step, "AspectBuckets")
        object.__setattr__(self, "ratios", labels)
        object.__setattr__(self, "_logs", logs)

    def __call__(self, key: str, data: Mapping[str, bytes]) -> str:
        doc = _load_json(key, data, self.member)
        width = _positive_number(doc, self.width_field, key, self.member)
        height = _positive_number(doc, self.height_field, key, self.member)
        return _quantize(width / height, self.ratios, self._logs, self.step)  # type: ignore[arg-type]

    def many(self, keys: Sequence[str], columns: Mapping[str, Sequence[bytes | None]]) -> list[Any]:
        """``self(key, data)`` for many samples at once: the bucket, or the exception
        it raises, for each key. ``columns[ext][i]`` is sample ``i``'s member ``ext``
        (``None``: it has none). The same results as one call per sample, about three
        times faster: plain documents are parsed by json's C scanner and ratios
        quantised in numpy; anything else takes the per-sample path, with its messages."""
        n = len(keys)
        out: list[Any] = [None] * n
        member, wf, hf = self.member, self.width_field, self.height_field
        column = columns.get(member) or [None] * n
        fast, ratios = self._many_plain(column) if "." not in wf and "." not in hf else ([], [])
        for i in sorted(set(range(n)).difference(fast)) if len(fast) < n else ():
            try:  # the per-sample path, with its messages
                out[i] = self(keys[i], {} if column[i] is None else {member: column[i]})
            except Exception as exc:  # noqa: BLE001 - returned, as the indexer's contract says
                out[i] = exc
        if fast and self.step is not None:
            for i, r in zip(fast, ratios):
                try:  # a ratio near the float maximum overflows when divided by the step
                    out[i] = _quantize(r, None, (), self.step)
                except Exception as exc:  # noqa: BLE001 - returned, as from __call__
                    out[i] = exc
        elif fast:  # the nearest candidate in log space, the first listed on ties, as _quantize
            logs = np.fromiter(map(math.log, ratios), dtype=np.float64, count=len(ratios))
            nearest = np.abs(logs[:, None] - np.asarray(self._logs)[None, :]).argmin(1)
            labels = self.ratios or ()
            if len(fast) == n:  # every sample plain: the labels in order
                return [labels[j] for j in nearest.tolist()]  # type: ignore[index]
            for i, j in zip(fast, nearest.tolist()):
                out[i] = labels[j]  # type: ignore[index]
        return out

    def _many_plain(self, column: Sequence[bytes | None]) -> tuple[list[int], list[float]]:
        """(indices, ratios) of the samples whose member is one JSON object with top-level
        positive finite numbers for both fields; the rest take the per-sample path.

        Whole-column steps in C first (decode, scan, field lookups, type sets); any
        exception sends every sample through the per-sample loop below instead."""
        scan, wf, hf = _json_scan, self.width_field, self.height_field
        try:  # map() with C functions: no Python frame per sample
            texts = list(map(bytes.decode, column))  # type: ignore[arg-type]
            parsed = list(map(scan, texts, itertools.repeat(0)))
            if list(map(_SECOND, parsed)) == list(map(len, texts)):  # nothing after the object
                docs = list(map(_FIRST, parsed))
                ws = list(map(operator.itemgetter(wf), docs))
                hs = list(map(operator.itemgetter(hf), docs))
                if set(map(type, ws)) <= _NUMBER and set(map(type, hs)) <= _NUMBER:
                    w, h = np.array(ws, np.float64), np.array(hs, np.float64)
                    with np.errstate(all="ignore"):
                        r = w / h
                    # positive finite fields, and a ratio that neither underflows to 0 nor
                    # overflows: __call__ says what happens to the others
                    good = (w > 0) & (h > 0) & (w < math.inf) & (h < math.inf) & (r > 0) & (r < math.inf)
                    return np.flatnonzero(good).tolist(), r[good].tolist()
        except Exception:  # noqa: BLE001 - one sample is unusual: look at each below
            pass
        fast: list[int] = []
        ratios: list[float] = []
        inf = math.inf
        for i, raw in enumerate(column):
            try:
                t = raw.decode("utf-8")  # type: ignore[union-attr]
                doc, end = scan(t, 0)
                w, h = doc[wf], doc[hf]
                if end == len(t) and type(w) in _NUMBER and type(h) in _NUMBER and 0 < w < inf and 0 < h < inf:
                    r = float(w) / float(h)
                    if 0 < r < inf:
                        ratios.append(r)
                        fast.append(i)
            except Exception:  # noqa: BLE001 - the per-sample path says what is wrong
                pass
        return fast, ratios

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "aspect",
            "member": self.member,
            "width_field": self.width_field,
            "height_field": self.height_field,
            "ratios": list(self.ratios) if self.ratios else None,
            "step": self.step,
        }


@dataclass(frozen=True)
class JsonField(_OneMember):
    """A JSON field's value as the bucket key, or its band among ``boundaries``.

    Without ``boundaries`` the key is the field's value: a str, int or float as is, a
    bool as ``"true"`` / ``"false"``; null, lists and objects are errors. With sorted
    ``boundaries`` ``b0 < b1 < ... < bn`` the key is the band label of a numeric value
    ``v``: ``"<b0"`` if ``v < b0``, ``"bi-bj"`` if ``bi <= v < bj``, ``">=bn"`` if
    ``v >= bn`` (integral boundaries print without a decimal point).

    Args:
        field: Dotted path such as ``"meta.lang"``.
        boundaries: Strictly increasing finite numbers, or None.
        member: Extension of the JSON member.
    """

    field: str
    boundaries: tuple[float, ...] | None = None
    member: str = "json"

    def __post_init__(self) -> None:
        _check_path(self.field, "JsonField.field")
        _check_member(self.member, "JsonField.member")
        if self.boundaries is not None:
            bounds = tuple(self.boundaries)
            if not bounds or any(
                isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) for b in bounds
            ):
                raise ConfigError(f"JsonField.boundaries must be finite numbers, got {self.boundaries!r}")
            if any(a >= b for a, b in zip(bounds, bounds[1:])):
                raise ConfigError(f"JsonField.boundaries must be strictly increasing, got {list(bounds)}")
            object.__setattr__(self, "boundaries", bounds)

    def band(self, value: float) -> str:
        """Return the band label of ``value`` among the boundaries."""
        bounds = self.boundaries or ()
        if value < bounds[0]:
            return f"<{_fmt_number(bounds[0])}"
        for low, high in zip(bounds, bounds[1:]):
            if value < high:
                return f"{_fmt_number(low)}-{_fmt_number(high)}"
        return f">={_fmt_number(bounds[-1])}"

    def __call__(self, key: str, data: Mapping[str, bytes]) -> BucketKey:
        value = _get_path(_load_json(key, data, self.member), self.field, key, self.member)
        if self.boundaries is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise BucketError(
                    f"sample {key!r}: field {self.field!r} = {value!r} is not a finite number, "
                    "but --boundaries needs one"
                )
            return self.band(value)
        if isinstance(value, bool):
            return "true" if value else "false"
        if value is None or not isinstance(value, (str, int, float)):
            raise BucketError(
                f"sample {key!r}: field {self.field!r} = {value!r} is not a string or number; "
                "bucket on a scalar field"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise BucketError(
                f"sample {key!r}: field {self.field!r} = {value!r} is not finite (not JSON-safe)"
            )
        return value

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "json",
            "member": self.member,
            "field": self.field,
            "boundaries": list(self.boundaries) if self.boundaries is not None else None,
        }


@dataclass(frozen=True)
class ImageBuckets:
    """Aspect buckets from the image member's own header (no JSON, no decoding).

    Keys are as for :class:`AspectBuckets`. The first of ``exts`` present in the sample
    is used. If the size lies beyond ``head_bytes`` (a JPEG with a large EXIF or ICC
    segment before its SOF), :meth:`needs_more` is true: the indexer should re-read the
    whole member and call again; a call on the short read raises a BucketError that
    says so.

    Args:
        ratios: Candidate ratios, as for :class:`AspectBuckets`.
        step: Round the ratio to this multiple instead.
        exts: Image member extensions, in order of preference.
        head_bytes: Bytes of the member to read first (None: the whole member).
    """

    ratios: Sequence[RatioLike] | str | None = None
    step: float | None = None
    exts: tuple[str, ...] = ("png", "jpg", "jpeg", "webp")
    head_bytes: int | None = 65536
    _logs: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.exts, str) or not self.exts:
            raise ConfigError(
                f"ImageBuckets.exts must be a non-empty tuple like ('png', 'jpg'), got {self.exts!r}"
            )
        object.__setattr__(self, "exts", tuple(self.exts))
        for ext in self.exts:
            _check_member(ext, "ImageBuckets.exts item")
        hb = self.head_bytes
        if hb is not None and (isinstance(hb, bool) or not isinstance(hb, int) or hb < 64):
            raise ConfigError(f"ImageBuckets.head_bytes must be None or an int >= 64, got {hb!r}")
        labels, logs = _normalize_ratios(self.ratios, self.step, "ImageBuckets")
        object.__setattr__(self, "ratios", labels)
        object.__setattr__(self, "_logs", logs)

    @property
    def members(self) -> tuple[str, ...]:
        return self.exts

    def _pick(self, key: str, data: Mapping[str, bytes]) -> tuple[str, bytes]:
        for ext in self.exts:
            if ext in data:
                return ext, data[ext]
        wanted = ", ".join("." + ext for ext in self.exts)
        raise BucketError(
            f"sample {key!r} has no image member (looked for {wanted}); pass ImageBuckets(exts=...)"
        )

    def needs_more(self, data: Mapping[str, bytes]) -> bool:
        """True if the size lies beyond the ``head_bytes`` read: re-read the whole member."""
        if self.head_bytes is None:
            return False
        for ext in self.exts:
            if ext in data:
                raw = data[ext]
                try:
                    return len(raw) >= self.head_bytes and image_size_or_none(raw) is None
                except BucketError:
                    return False
        return False

    def __call__(self, key: str, data: Mapping[str, bytes]) -> str:
        ext, raw = self._pick(key, data)
        try:
            size = image_size_or_none(raw)
        except BucketError as exc:
            raise BucketError(f"sample {key!r}: .{ext} member: {exc}") from exc
        if size is None:
            if self.head_bytes is not None and len(raw) >= self.head_bytes:
                raise BucketError(
                    f"sample {key!r}: .{ext} member: image size not found in the first {self.head_bytes} "
                    "bytes (large metadata before the size); raise ImageBuckets(head_bytes=...) or "
                    "re-read the whole member when needs_more() is true"
                )
            raise BucketError(
                f"sample {key!r}: .{ext} member is truncated after {len(raw)} bytes, before its size"
            )
        return _quantize(size[0] / size[1], self.ratios, self._logs, self.step)  # type: ignore[arg-type]

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "image",
            "exts": list(self.exts),
            "head_bytes": self.head_bytes,
            "ratios": list(self.ratios) if self.ratios else None,  # type: ignore[arg-type]
            "step": self.step,
        }


# --- mappings and user callables -----------------------------------------------------


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
            _check_member(ext, "wrap_callable members item")
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


# --- CLI specs -------------------------------------------------------------------------

_FORMS = "none | aspect[:WIDTH_FIELD,HEIGHT_FIELD] | json:FIELD | image | map:FILE"


def _parse_boundaries(text: str) -> tuple[float, ...]:
    try:
        parts = [part.strip() for part in text.split(",")]
        return tuple(float(p) if any(c in p for c in ".eE") else int(p) for p in parts)
    except ValueError as exc:
        raise ConfigError(f"--boundaries {text!r}: write increasing numbers such as '128,256,512'") from exc


def parse_bucket_by(
    spec: str, *, ratios: str | None = None, boundaries: str | None = None, step: float | None = None
) -> BucketFn:
    """Build a bucket function from the CLI's ``--bucket-by`` and its options.

    Args:
        spec: ``none``, ``aspect`` or ``aspect:WIDTH_FIELD,HEIGHT_FIELD``, ``json:FIELD``,
            ``image`` or ``map:FILE`` (FILE may be an fsspec URL).
        ratios: ``--ratios`` for aspect/image, e.g. ``"1:1,4:3,3:4,16:9"`` or ``"1,1.333"``.
        boundaries: ``--boundaries`` for json, e.g. ``"128,256,512"``.
        step: ``--step`` for aspect/image, instead of ratios.

    Raises:
        ConfigError: The spec is not one of the accepted forms, or an option does not
            apply to it.
    """
    kind, sep, arg = spec.strip().partition(":") if isinstance(spec, str) else ("", "", "")
    kind, arg = kind.strip().lower(), arg.strip()
    bad = ConfigError(f"--bucket-by {spec!r} is not understood; accepted forms: {_FORMS}")
    if kind not in ("none", "aspect", "json", "image", "map"):
        raise bad
    if (ratios is not None or step is not None) and kind not in ("aspect", "image"):
        raise ConfigError(f"--ratios/--step apply only to --bucket-by aspect or image, not {spec!r}")
    if boundaries is not None and kind != "json":
        raise ConfigError(f"--boundaries applies only to --bucket-by json:FIELD, not {spec!r}")
    parsed_ratios = parse_ratios(ratios) if ratios is not None else None
    if kind in ("none", "image"):
        if sep:
            raise bad
        return SingleBucket() if kind == "none" else ImageBuckets(ratios=parsed_ratios, step=step)
    if kind == "aspect":
        if not sep:
            return AspectBuckets(ratios=parsed_ratios, step=step)
        names = [name.strip() for name in arg.split(",")]
        if len(names) != 2 or not all(names):
            raise bad
        return AspectBuckets(names[0], names[1], ratios=parsed_ratios, step=step)
    if not arg:
        raise bad
    if kind == "json":
        return JsonField(arg, boundaries=_parse_boundaries(boundaries) if boundaries is not None else None)
    return MappingBuckets(arg)
