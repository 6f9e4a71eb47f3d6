"""cli: the ``wds-pad`` command: one module per command family, the table and plot
helpers, the demo and its shard generator.

May import everything below it (stream, state, index, io, core, errors); no module of
the library imports cli.
"""

from .app import main

__all__ = ["main"]
