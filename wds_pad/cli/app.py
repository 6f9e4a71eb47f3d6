"""The ``wds-pad`` command line: index | inspect | plan | verify | demo.

The top parser, the dispatch to one module per command (``plan``, ``demo``, ``index``,
``inspect``, ``verify``: each registers itself with ``add_parser``), and the handling
of errors and signals. Commands import their helpers from :mod:`.common`, never this
module.

Starts fast: nothing here imports torch; subcommands import what they need lazily.
Bad arguments print one line starting ``wds-pad <cmd>: error:`` and exit with 2; an
error of ours prints one such line too (its advice in the CLI's spelling, ``--on-error
skip``), exit 2 for bad input, 1 for I/O.
Ctrl-C (SIGINT) and SIGTERM stop a command the same way: one line on stderr, exit 130
or 143 (128 + the signal number), and a file being written keeps its previous content.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any, Sequence

from . import demo, index, inspect, plan, verify
from .common import EXIT_USAGE, Terminated, UsageError, cli_wording, interrupt_exit
from ..errors import WdsPadError

__all__ = ["main"]

#: the subcommands, in the order ``wds-pad --help`` lists them
COMMANDS = (plan, demo, index, inspect, verify)


def _on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated()


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2), as the CLI promises."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="wds-pad", description="WebDataset shards for distributed training.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``wds-pad`` console script."""
    import warnings

    parser = build_parser()
    args = parser.parse_args(argv)
    # warnings (a dropped bucket, ...) read as one line of advice, not a source listing;
    # restored afterwards, for callers that run main() in their own process
    saved_format = warnings.formatwarning
    warnings.formatwarning = lambda message, category, *_rest, **_kw: (  # type: ignore[assignment]
        f"wds-pad {args.command}: warning: {message}\n")
    # SIGTERM unwinds like Ctrl-C (temp files removed, one line, exit 143); only from the
    # main thread, and not when the caller chose to ignore or handle SIGTERM itself
    saved_sigterm = None
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        saved_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _run(args)
    finally:
        warnings.formatwarning = saved_format
        if saved_sigterm is not None:
            signal.signal(signal.SIGTERM, saved_sigterm)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        sys.stderr.write(f"{exc}\n")
        return EXIT_USAGE
    except WdsPadError as exc:
        sys.stderr.write(f"wds-pad {args.command}: error: {cli_wording(str(exc))}\n")
        return EXIT_USAGE if isinstance(exc, ValueError) and not isinstance(exc, OSError) else 1
    except BrokenPipeError:  # `wds-pad plan ... | head`
        return 0
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Terminated)
        code, what = interrupt_exit(exc)
        sys.stderr.write(f"wds-pad {args.command}: {what}\n")
        return code


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
