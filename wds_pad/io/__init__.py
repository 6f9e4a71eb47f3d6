"""io: everything that touches bytes in a filesystem or store: filesystems and URL
patterns, credentials and their redaction, error classification of stores, range
reads (many in flight), local read-ahead, atomic local writes, whole shards of a
shard-local plan (one process's memory, or one copy per node on disk).

Owns: ``RangeReader``, ``ReadOptions``, ``get_filesystem``, ``expand_urls``, ``redact``,
``atomic_write``.

May import: ``wds_pad.errors`` only. Not ``core`` (its peer: neither imports the other),
nor anything of tar, index, state, stream or cli.
"""
