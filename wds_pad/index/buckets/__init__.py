"""buckets: the bucket functions (the bucket key of a sample, from its members) and the
cost functions (a sample's cost, from the same members).

Modules: ``protocol`` (``BucketFn``, what a bucket function is; ``check_bucket_key``),
``builtin`` (the built-ins that read members: ``SingleBucket``, ``AspectBuckets``,
``JsonField``, ``ImageBuckets``), ``ratios`` (aspect-ratio candidates and their labels),
``columns`` (``AspectBuckets`` over a whole column of ``.json`` members at once),
``imagesize`` (PNG, JPEG and WebP sizes from their headers, for ``ImageBuckets``),
``user`` (the user's own: a callable, ``wrap_callable``, or a key table,
``MappingBuckets``), ``spec`` (the CLI spelling, ``--bucket-by``, to a ``BucketFn``),
``cost`` (``--cost json:FIELD | image:pixels | bytes``: ``JsonCost``, ``ImagePixels``,
``PayloadBytes``, ``parse_cost``).

Owns: the names below, importable from here (``wds_pad.index.buckets``), and
``parse_bucket_by`` (``spec``).

May import: ``wds_pad.errors`` (and fsspec, inside the call, for a mapping file). Nothing
else of wds_pad: the build (``wds_pad.index.build``) calls the functions.
"""

from .builtin import AspectBuckets, ImageBuckets, JsonField, SingleBucket
from .cost import CostFn, ImagePixels, JsonCost, PayloadBytes, parse_cost
from .imagesize import image_size
from .protocol import BucketFn, BucketKey, check_bucket_key
from .ratios import DEFAULT_RATIOS, parse_ratios
from .user import CallableBuckets, MappingBuckets, wrap_callable

__all__ = [
    "DEFAULT_RATIOS",
    "AspectBuckets",
    "BucketFn",
    "BucketKey",
    "CallableBuckets",
    "CostFn",
    "ImageBuckets",
    "ImagePixels",
    "JsonCost",
    "JsonField",
    "MappingBuckets",
    "PayloadBytes",
    "SingleBucket",
    "check_bucket_key",
    "image_size",
    "parse_cost",
    "parse_ratios",
    "wrap_callable",
]
