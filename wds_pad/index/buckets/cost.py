"""Cost functions: a sample's cost (tokens, frames, seconds, pixels, bytes), recorded per
sample by ``wds-pad index --cost`` for planners that batch by a budget.

Three kinds, spelled as the CLI spells them (:func:`parse_cost`):

- ``json:FIELD``: a number in the sample's ``.json`` member (``FIELD`` a dotted path for
  nested keys: ``meta.tokens``), :class:`JsonCost`;
- ``image:pixels``: width x height from the image member's own header, read as
  ``--bucket-by image`` reads it (nothing decoded), :class:`ImagePixels`;
- ``bytes``: the sample's payload bytes, the sum of its members' sizes (from the tar
  headers; nothing read), :class:`PayloadBytes`.

Invariants:
    * A cost function is frozen and picklable, a pure function of ``(key, data,
      payload)`` (``data`` the members it asks for, ``payload`` the sample's payload
      bytes); ``describe()`` is its CLI spelling, stored in the index header.
    * A cost is a non-negative finite number (:func:`check_cost`); anything else (a
      missing member or field, a bool, a string, a negative or infinite number) raises
      :class:`BucketError` naming the sample key and the field or member; the indexer
      adds the shard URL and byte offset.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ...errors import BucketError, ConfigError
from .builtin import ImageMember, get_path, load_json

__all__ = ["COST_FORMS", "CostFn", "ImagePixels", "JsonCost", "PayloadBytes", "check_cost", "parse_cost"]

COST_FORMS = "json:FIELD | image:pixels | bytes"

Cost = int | float


@runtime_checkable
class CostFn(Protocol):
    """What the indexer needs from a cost function (members and head_bytes as for a
    bucket function)."""

    members: tuple[str, ...]
    head_bytes: int | None

    def __call__(self, key: str, data: Mapping[str, bytes], payload: int) -> Cost:
        """The sample's cost; raises BucketError when it has none."""
        ...

    def describe(self) -> str:
        """The CLI spelling (``"json:tokens"``), stored as the index's cost kind."""
        ...


def check_cost(value: object, key: str, what: str) -> Cost:
    """``value`` as a cost of sample ``key`` (``what``: where it came from, for messages).

    Raises:
        BucketError: not a number (a bool, a string, null, a list), negative, or not finite.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BucketError(f"sample {key!r}: {what} = {value!r} is not a number; a cost is a non-negative "
                          "finite number")
    if isinstance(value, float) and not math.isfinite(value):
        raise BucketError(f"sample {key!r}: {what} = {value!r} is not finite; a cost is a non-negative finite number")
    if value < 0:
        raise BucketError(f"sample {key!r}: {what} = {value!r} is negative; a cost is a non-negative finite number")
    return value


@dataclass(frozen=True)
class JsonCost:
    """A number in a JSON member: ``json:tokens``, ``json:meta.frames``.

    Args:
        field: Dotted path of the number in the sample's ``.json`` member.
    """

    field: str

    def __post_init__(self) -> None:
        if not isinstance(self.field, str) or "" in self.field.split("."):
            raise ConfigError(f"--cost json:FIELD needs a dotted field name like 'tokens' or 'meta.frames', "
                              f"got {self.field!r}")

    members = ("json",)
    head_bytes = None

    def __call__(self, key: str, data: Mapping[str, bytes], payload: int) -> Cost:
        value = get_path(load_json(key, data, "json"), self.field, key, "json")
        return check_cost(value, key, f"field {self.field!r}")

    def describe(self) -> str:
        return f"json:{self.field}"


@dataclass(frozen=True)
class ImagePixels(ImageMember):
    """Width x height of the image member, from its header (``image:pixels``).

    Args:
        exts: Image member extensions, in order of preference.
        head_bytes: Bytes of the member to read first (a JPEG whose size lies beyond
            them is read again whole, as ``--bucket-by image`` does).
    """

    exts: tuple[str, ...] = ("png", "jpg", "jpeg", "webp")
    head_bytes: int | None = 65536

    def __post_init__(self) -> None:
        self._check_image_fields("ImagePixels")

    def __call__(self, key: str, data: Mapping[str, bytes], payload: int) -> Cost:
        width, height = self.image_size(key, data)
        return int(width) * int(height)

    def describe(self) -> str:
        return "image:pixels"


@dataclass(frozen=True)
class PayloadBytes:
    """The sample's payload bytes: its members' sizes summed (``bytes``)."""

    members: tuple[str, ...] = field(default=(), init=False)
    head_bytes: int | None = field(default=None, init=False)

    def __call__(self, key: str, data: Mapping[str, bytes], payload: int) -> Cost:
        return int(payload)

    def describe(self) -> str:
        return "bytes"


def parse_cost(spec: Any) -> CostFn:
    """A cost function from its CLI spelling (``--cost``), or one given as is.

    Raises:
        ConfigError: not one of ``json:FIELD``, ``image:pixels``, ``bytes``.
    """
    if isinstance(spec, (JsonCost, ImagePixels, PayloadBytes)):
        return spec
    if not isinstance(spec, str):
        raise ConfigError(f"cost must be one of {COST_FORMS} (a string), got {type(spec).__name__}")
    kind, sep, arg = spec.strip().partition(":")
    kind, arg = kind.strip().lower(), arg.strip()
    if kind == "bytes" and not sep:
        return PayloadBytes()
    if kind == "image" and arg == "pixels":
        return ImagePixels()
    if kind == "json" and arg:
        return JsonCost(arg)
    raise ConfigError(f"--cost {spec!r} is not understood; accepted forms: {COST_FORMS}")
