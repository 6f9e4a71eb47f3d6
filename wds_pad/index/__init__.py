"""index: shards -> buckets, once: the bucket functions, build / update / verify, and the
memory-mappable index file.

Modules, in the order of the flow: ``buckets`` (a sub-package: the bucket functions, their
CLI spelling, image headers, the cost functions), ``shardfile`` (a shard's size, change stamp, opening),
``build`` (scanning shards through ``wds_pad.tar``, ``build_index``, update), ``samples``
(a scanned shard's bucket keys and costs), ``rows``
(one shard's rows, joined into an Index: ``make_index``), ``distributed`` and
``jobstore`` (``build_index_distributed``: parts over the ranks of a torch.distributed
job), ``record`` (the ``Index`` and ``ShardInfo`` records), ``layout`` (what the file
holds: version, sections, header, digest), ``codec`` (an Index to bytes and back,
``load_index``), ``location`` (shard URLs stored relative to the index file, and
relocation), ``merge`` (``merged_parts``: part files merged without holding the
index), ``output`` (refusing an output path, ``write_index``), ``verify``
(``verify_index``), ``progress`` (the bar on stderr).

Owns: ``Index``, ``ShardInfo``, ``build_index``, ``build_index_distributed``, ``load_index``, ``write_index``,
``verify_index``, the bucket functions (``aspect:...``, ``length:...``, ...).

May import: ``wds_pad.tar`` (scanning and parsing tar shards), ``wds_pad.io``
(filesystems, URL patterns, atomic writes), ``wds_pad.core`` (the planner's ``Dataset``),
``wds_pad.errors``. Nothing of state, stream or cli.
"""

from .codec import load_index
from .layout import FORMAT_VERSION, MAGIC
from .output import check_output, write_index
from .record import Index, ShardInfo
from .rows import make_index

__all__ = ["FORMAT_VERSION", "MAGIC", "Index", "ShardInfo", "check_output", "load_index", "make_index",
           "write_index"]
