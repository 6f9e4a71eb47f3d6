"""The version of wds_pad, in one place.

Invariants:
    * Imports nothing: any module may read it (``from ..version import __version__``)
      without importing the package face, ``wds_pad/__init__.py``, which re-exports it.
"""

__version__ = "0.1.0"
