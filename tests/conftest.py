"""Shared test set-up: tools/ on sys.path (servers, fault proxy, bench references)."""

from __future__ import annotations

import os
import sys

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

# Hypothesis: CI runs the invariant properties with their full example counts.
try:
    from hypothesis import settings

    settings.register_profile("ci", deadline=None, print_blob=True)
    settings.load_profile("ci")
except ImportError:  # pragma: no cover
    pass
