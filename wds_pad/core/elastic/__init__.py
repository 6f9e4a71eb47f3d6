"""core.elastic: what is left of an epoch on another DP layout: one remainder for every
sizing and entry order (remainder.py), the levels of a count (countlevels.py) and of a
budget (budgetlevels.py).

May import: every other part of core, ``wds_pad.errors``.
"""
