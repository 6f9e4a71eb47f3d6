"""core.local: shard and node locality: how shards are dealt (locality.py), a rank's
shard-local order (localbuckets.py), what a reader fetches whole (shardschedule.py), the
shard-level deal (shardsplit.py), what a plan reads (reads.py) and a job's reads simulated
(simulate.py).

May import: core's root, ``core.planning``'s records, ``wds_pad.errors``.
"""
