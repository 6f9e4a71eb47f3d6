"""tar: everything that knows tar bytes: header fields and their faults, webdataset's
grouping of members into samples, the general scanner and parser, the indexer's lean
(columnar) scanners, and the header check of the member-table fast path.

Modules, from the bytes up: ``reader`` (a shard's bytes at offsets), ``headers`` (one
archive entry with ``tarfile``'s rules, every fault message), ``members`` (the per-member step:
entries grouped into webdataset samples; a key's bytes), ``scan`` (``scan_tar``, ``parse_sample``,
``parse_sample_at``: the general parser), ``columns`` (``ScanRows``: a shard's samples as
columns), ``settle`` (the lean path's header checks in numpy), ``leanstream`` and ``lean``
(``scan_rows`` / ``scan_many``: the lean path in stream and seek mode), ``names`` (does a
member's header still say what the member table records: the fast path's check).

Owns: ``scan_tar``, ``parse_sample``, ``parse_sample_at``, ``ScannedSample``, ``Member``,
``OnError``, ``split_key``, ``key_bytes``, ``key_text``, ``scan_rows``, ``scan_many``,
``ScanRows``, ``slice_sample``, ``slice_sample_at``.

May import: ``wds_pad.io``, ``wds_pad.core``, ``wds_pad.errors``. Nothing of index, state,
stream or cli: the index builds on it, and streaming parses with it.
"""
