"""core.budgets: batches sized by cost: a budget (budget.py), its strata (strata.py), its
bucket cuts and lockstep cuts (budgetplan.py), and packs (packing.py, packplan.py: a
Pack planned as the budget of one pack, B packs a batch).

May import: core's root, ``core.planning``'s records and bucket table, ``core.local`` (a
budget read shard-locally), ``wds_pad.errors``.
"""
