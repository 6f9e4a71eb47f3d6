"""index: shards -> buckets, once: tar reading, bucket functions, image headers,
build / update / verify, and the memory-mappable file format.

Modules, in the order of the flow: ``tarscan`` / ``tarrows`` (tar headers), ``buckets``
and ``imagesize`` (bucket keys), ``shardfile`` (a shard's size, change stamp, opening),
``build`` (scanning shards, ``build_index``, update), ``distributed`` and ``jobstore``
(``build_index_distributed``: parts over the ranks of a torch.distributed job, merged
without holding the index), ``rows`` (one shard's rows, joined into an Index), ``format``
(the Index record, its bytes, ``merged_parts``, ``load_index``), ``output``
(refusing an output path, ``write_index``), ``verify`` (``verify_index``), ``progress``
(the bar on stderr).

Owns: ``Index``, ``ShardInfo``, ``build_index``, ``build_index_distributed``, ``load_index``, ``write_index``,
``verify_index``, the bucket functions (``aspect:...``, ``length:...``, ...).

May import: ``wds_pad.io`` (filesystems, URL patterns, atomic writes), ``wds_pad.core``
(the planner's ``Dataset``), ``wds_pad.errors``. Nothing of state, stream or cli.
"""

from .format import FORMAT_VERSION, MAGIC, Index, ShardInfo, load_index, make_index
from .output import check_output, write_index

__all__ = ["FORMAT_VERSION", "MAGIC", "Index", "ShardInfo", "check_output", "load_index", "make_index",
           "write_index"]
