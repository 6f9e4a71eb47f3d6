"""The CLI spelling of a bucket function: ``--bucket-by`` and its options to a BucketFn.

Invariants:
    * :func:`parse_bucket_by` only builds: ``parse_bucket_by(spec, ...)`` equals the
      built-in constructed directly (``"aspect:w,h"`` gives ``AspectBuckets("w", "h")``),
      so the CLI and the Python API index identically.
    * A spec that is not one of the accepted forms, or an option given to a form it does
      not apply to, raises :class:`ConfigError` with a one-line message that lists the
      accepted forms or names the option.
"""

from __future__ import annotations

from ...errors import ConfigError
from .protocol import BucketFn
from .ratios import parse_ratios
from .user import MappingBuckets
from .builtin import AspectBuckets, ImageBuckets, JsonField, SingleBucket

__all__ = ["parse_bucket_by"]

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
