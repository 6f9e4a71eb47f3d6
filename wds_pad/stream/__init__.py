"""stream: webdataset stages and what a training script iterates: the planned source,
fetch and plan batching, ``BucketedWebDataset`` and ``Loader``, and the shard-level path
(``split_by_node``, ``equalize``, ``ShardStream``, ``ShardLoader``).

May import: ``wds_pad.state``, ``wds_pad.index``, ``wds_pad.io``, ``wds_pad.core``,
``wds_pad.errors``, torch and webdataset. Nothing of cli.
"""
