"""Built-in bucket functions that read a sample's members: none, aspect, json, image.

The protocol they follow is :mod:`.protocol`, the ratio candidates :mod:`.ratios`, the
column fast path of :class:`AspectBuckets` :mod:`.columns`; image sizes are read from
PNG, JPEG and WebP headers without decoding by :mod:`.imagesize`. Every public name of
these is importable from the package, ``wds_pad.index.buckets``.

Invariants:
    * Each built-in follows :class:`BucketFn`: a frozen, picklable dataclass, a pure
      function of ``(key, data)`` whose ``describe()`` is JSON-safe.
    * Keys are readable strings: aspect ratios as the ratio's label (``"4:3"``,
      ``"1.333"``), JSON bands as ``"<128"`` / ``"128-256"`` / ``">=1024"``; a JSON
      field's own value is a str, int or finite float (a bool as ``"true"`` / ``"false"``).
    * Bad configuration raises :class:`ConfigError` at construction; bad sample data
      raises :class:`BucketError` naming the sample key and the field or member at fault.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import BucketError, ConfigError
from .columns import AspectColumns
from .imagesize import image_size_or_none
from .protocol import BucketKey, check_member
from .ratios import RatioLike, format_number, normalize_ratios, quantize

__all__ = ["AspectBuckets", "ImageBuckets", "ImageMember", "JsonField", "SingleBucket", "get_path", "load_json"]


def load_json(key: str, data: Mapping[str, bytes], member: str) -> Any:
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


def get_path(doc: Any, path: str, key: str, member: str) -> Any:
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
    value = get_path(doc, path, key, member)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BucketError(f"sample {key!r}: field {path!r} = {value!r} is not a number")
    if not (math.isfinite(value) and value > 0):
        raise BucketError(f"sample {key!r}: field {path!r} = {value!r} must be a positive number")
    return float(value)


def _check_path(path: object, what: str) -> None:
    if not isinstance(path, str) or "" in path.split("."):
        raise ConfigError(f"{what} must be a dotted field name like 'width' or 'meta.lang', got {path!r}")


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
class AspectBuckets(_OneMember, AspectColumns):
    """Aspect ratio ``width / height`` read from numeric fields of a JSON member.

    The key is the label of the nearest of ``ratios`` in log space (``"16:9"``), or, with
    ``step``, the ratio rounded to a multiple of ``step`` with the step's decimals
    (``step=0.25`` gives ``"1.25"``, ``"1.00"``; never below one step). ``many``, the
    indexer's whole-column path, comes from :mod:`.columns`.

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
        check_member(self.member, "AspectBuckets.member")
        labels, logs = normalize_ratios(self.ratios, self.step, "AspectBuckets")
        object.__setattr__(self, "ratios", labels)
        object.__setattr__(self, "_logs", logs)

    def __call__(self, key: str, data: Mapping[str, bytes]) -> str:
        doc = load_json(key, data, self.member)
        width = _positive_number(doc, self.width_field, key, self.member)
        height = _positive_number(doc, self.height_field, key, self.member)
        return quantize(width / height, self.ratios, self._logs, self.step)  # type: ignore[arg-type]

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
        check_member(self.member, "JsonField.member")
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
            return f"<{format_number(bounds[0])}"
        for low, high in zip(bounds, bounds[1:]):
            if value < high:
                return f"{format_number(low)}-{format_number(high)}"
        return f">={format_number(bounds[-1])}"

    def __call__(self, key: str, data: Mapping[str, bytes]) -> BucketKey:
        value = get_path(load_json(key, data, self.member), self.field, key, self.member)
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


class ImageMember:
    """What reads an image member's header (:class:`ImageBuckets`, the ``image:pixels``
    cost): the first of ``exts`` present in a sample, its first ``head_bytes``, and its
    stored width and height (:func:`image_size_or_none`, nothing decoded)."""

    exts: tuple[str, ...]
    head_bytes: int | None

    def _check_image_fields(self, what: str) -> None:
        if isinstance(self.exts, str) or not self.exts:
            raise ConfigError(f"{what}.exts must be a non-empty tuple like ('png', 'jpg'), got {self.exts!r}")
        object.__setattr__(self, "exts", tuple(self.exts))
        for ext in self.exts:
            check_member(ext, f"{what}.exts item")
        hb = self.head_bytes
        if hb is not None and (isinstance(hb, bool) or not isinstance(hb, int) or hb < 64):
            raise ConfigError(f"{what}.head_bytes must be None or an int >= 64, got {hb!r}")

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

    def image_size(self, key: str, data: Mapping[str, bytes]) -> tuple[int, int]:
        """(width, height) of the sample's image member, from its header.

        Raises:
            BucketError: no image member, a damaged header, or the size not within the
                bytes read (naming the sample and the member).
        """
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
        return size


@dataclass(frozen=True)
class ImageBuckets(ImageMember):
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
        self._check_image_fields("ImageBuckets")
        labels, logs = normalize_ratios(self.ratios, self.step, "ImageBuckets")
        object.__setattr__(self, "ratios", labels)
        object.__setattr__(self, "_logs", logs)

    def __call__(self, key: str, data: Mapping[str, bytes]) -> str:
        width, height = self.image_size(key, data)
        return quantize(width / height, self.ratios, self._logs, self.step)  # type: ignore[arg-type]

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "image",
            "exts": list(self.exts),
            "head_bytes": self.head_bytes,
            "ratios": list(self.ratios) if self.ratios else None,  # type: ignore[arg-type]
            "step": self.step,
        }
