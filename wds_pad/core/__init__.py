"""core: the pure heart of wds_pad: topology, the shared seed's derivations, the keyed
permutation and the planner (policies, padding, the schedule).

Owns: ``Topology``, ``plan_epoch`` / ``Plan`` / ``Dataset`` / ``Policy`` / ``Mode`` /
``PadTo``, ``iter_steps``, stable seed derivation (``derive_rng``, ``stable_digest``).

May import: ``wds_pad.errors``, numpy and the standard library. Never fsspec, never the
clock, never torch.distributed at import time (``Topology.detect`` and ``shared_seed``
import it lazily, inside the call: they are the two places that talk to a process
group). ``tests/core/test_layout.py`` imports this package with those blocked.
"""
