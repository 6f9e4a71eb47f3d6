"""core.planning: how one epoch is planned, for every sizing and entry order.

Owns: ``plan_epoch`` / ``iter_steps`` (plan.py: the composition, the one bucket planner,
the bucket cuts chosen by the sizing's ``kind``), the ``Plan`` / ``Batch`` / ``BucketStats`` records and the keyed
entry order (planrecord.py), keep/pad/drop of every bucket under one size guard
(buckettable.py), the step schedule (schedule.py) and the datasets' proportions
(proportion.py).

May import: core's root (topology, seed, permute, policy, dataset, sizing, sampleseed),
``core.budgets`` and ``core.local`` (the planners it composes), ``wds_pad.errors``.
"""
