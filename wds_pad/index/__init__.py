"""index: shards -> buckets, once: tar reading, bucket functions, image headers,
build / update / verify, and the memory-mappable file format.

Owns: ``Index``, ``ShardInfo``, ``build_index``, ``load_index``, ``write_index``,
``verify_index``, the bucket functions (``aspect:...``, ``length:...``, ...).

May import: ``wds_pad.io`` (filesystems, URL patterns, atomic writes), ``wds_pad.core``
(the planner's ``Dataset``), ``wds_pad.errors``. Nothing of state, stream or cli.
"""

from .format import FORMAT_VERSION, MAGIC, Index, ShardInfo, check_output, load_index, make_index, write_index

__all__ = ["FORMAT_VERSION", "MAGIC", "Index", "ShardInfo", "check_output", "load_index", "make_index",
           "write_index"]
