"""tar: everything that knows tar bytes: header fields and their faults, webdataset's
grouping of members into samples, the general scanner and parser, and the indexer's lean
(columnar) scanners.

Modules, from the bytes up: ``headers`` (a shard's bytes at offsets, one archive entry
with ``tarfile``'s rules, every fault message), ``members`` (the per-member step:
entries grouped into webdataset samples), ``scan`` (``scan_tar``, ``parse_sample``,
``parse_sample_at``: the general parser), ``columns`` and ``lean`` (``scan_rows`` /
``scan_many``: the lean path, rows as columns).

May import: ``wds_pad.io``, ``wds_pad.core``, ``wds_pad.errors``. Nothing of index, state,
stream or cli: the index builds on it, and streaming parses with it.
"""
