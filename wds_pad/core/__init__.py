"""core: the pure heart of wds_pad: topology, the shared seed's derivations, the keyed
permutation and every planner (policies, padding, the schedule, shard locality, the
elastic remainder, the shard-level deal, the per-window shard schedule and a node's reads).

Owns: ``Topology``, ``plan_epoch`` / ``Plan`` / ``Dataset`` / ``Policy`` / ``Mode`` /
``PadTo``, ``iter_steps``, ``plan_remainder``, ``deal_shards`` / ``worker_plan``,
``shard_reads`` / ``node_uses``, stable seed derivation (``derive_rng``, ``stable_digest``) and the one
JSON digest (``json_digest``).

May import: ``wds_pad.errors``, numpy and the standard library. Never fsspec, never the
clock, never torch.distributed at import time (every use of a process group goes through
``collective``, which imports it lazily, inside the call). ``tests/core/test_layout.py`` imports this package with those blocked.
"""
