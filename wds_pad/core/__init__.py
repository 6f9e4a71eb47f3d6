"""core: the pure heart of wds_pad. At its root the shared primitives: topology, the shared
seed's derivations, the keyed permutation, policies, datasets, sizings, per-sample seeds and
the one way to torch.distributed (``collective``). Below it the planners, one sub-package a
concept: ``planning`` (one epoch's plan: the composition, its records, the bucket table, the
schedule, proportions), ``budgets`` (batches sized by cost: budgets, strata, lockstep cuts,
packs), ``local`` (shard and node locality, what a reader fetches whole, the shard-level
deal, what a plan reads, a job's reads simulated) and ``elastic`` (the rest of an epoch on
another DP layout, for every sizing).

Owns: ``Topology``, ``plan_epoch`` / ``Plan`` / ``Dataset`` / ``Policy`` / ``Mode`` /
``PadTo``, ``iter_steps``, ``plan_remainder``, ``deal_shards`` / ``worker_plan``,
``shard_reads`` / ``node_uses``, stable seed derivation (``derive_rng``, ``stable_digest``)
and the one JSON digest (``json_digest``).

May import: ``wds_pad.errors``, numpy and the standard library. Never fsspec, never the
clock, never torch.distributed at import time (every use of a process group goes through
``collective``, which imports it lazily, inside the call). ``tests/test_layout.py`` imports
this package with those blocked, and holds its imports to 6 deep.
"""
