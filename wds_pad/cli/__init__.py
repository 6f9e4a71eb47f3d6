"""cli: the ``wds-pad`` command: ``app`` (the parser, dispatch, errors and signals),
one module per command (``plan``, ``index``, ``inspect``, ``verify``, ``demo``), their
shared helpers in ``common`` (usage errors, argument parsers, tables, the bucket plot),
and ``synth``, the shard generator of the demo, the tests and the tools.

``app`` imports the commands; a command imports ``common``, never ``app`` nor another
command.

May import everything below it (stream, state, index, io, core, errors); no module of
the library imports cli.
"""

from .app import main

__all__ = ["main"]
