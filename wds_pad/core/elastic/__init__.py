"""core.elastic: what is left of an epoch on another DP layout: one remainder for every
sizing and entry order (remainder.py), walking levels (levels.py) listed as runs
(listlevels.py) or as a budget's strata (stratalevels.py).

May import: every other part of core, ``wds_pad.errors``.
"""
